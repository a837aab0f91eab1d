"""rigbook: provision local-LLM GPU rigs with pyinfra. One module per concern."""

from pathlib import Path

#: jinja2 templates and static files, one folder per role.
FILES = Path(__file__).resolve().parent.parent / "files"
