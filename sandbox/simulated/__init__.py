"""Package data of `rigbook sandbox`: the SIMULATED GPU layer of sandbox rigs (README.md).

Read through ``rigbook.sandbox.SIM_DIR``; nothing here is imported, and none of it belongs on a
real rig.
"""
