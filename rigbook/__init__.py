"""rigbook: provision local-LLM GPU rigs with pyinfra. One module per concern.

The package is the roles/ folder of the repository; its data (files/) is ``rigbook.files``
(docs/architecture.md).
"""

from importlib.resources import files
from pathlib import Path

#: jinja2 templates, recipes, pins and rig-side programs, one folder per role.
FILES = Path(str(files("rigbook.files")))
