"""rigbook: provision local-LLM GPU rigs with pyinfra. One module per concern.

Its layers are folders (docs/architecture.md): rigbook/rigside, rigbook/core, the roles (the
repository's roles/ folder, ``rigbook.roles``) and the application at this package's top; its
data (files/) is ``rigbook.files``.
"""

from importlib.resources import files
from pathlib import Path

#: jinja2 templates, recipes, pins and rig-side programs, one folder per role.
FILES = Path(str(files("rigbook.files")))
