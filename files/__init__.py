"""rigbook's package data: templates, recipes, pins and rig-side programs, one folder per role.

Read through ``rigbook.FILES``; nothing here is imported.
"""
