"""`rigbook init DIR`: a working folder for a fleet, for people who installed rigbook with pip.

What the folder gets is what a clone gives: the config.py that checks every selected host before
pyinfra connects (the clone's own config.py is the same file), an inventory that runs that check
itself as its last line, group data, the generated host-data and recipe docs, a README with the
commands, and a .gitignore that keeps secrets out of git. The jobs are the package's
(`pyinfra inventory.py rigbook.jobs.converge`): nothing of rigbook's code is copied there.
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

from rigbook import FILES
from rigbook.core.errors import RigbookError
from rigbook.core.render import render
from rigbook.core.spec import Rig
from rigbook.docs import write_docs

INIT = FILES / "init"


def key_comments() -> str:
    """Every host-data key as a commented line of Python: `"key": default,  # description`."""
    lines = []
    for key, field in Rig.model_fields.items():
        default = "required" if field.is_required() else repr(field.default)
        lines += textwrap.wrap(f'"{key}": {default},  # {field.description}', width=97,
                               initial_indent="# ", subsequent_indent="#     ")
    return "\n".join(lines)


def init_folder(target: Path, version: str) -> list[Path]:
    """Write the folder; refuse (writing nothing) when `target` exists and is not empty."""
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise RigbookError(f"{target} exists and is not an empty folder: nothing was written; "
                           "name a new folder (rigbook init never overwrites)")
    (target / "group_data").mkdir(parents=True, exist_ok=True)
    (target / "docs").mkdir()
    (target / "secrets").mkdir(mode=0o700)
    shutil.copyfile(INIT / "config.py", target / "config.py")
    shutil.copyfile(INIT / "group_data" / "all.py", target / "group_data" / "all.py")
    shutil.copyfile(INIT / "gitignore", target / ".gitignore")
    (target / "inventory.py").write_text(render(INIT / "inventory.py.j2", keys=key_comments()))
    (target / "README.md").write_text(render(INIT / "README.md.j2", name=target.name,
                                             version=version))
    write_docs(target / "docs")
    return sorted(path for path in target.rglob("*") if path.is_file())
