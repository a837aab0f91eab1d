"""The peers table of results.md: each tool's first and no-change converge, and the ratios."""

from __future__ import annotations

#: Columns, in order: results.json key, heading. The ratios are to RATIO_BASE.
TOOLS = (
    ("rigbook_full", "rigbook, full deploy"),
    ("rigbook_subset", "rigbook, same subset"),
    ("ansible", "Ansible"),
    ("pyinfra_stock", "stock pyinfra"),
)
RATIO_BASE = "rigbook_subset"


def ratio(peer: float, base: float) -> str:
    """How many times the base's time the peer took ("-" without a base time)."""
    return f"{peer / base:.1f}x" if base else "-"


def _cell(row: dict, tool: str) -> str:
    first = row[tool]["first_converge"]["seconds"]
    no_change = row[tool]["no_change_converge"]["seconds"]
    cell = f"{first} s / {no_change} s"
    if tool in (RATIO_BASE, "rigbook_full"):
        return cell
    base = row[RATIO_BASE]
    return (f"{cell} ({ratio(first, base['first_converge']['seconds'])} / "
            f"{ratio(no_change, base['no_change_converge']['seconds'])})")


def _repeats(rows: list[dict]) -> str:
    """'3 runs (Ansible: 1)': how many no-change runs each median took."""
    runs = {heading: len(rows[0][tool]["no_change_converge"]["runs"]) for tool, heading in TOOLS}
    most = max(set(runs.values()), key=list(runs.values()).count)
    others = ", ".join(f"{heading}: {n}" for heading, n in runs.items() if n != most)
    return f"{most} runs" + (f" ({others})" if others else "")


def markdown(rows: list[dict]) -> str:
    """One line per fleet size: first / no-change converge per tool, each peer's ratio to
    rigbook's same subset in brackets (above 1.0x: rigbook was faster)."""
    lines = [
        "## Peers: the same subset of a rig, other tools (bench/peers/)",
        "",
        "First converge / no-change converge, each tool on its own fresh rigs; in brackets the "
        "peer's time over rigbook's same subset (above 1.0x: rigbook is faster). No-change "
        "times are medians of " + _repeats(rows) + "; every no-change run reported 0 changes.",
        "",
        "| rigs | " + " | ".join(heading for _, heading in TOOLS) + " |",
        "| --- |" + " --- |" * len(TOOLS),
    ]
    for row in rows:
        lines.append(f"| {row['rigs']} | " + " | ".join(_cell(row, t) for t, _ in TOOLS) + " |")
    return "\n".join(lines) + "\n"
