"""Checks: what each role decides from a rig's facts, as plain data.

A role exposes `CHECKS`, a tuple of `Check`: the facts it needs (`Read`) and a plain function
`(rig, facts, rig name) -> findings`. The same functions serve three callers, so a rule is
written once:

- the preflight step at the start of every deploy (rigbook/preflight.py) refuses a rig on any
  `error` or `gone` finding, before any operation changes it;
- `rigbook status` (rigbook/status.py) shows every finding (an `error` as drift);
- the roles' own operations, which call the same helpers when they execute.

Facts are read in one round trip per rig (`read_facts`): every fact's command runs in one shell,
each section marked, so a rig with ten facts costs one SSH command, not ten.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from pyinfra.api import FactBase, StringCommand
from pyinfra.api.exceptions import FactProcessError
from pyinfra.api.facts import get_fact

from rigbook.core.runfacts import seed
from rigbook.core.spec import Rig

Level = Literal["error", "mismatch", "gone", "drift", "warn"]
#: What a preflight refuses a rig on: a value the rig cannot take, a driver whose user space and
#: loaded kernel module disagree (only a reboot or a reinstall mends it), or a GPU that is gone.
REFUSING: tuple[Level, ...] = ("error", "mismatch", "gone")


@dataclass(frozen=True)
class Finding:
    """One thing about a rig: refused (error), a driver user space / kernel module mismatch,
    unusable (gone), not as declared (drift) or worth a look (warn). `key` is the host-data key
    it concerns, when one does."""

    level: Level
    area: str
    reason: str
    key: str | None = None
    gpu: str | None = None  # the GPU's UUID when the finding is about one GPU

    @property
    def text(self) -> str:
        """Key, what the rig has and what is allowed."""
        return f"{self.key}: {self.reason}" if self.key else self.reason

    def message(self, rig_name: str) -> str:
        """How the operator reads it: host, key, what the rig has and what is allowed."""
        return f"{rig_name}: {self.text}"


def error(area: str, reason: str, key: str | None = None, gpu: str | None = None) -> Finding:
    return Finding("error", area, reason, key, gpu)


def drift(area: str, reason: str, key: str | None = None, gpu: str | None = None) -> Finding:
    return Finding("drift", area, reason, key, gpu)


def warn(area: str, reason: str, key: str | None = None, gpu: str | None = None) -> Finding:
    return Finding("warn", area, reason, key, gpu)


def refusal(area: str, exc: Exception, rig_name: str) -> Finding:
    """An error finding from a RigbookError worded "<rig>: <key>: <reason>" (several lines are
    joined into one)."""
    text = " ".join(str(exc).removeprefix(f"{rig_name}: ").split())
    key, sep, reason = text.partition(": ")
    if sep and re.fullmatch(r"[a-z_]+", key):
        return error(area, reason, key)
    return error(area, text)


@dataclass(frozen=True)
class Read:
    """One fact a check needs: its name among the rig's facts, the pyinfra fact, its arguments
    and what it is in words. Two checks that name the same fact must read it the same way."""

    name: str
    fact: type[FactBase]
    label: str
    kwargs: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Check:
    """A role's check: what it reads and how it decides.

    `gpus`: it needs working GPUs. On a rig whose driver the run is about to install, it is
    deferred until the driver is in (rigbook/preflight.py).
    `said`: the preflight prints its findings even when they refuse nothing (what the run is
    about to repair, which the operator should know of).
    """

    name: str
    reads: Callable[[Rig, str], Iterable[Read]]
    run: Callable[[Rig, Facts, str], Iterable[Finding]]
    gpus: bool = False
    said: bool = False


class Facts:
    """What was read from one rig, by fact name; `unread` names what could not be, and why.

    A per-item fact is named "kind:item" (one venv: "venvs:demo") and kept under its kind
    (`facts.venvs["demo"]`). A fact that was not read is None.
    """

    def __init__(self, unread: dict[str, str] | None = None, **values: Any) -> None:
        self.values: dict[str, Any] = {}
        self.unread: dict[str, str] = dict(unread or {})
        self.labels: dict[str, str] = {}
        for name, value in values.items():
            self.store(name, value)

    def store(self, name: str, value: Any) -> None:
        kind, _, item = name.partition(":")
        if item:
            self.values.setdefault(kind, {})[item] = value
        else:
            self.values[name] = value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self.values.get(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in ("values", "unread", "labels"):
            raise AttributeError(f"store facts with store({name!r}, ...)")
        super().__setattr__(name, value)

    def replace(self, unread: dict[str, str] | None = None, **changes: Any) -> Facts:
        """A copy with some facts (or what was unread) replaced."""
        copy = Facts(self.unread if unread is None else unread)
        copy.values = {**self.values, **changes}
        copy.labels = dict(self.labels)
        return copy

    def missing(self, *names: str) -> list[Finding]:
        """A finding for each of these facts that could not be read (empty: all were)."""
        return [
            error("facts", f"could not read {self.labels.get(name, name)}: {self.unread[name]}")
            for name in names if name in self.unread
        ]


# --- which checks, which facts ---------------------------------------------------------------


def unique(checks: Iterable[Check]) -> tuple[Check, ...]:
    """Each check once, in the order first given (roles share the GPU check)."""
    seen: list[Check] = []
    for check in checks:
        if check not in seen:
            seen.append(check)
    return tuple(seen)


def reads_of(rig: Rig, rig_name: str, checks: Iterable[Check]) -> list[Read]:
    """The facts these checks need, each once, in the order first named."""
    plan: dict[str, Read] = {}
    for check in checks:
        for read in check.reads(rig, rig_name):
            known = plan.setdefault(read.name, read)
            if (known.fact, known.kwargs) != (read.fact, read.kwargs):
                raise ValueError(f"fact {read.name} is read two ways: {known} and {read}")
    return list(plan.values())


def run_checks(rig: Rig, rig_name: str, checks: Iterable[Check], facts: Facts) -> list[Finding]:
    """Every finding of these checks, each once, in check order."""
    checks = tuple(checks)
    facts.labels = {read.name: read.label for read in reads_of(rig, rig_name, checks)}
    found: list[Finding] = []
    for check in checks:
        for finding in check.run(rig, facts, rig_name):
            if finding not in found:
                found.append(finding)
    return found


# --- reading facts in one round trip ---------------------------------------------------------

_SECTION = "##RIGBOOK_FACT##"
_STATUS = "##RIGBOOK_FACT_RC##"
_ERR = "##RIGBOOK_FACT_ERR## "
_MISSING = "##RIGBOOK_FACT_NO_COMMAND##"


def _section(read: Read) -> list:
    """One fact's command, marked: its stdout, its stderr lines prefixed, its exit status."""
    fact = read.fact()
    kwargs = dict(read.kwargs)
    command = fact.command(**kwargs)
    needs = fact.requires_command(**kwargs)
    if needs:
        command = StringCommand(
            "if command -v", needs, ">/dev/null 2>&1; then\n", command,
            f"\nelse echo '{_MISSING}'; fi",
        )
    return [
        f"\necho '{_SECTION} {read.name}'\n{{ {{\n", command,
        f"\necho \"{_STATUS} $?\"; }} 2>&1 1>&3 | sed 's/^/{_ERR}/'; }} 3>&1",
    ]


def batch_command(reads: Iterable[Read]) -> StringCommand:
    """One shell command that runs every fact's command (tests show it; read_facts runs it)."""
    parts: list = []
    for read in reads:
        parts += _section(read)
    return StringCommand(*parts, "\ntrue", separator="")


def split_output(lines: Iterable[str]) -> dict[str, tuple[list[str], list[str], int | None]]:
    """Fact name -> (stdout lines, stderr lines, exit status) of batch_command's output."""
    sections: dict[str, tuple[list[str], list[str], int | None]] = {}
    name = None
    for line in lines:
        if line.startswith(_SECTION):
            name = line[len(_SECTION):].strip()
            sections[name] = ([], [], None)
        elif name is None:
            continue
        elif line.startswith(_STATUS):
            out, err, _ = sections[name]
            sections[name] = (out, err, int(line[len(_STATUS):].strip() or 1))
        elif line.startswith(_ERR):
            sections[name][1].append(line[len(_ERR):])
        else:
            sections[name][0].append(line)
    return sections


def process_output(reads: Iterable[Read], lines: Iterable[str]) -> Facts:
    """Each fact's value from batch_command's output, as pyinfra's get_fact would make it:
    no output is the fact's default, a failing command or a parse error is unread."""
    sections = split_output(lines)
    facts = Facts()
    for read in reads:
        facts.labels[read.name] = read.label
        fact = read.fact()
        fact.command(**dict(read.kwargs))  # as pyinfra does: some facts keep state from it
        out, err, status = sections.get(read.name, ([], ["no output"], None))
        if status != 0:
            detail = "; ".join(line.strip() for line in err[-3:] if line.strip())
            facts.unread[read.name] = detail or f"exit {status if status is not None else '?'}"
        elif out == [_MISSING] or not out:
            facts.store(read.name, fact.default())
        else:
            try:
                facts.store(read.name, fact.process(out))
            except (FactProcessError, ValueError, KeyError, IndexError) as e:
                facts.unread[read.name] = f"{type(e).__name__}: {e}"
    return facts


class FactBatch(FactBase[list]):
    """The raw output of `batch_command(reads)`: one round trip for many facts."""

    default = list

    def command(self, reads: tuple[Read, ...]) -> StringCommand:
        return batch_command(reads)

    def process(self, output: list[str]) -> list[str]:
        return output


def read_facts(state, host, reads: Iterable[Read], timeout: int = 300) -> Facts:
    """Every fact of `reads` from one host, in one shell command (pyinfra's sudo and connector
    settings apply), tried twice when nothing comes back (a dropped SSH channel on a loaded
    rig). A rig that cannot be read has every fact unread; its host is not failed."""
    reads = tuple(reads)
    if not reads:
        return Facts()
    for _ in range(2):  # the batch always prints its sections: nothing back is the connection
        lines = get_fact(state, host, FactBatch, kwargs={"reads": reads, "_timeout": timeout},
                         apply_failed_hosts=False)
        if lines:
            break
    facts = process_output(reads, lines)
    for read in reads:  # an operation reading the same fact in this run gets it from here
        kind, _, item = read.name.partition(":")
        if read.name not in facts.unread:
            value = facts.values[kind][item] if item else facts.values[read.name]
            seed(state, host, read.fact, dict(read.kwargs), value)
    return facts
