"""Read a runbook's steps from its Markdown: what to run, where, and what it says you will see.

The markup (docs/runbooks/README.md explains it for authors) is plain fenced code blocks whose
info string starts with the language and goes on with tags:

- ``sh``: commands run from the repository root, one per line (``#`` lines are comments);
  ``sh rig``: commands run on the rig, as root; ``sh real``: needs real hardware or the
  internet, skipped by the test (a ``sh sandbox`` block next to it is its stand-in, run by the
  test); ``exit=N`` is the exit status the runbook promises (default 0); ``enter`` answers
  pyinfra's "Press enter to execute..." prompt.
- ``text expect``: lines the output of the command block before it must show, in order, each
  compared with runs of blanks made one and ``…`` standing for anything.

Other blocks (host data examples, tables of output) are for reading only. A runbook whose
sandbox stand-in needs host data of its own names the inventory that has it in a comment,
``<!-- sandbox inventory: tests/inventories/venvs.py -->``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

_FENCE = re.compile(r"^\s*```(.*)$")  # a fence may be indented under a list item
_INVENTORY = re.compile(r"<!-- sandbox inventory: (\S+) -->")


@dataclass
class Step:
    """One command block, with what its output must show."""

    where: str  # "here" (the operator's machine) or "rig"
    commands: list[str]
    line: int  # where the block starts in the runbook (1-based), for messages
    exit: int = 0
    enter: bool = False
    expect: list[str] = field(default_factory=list)


def parse(path: Path) -> list[Step]:
    """The steps of a runbook, in order; `sh real` blocks are left out."""
    steps: list[Step] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        words = opening.group(1).split()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].lstrip().startswith("```"))
        body = lines[i + 1:end]
        language, tags = (words[0], words[1:]) if words else ("", [])
        if language == "sh" and "real" not in tags:
            step = Step(where="rig" if "rig" in tags else "here", line=i + 1,
                        commands=[c.strip() for c in body
                                  if c.strip() and not c.lstrip().startswith("#")])
            for tag in tags:
                if tag.startswith("exit="):
                    step.exit = int(tag.removeprefix("exit="))
            step.enter = "enter" in tags
            steps.append(step)
        elif language == "text" and "expect" in tags:
            if not steps:
                raise ValueError(f"{path}:{i + 1}: an expect block before any command")
            steps[-1].expect += [line for line in body if line.strip()]
        i = end + 1
    return steps


def sandbox_inventory(path: Path, default: str = "inventory/sandbox.py") -> str:
    """The inventory that stands in for inventory/rigs.py when the runbook runs on the sandbox."""
    match = _INVENTORY.search(path.read_text())
    return match.group(1) if match else default


def _squeeze(text: str) -> str:
    return " ".join(text.split())


def missing(expected: list[str], output: str) -> list[str]:
    """The expected lines the output does not show, in order (empty: all shown)."""
    text = _squeeze(output)
    at, absent = 0, []
    for line in expected:
        parts = [re.escape(_squeeze(part)) for part in line.split("…")]
        match = re.compile(".*?".join(parts), re.DOTALL).search(text, at)
        if match is None:
            absent.append(line)
        else:
            at = match.end()
    return absent
