"""`rigbook report INVENTORY RIG`: one markdown file to paste when a rig is wrong, redacted.

What people ask for first when someone reports a broken rig is the same every time: the rig's
facts, its driver and holds, its caps and limits, its PCIe links, the serving unit's journal,
its Xids, the recipe it serves and how its last verify went. This reads them in status's one
round trip (rigbook/status.py; nothing on the rig changes) plus the serving journal, and writes
them as markdown with the rig's names, addresses, users, home folders and every token replaced
by placeholders: the whole text is redacted at the end, so no section can forget to.

The exit status is status's: 0 as declared (advisory findings only), 1 drift, 2 unreachable or a
GPU gone, 4 a driver mismatch; the report splits its findings the same way.
"""

from __future__ import annotations

import getpass
import json
import re
import socket
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pyinfra.api import FactBase
from rich.console import Console

from rigbook.core.checks import Facts, Read
from rigbook.core.errors import RigbookError
from rigbook.core.secrets import read_secret_file
from rigbook.core.types import JsonValue
from rigbook.inventory import load_inventory
from rigbook.roles.serving import JOURNAL_LINES, SERVE_LOG, UNIT_NAME, plan_of
from rigbook.roles.verify import results_dir
from rigbook.status import RigStatus, gather, gpus_of


@dataclass(frozen=True)
class ServingLog(JsonValue):
    """The serving engine's last lines, and the rig's own host name (for the redactor)."""

    lines: tuple[str, ...] = ()
    hostname: str | None = None


class ServingJournal(FactBase[ServingLog]):
    """The serving engine's last lines: its unit's journal, or the supervisor's log on a host
    without systemd (none when there is neither: nothing has served), then ``hostname``."""

    def command(self) -> str:
        return (f"if [ -d /run/systemd/system ]; then journalctl -u {UNIT_NAME} -n "
                f"{JOURNAL_LINES} --no-pager -o short-iso -q; else tail -n {JOURNAL_LINES} "
                f"{SERVE_LOG}; fi 2>/dev/null; hostname")

    def process(self, output: list[str]) -> ServingLog:
        return ServingLog(tuple(output[:-1]), output[-1].strip()) if output else ServingLog()

    @staticmethod
    def default() -> ServingLog:
        return ServingLog()


#: Read with status's facts, in the same round trip.
JOURNAL_READ = Read("serving_journal", ServingJournal, "the serving journal")

#: Tokens and credentials whatever their source: HF, OpenAI-style and bearer tokens, keys and
#: passwords given as key=value, credentials in a URL.
_TOKENS = re.compile(
    r"hf_[A-Za-z0-9]{8,}|sk-[A-Za-z0-9_-]{8,}|(?i:bearer)\s+[A-Za-z0-9._~+/=-]{8,}"
    r"|(?i:(?:api[_-]?key|token|secret|password)[\"']?\s*[=:]\s*[\"']?)[^\s\"',;]{4,}"
    r"|(?<=://)[^/\s:@]+:[^/\s@]+(?=@)"
)
#: A person's home folder on Linux, macOS, or Windows seen from WSL2.
_HOMES = re.compile(r"(/home/|/Users/|/mnt/[a-z]/Users/|[A-Z]:\\Users\\)([^/\\\s\"']+)")


class Redactor:
    """Replaces what would identify a rig or a person, and every token, by a placeholder."""

    def __init__(self, names: dict[str, str], secrets: tuple[str, ...] = ()):
        # the longest first: a rig named "box" must not break up "box-a.lan"
        self.names = sorted(((v, p) for v, p in names.items() if len(v) >= 3 and v != "root"),
                            key=lambda item: -len(item[0]))
        self.secrets = tuple(s for s in secrets if s)

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "<secret>")
        text = _TOKENS.sub(self._token, text)
        text = _HOMES.sub(lambda m: f"{m.group(1)}<user>", text)
        home = str(Path.home())
        if home not in ("/", "/root"):
            text = text.replace(home, "~")
        for value, placeholder in self.names:
            text = re.sub(rf"(?<![\w.-]){re.escape(value)}(?![\w-])", placeholder, text)
        return text

    @staticmethod
    def _token(match: re.Match) -> str:
        found = match.group(0)
        key = re.match(r"(?i)(api[_-]?key|token|secret|password)[\"']?\s*[=:]\s*[\"']?", found)
        return f"{key.group(0)}<secret>" if key else "<secret>"


def _secrets_of(rig) -> tuple[str, ...]:
    """The tokens this rig's host data names, read from their files (a file that cannot be
    read holds nothing this report could print)."""
    found = []
    for field in ("models_token_file", "models_mirror_token_file", "serving_api_key_file"):
        path = getattr(rig, field, None)
        if path:
            try:
                found.append(read_secret_file(field, path, "token"))
            except RigbookError:  # an unreadable file: nothing of it can reach the report
                continue
    return tuple(found)


def _last_verify(name: str) -> tuple[Path, dict] | None:
    runs = sorted((results_dir() / name).glob("**/*.json"), key=lambda p: p.stem)
    return (runs[-1], json.loads(runs[-1].read_text())) if runs else None


def _block(value, language: str = "json") -> str:
    text = value if isinstance(value, str) else json.dumps(value, indent=2, default=str)
    return f"```{language}\n{text.rstrip()}\n```"


_MEANING = {0: "as declared: advisory findings only", 1: "drift from the host data",
            2: "unreachable, or a GPU gone", 4: "driver user space and kernel module disagree"}


def report_markdown(name: str, rig, status: RigStatus, facts: Facts | None, version: str) -> str:
    """The report's markdown, before redaction (`report` redacts it whole)."""
    hard = [f for f in status.findings if f.level != "warn"]
    advisory = [f for f in status.findings if f.level == "warn"]
    log = (facts.serving_journal if facts else None) or ServingLog()
    plan, why = plan_of(rig, name)
    pcie = [{"gpu": g.index, "bus_id": g.bus_id, "gen": g.pcie_gen, "gen_max": g.pcie_gen_max,
             "width": g.pcie_width, "width_max": g.pcie_width_max}
            for g in (gpus_of(facts) if facts else ())]
    last = _last_verify(name)
    facts_json = status.model_dump(mode="json", exclude={"findings"})
    lines = [
        f"# rigbook report: {name}",
        "",
        f"Made by rigbook {version} on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC. Names, "
        "addresses, users, home folders and tokens are replaced by <placeholders>.",
        "",
        f"**State: {status.state}** (exit {status.exit_code}: {_MEANING[status.exit_code]})",
        "",
        "## Hard findings (drift, a GPU gone, a driver mismatch)",
        "",
        *([f"- {f.level} · {f.area}: {f.reason}" for f in hard] or ["none"]),
        "",
        "## Advisory findings (warnings)",
        "",
        *([f"- {f.area}: {f.reason}" for f in advisory] or ["none"]),
        "",
        "## PCIe links",
        "",
        _block(pcie),
        "",
        "## Serving journal (last lines)",
        "",
        _block("\n".join(log.lines) or "(no journal: nothing has served here)", "text"),
        "",
        "## Recipe",
        "",
        _block({"recipe": rig.recipe, "argv": list(plan.argv)} if plan else
               {"recipe": rig.recipe, "not rendered": why.reason if why else "no recipe"}),
        "",
        "## Last verify run",
        "",
        _block(last[1] if last else "none on this machine", "json" if last else "text"),
        "",
        "## Facts (rigbook status --json: driver and holds, caps and limits, Xids, venvs, "
        "models, serving)",
        "",
        _block(facts_json),
        "",
    ]
    return "\n".join(lines)


def report(inventory_file: str, name: str, version: str) -> tuple[str, int]:
    """(the redacted markdown, status's exit code) for one rig of an inventory."""
    _, hosts, rigs = load_inventory(inventory_file, limit=[name])
    if [host.name for host in hosts] != [name]:
        raise RigbookError(f"{name}: a report is of one rig; {name} names "
                           f"{len(hosts)} in {inventory_file}")
    facts_of: dict[str, Facts] = {}
    fleet = gather(inventory_file, [name], Console(stderr=True), (JOURNAL_READ,), facts_of)
    (status,) = fleet.rigs
    rig, facts = rigs[name], facts_of.get(name)
    host = hosts[0]
    log = (facts.serving_journal if facts else None) or ServingLog()
    names = {name: "<rig>", socket.gethostname(): "<operator-host>", getpass.getuser(): "<user>"}
    for key, placeholder in (("ssh_hostname", "<rig-address>"), ("ssh_user", "<user>")):
        if host.data.get(key):
            names[str(host.data.get(key))] = placeholder
    if log.hostname:
        names.setdefault(log.hostname, "<rig-hostname>")  # often the rig's name
    redact = Redactor(names, _secrets_of(rig))
    return redact(report_markdown(name, rig, status, facts, version)), status.exit_code
