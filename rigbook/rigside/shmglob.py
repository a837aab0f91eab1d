"""The one rule for the /dev/shm reaper's file-name patterns (host data and the reaper alike).

A pattern decides which files in /dev/shm a root program may delete, and the same rule is
checked twice: when the inventory loads (rigbook/core/spec.py, guards_shm_patterns) and by the
reaper on the rig, whatever started it (defence in depth: a unit edited by hand, a typo on the
command line). Standard library only: a copy is installed beside the reaper
(/opt/rigbook/guards/shmglob.py), as rigbook/rigside/xid.py is beside the Xid watch, so there is one
rule.
"""

from __future__ import annotations

import re

#: Literal characters a pattern must start with: `s*` or `*.mmap` would match whatever any
#: program keeps in /dev/shm (PulseAudio, browsers, databases, other engines).
PREFIX = 4
EXAMPLE = "vllm_offload_*.mmap"
# The literal prefix never starts with "." (hidden files, the reaper's quarantine folder) or
# "-" (an option); after it, only the glob characters * ? [ ] join the literal ones.
_RULE = re.compile(
    rf"[A-Za-z0-9_][A-Za-z0-9_.-]{{{PREFIX - 1},}}(?:[*?\[][A-Za-z0-9_.*?\[\]-]*)?"
)


def pattern_problem(pattern: str) -> str | None:
    """Why `pattern` may not choose files for the reaper to delete; None when it may."""
    if _RULE.fullmatch(pattern) and ".." not in pattern:
        return None
    return (
        f"{pattern!r}: a /dev/shm file-name glob must start with at least {PREFIX} literal "
        "characters (letters, digits, _ . -; not . or - first) before any * ? [ ], and have "
        f"no other characters (no /, .., spaces, quotes, $ or %), e.g. {EXAMPLE}"
    )
