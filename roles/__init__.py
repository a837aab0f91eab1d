"""The roles: one module each, listed in order by rigbook.core.registry."""
