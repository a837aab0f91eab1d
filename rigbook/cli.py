"""The `rigbook` command.

One function per sub-command; each sub-command group registers itself in `build_parser`, so a
new group (`status`, ...) is one more `add_*_commands` call. Exit codes: 0 as declared, 1 drift,
2 a rig unreachable or a GPU gone, 3 a usage or configuration error (rigbook/core/errors.py), 4 a
driver whose user space and loaded kernel module disagree (status).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from rigbook import sandbox
from rigbook.core.errors import EXIT_USAGE, RigbookError
from rigbook.docs import stale_docs, write_docs
from rigbook.schema import host_data_schema, recipe_schema


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error exits EXIT_USAGE: 2 means a rig is unreachable or a GPU gone."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _version() -> str:
    try:
        return version("rigbook")
    except PackageNotFoundError:  # a checkout that was never installed
        return "unknown (not installed)"


def sandbox_up(args: argparse.Namespace) -> None:
    _print_rigs(sandbox.up(args.count, args.profile))


def sandbox_down(args: argparse.Namespace) -> None:
    sandbox.down()


def sandbox_add(args: argparse.Namespace) -> None:
    _print_rigs([sandbox.add(args.profile)])


def sandbox_remove(args: argparse.Namespace) -> None:
    sandbox.remove(args.name)


def sandbox_restart(args: argparse.Namespace) -> None:
    sandbox.restart(args.name)


def sandbox_kill(args: argparse.Namespace) -> None:
    sandbox.kill(args.name)


def sandbox_list(args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps(sandbox.rigs(), indent=2))
    else:
        _print_rigs(sandbox.rigs())


def _print_rigs(entries: list[dict]) -> None:
    for entry in entries:
        print(f"{entry['name']:<8} {entry['address']:<15} {entry['profile']}")


def add_sandbox_commands(commands: argparse._SubParsersAction) -> None:
    group = commands.add_parser(
        "sandbox", help="local sandbox rigs (systemd-nspawn, simulated GPUs)"
    )
    actions = group.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = actions.add_parser("up", help="start fresh sandbox rigs, replacing any running ones")
    up.add_argument("count", nargs="?", type=int, default=2, help="how many rigs (default 2)")
    up.add_argument("--profile", help="every rig of this profile (and its release, e.g. "
                    "noble-3090: Ubuntu 24.04) instead of the rotation")
    up.set_defaults(func=sandbox_up)
    actions.add_parser("down", help="stop all sandbox rigs and remove them").set_defaults(
        func=sandbox_down
    )
    add = actions.add_parser("add", help="start one more rig beside the running ones")
    add.add_argument("profile", help="a profile of sandbox/simulated/profiles.json, e.g. "
                     "nosystemd-4090 (no systemd as PID 1), noble-3090 (Ubuntu 24.04), "
                     "resolute-4090 (Ubuntu 26.04), trixie-4090 (Debian 13)")
    add.set_defaults(func=sandbox_add)
    remove = actions.add_parser("remove", help="stop one rig and remove it")
    remove.add_argument("name", help="rig name, e.g. rig4")
    remove.set_defaults(func=sandbox_remove)
    restart = actions.add_parser(
        "restart", help="reboot one rig (or boot one whose container died), keeping its disk")
    restart.add_argument("name", help="rig name, e.g. rig1")
    restart.set_defaults(func=sandbox_restart)
    killing = actions.add_parser("kill", help="kill one rig's container at once (a power cut)")
    killing.add_argument("name", help="rig name, e.g. rig1")
    killing.set_defaults(func=sandbox_kill)
    listing = actions.add_parser("list", help="print name, address and profile of each rig")
    listing.add_argument("--json", action="store_true", help="print the hosts.json entries")
    listing.set_defaults(func=sandbox_list)


def show_status(args: argparse.Namespace) -> int:
    from rigbook.status_table import status  # imports pyinfra_cli, which gevent-patches the process

    return status(args.inventory or the_inventory(Path.cwd()), args.limit, args.json)


def the_inventory(folder: Path) -> str:
    """The one inventory of a folder: its inventory.py (a `rigbook init` folder), or the only
    file in its inventory/ (a clone has two: then name one)."""
    found = [folder / "inventory.py"] if (folder / "inventory.py").is_file() else sorted(
        (folder / "inventory").glob("*.py"))
    if len(found) != 1:
        names = ", ".join(str(path.relative_to(folder)) for path in found) or "none here"
        raise RigbookError(f"which inventory? name one (found: {names})")
    return str(found[0])


def report_command(args: argparse.Namespace) -> int:
    from rigbook.report import report  # imports pyinfra_cli, as status does

    text, code = report(args.inventory, args.rig, _version())
    if args.output:
        args.output.write_text(text)
        print(f"wrote {args.output} (exit {code}: the rig's state, as rigbook status)")
    else:
        sys.stdout.write(text)
    return code


def add_report_command(commands: argparse._SubParsersAction) -> None:
    report = commands.add_parser("report", help="one rig's facts, journal, recipe and last "
                                 "verify as redacted markdown, to paste when it is wrong")
    report.add_argument("inventory", help="pyinfra inventory file, e.g. inventory/rigs.py")
    report.add_argument("rig", help="the rig's name in the inventory")
    report.add_argument("-o", "--output", type=Path, help="write it here, not to stdout")
    report.set_defaults(func=report_command)


def add_status_command(commands: argparse._SubParsersAction) -> None:
    status = commands.add_parser("status", help="what every rig is doing, and where it drifted")
    status.add_argument("inventory", nargs="?",
                        help="pyinfra inventory file, e.g. inventory/rigs.py; default: this "
                        "folder's only one (inventory.py, or the one file in inventory/)")
    status.add_argument(
        "--limit", action="append", help="host, group or glob (repeatable), as pyinfra's --limit"
    )
    status.add_argument("--json", action="store_true", help="print the facts as JSON")
    status.set_defaults(func=show_status)


def models_resolve(args: argparse.Namespace) -> int:
    from rigbook.hub import endpoint_of, operator_token, parse_target, report, resolve

    repo, ref = parse_target(args.target)
    found = resolve(repo, ref, endpoint_of(args.endpoint), operator_token(args.token_file))
    print(report(found, tuple(args.allow or ())))
    return 0


def add_models_commands(commands: argparse._SubParsersAction) -> None:
    group = commands.add_parser("models", help="model pins, from the hub's API")
    actions = group.add_subparsers(dest="action", required=True, metavar="ACTION")
    resolve = actions.add_parser(
        "resolve", help="the commit to pin for REPO[@REF], the files and sizes it pulls, gated "
        "or not")
    resolve.add_argument("target", metavar="REPO[@REF]", help="e.g. Lorbus/Qwen3.6-27B-int4-"
                         "AutoRound or ORG/NAME@v1.0 (REF: branch, tag or commit; default main)")
    resolve.add_argument("--allow", action="append", metavar="GLOB",
                         help="the pin's allow_patterns (repeatable): list only what they pull")
    resolve.add_argument("--endpoint", help="the hub's address (default: HF_ENDPOINT, else "
                         "huggingface_hub's default)")
    resolve.add_argument("--token-file", type=Path, help="a file holding the HF token (default: "
                         "HF_TOKEN); sent only if the hub refuses without it")
    resolve.set_defaults(func=models_resolve)


def bench_compare(args: argparse.Namespace) -> int:
    from rich.console import Console

    from rigbook.roles.charts import MISSING, available, compare_png
    from rigbook.roles.verify import compare_rows, compare_table, load_runs, results_dir

    runs = load_runs()
    if args.ab:
        return bench_ab(runs, *args.ab, as_json=args.json)
    rows = compare_rows(runs, args.rig)
    if not rows:
        which = f" of rig {args.rig}" if args.rig else ""
        raise RigbookError(f"no verify results{which} in {results_dir()}; run deploys/verify.py")
    if args.json:
        print(json.dumps([row.model_dump(mode="json") for row in rows], indent=2))
    else:
        Console(width=160).print(compare_table(runs, args.rig))
    if args.png and not available():
        raise RigbookError(MISSING)
    if args.png:
        with open(args.png, "wb") as out:
            out.write(compare_png(runs, args.rig))
        print(f"wrote {args.png}")
    return 0


def bench_ab(runs, a: str, b: str, *, as_json: bool) -> int:
    """Two runs, figure by figure, with the noise said; what differs between them."""
    from rich.console import Console

    from rigbook.roles.benchab import ab_json, ab_table, differences, pick

    first, second = pick(runs, a), pick(runs, b)
    if as_json:
        print(json.dumps(ab_json(first, second), indent=2))
        return 0
    Console(width=160).print(ab_table(first, second))
    for line in differences(first, second):
        print(f"differs: {line}")
    return 0


def bench_sweep(args: argparse.Namespace) -> int:
    """Per sweep: the table, the chart, and the suggested cap per workload with the command that
    applies it (printed, never run)."""
    from rich.console import Console

    from rigbook.roles.charts import write_charts
    from rigbook.roles.sweep import report_lines, rows
    from rigbook.roles.sweepresult import load_sweeps, sweep_table
    from rigbook.roles.verify import results_dir

    stored = load_sweeps()
    chosen = rows((run for _, run in stored), args.rig)
    if not chosen:
        which = f" of rig {args.rig}" if args.rig else ""
        raise RigbookError(f"no power sweeps{which} in {results_dir()}; run "
                           "deploys/power_sweep.py")
    paths = {id(run): path for path, run in stored}
    if args.json:
        print(json.dumps([run.model_dump(mode="json") for run in chosen], indent=2))
        return 0
    console = Console(width=200)
    for run in chosen:
        console.print(sweep_table(run))
        if not run.ok:
            print(f"incomplete: {run.error or 'not every cap was measured'}; caps restored: "
                  f"{'yes' if run.restored else 'NO'} ({run.restore_detail})")
        if run.points:
            path = paths[id(run)]
            folder = args.png_dir or path.parent
            folder.mkdir(parents=True, exist_ok=True)
            charts = write_charts(run, folder, path.stem)
            print("charts: " + (", ".join(map(str, charts)) if isinstance(charts, list)
                                else charts))
        for line in report_lines(run):
            print(line)
    return 0
def add_bench_commands(commands: argparse._SubParsersAction) -> None:
    group = commands.add_parser("bench", help="verify and benchmark results (deploys/verify.py)")
    actions = group.add_subparsers(dest="action", required=True, metavar="ACTION")
    compare = actions.add_parser(
        "compare", help="table of the latest run per rig/recipe/driver/cap, or one rig's runs"
    )
    compare.add_argument("--rig", help="every stored run of this rig, oldest first")
    compare.add_argument("--png", help="also write a bar chart of decode tok/s to this file")
    compare.add_argument("--json", action="store_true", help="print the runs as JSON")
    compare.add_argument("--ab", nargs=2, metavar=("A", "B"),
                         help="two runs (a stored JSON file, or a prefix of its name such as "
                         "20261204T1903), figure by figure: means, 95 %% intervals, the change "
                         "and whether it is inside the noise")
    compare.set_defaults(func=bench_compare)
    sweep = actions.add_parser(
        "sweep", help="power sweeps (deploys/power_sweep.py): table, chart, suggested caps"
    )
    sweep.add_argument("--rig", help="every stored sweep of this rig, oldest first")
    sweep.add_argument("--png-dir", type=Path,
                       help="write the charts here (default: beside each sweep's JSON)")
    sweep.add_argument("--json", action="store_true", help="print the sweeps as JSON")
    sweep.set_defaults(func=bench_sweep)


def docs_command(args: argparse.Namespace) -> int:
    if args.check:
        stale = stale_docs(args.dir)
        for problem in stale:
            print(problem)
        return 1 if stale else 0
    print("wrote " + ", ".join(str(path) for path in write_docs(args.dir)))
    return 0


def add_docs_command(commands: argparse._SubParsersAction) -> None:
    docs = commands.add_parser(
        "docs", help="regenerate docs/host-data.md, recipes.md, footprint.md and the role pages' "
        "generated parts from the code"
    )
    docs.add_argument("--check", action="store_true",
                      help="write nothing; exit 1 when one differs from what the code says, or a "
                      "role page lacks its markers")
    docs.add_argument("--dir", type=Path, default=Path("docs"),
                      help="the docs folder (default: docs, in the current directory)")
    docs.set_defaults(func=docs_command)


def init_command(args: argparse.Namespace) -> int:
    from rigbook.scaffold import init_folder

    written = init_folder(args.dir, _version())
    print(f"wrote {len(written)} files in {args.dir}; next: cd {args.dir}, describe your rigs in "
          "inventory.py, then `pyinfra inventory.py rigbook.jobs.converge --dry`")
    return 0


def add_init_command(commands: argparse._SubParsersAction) -> None:
    init = commands.add_parser("init", help="make a working folder for a fleet (inventory, "
                               "config.py, docs); never overwrites")
    init.add_argument("dir", type=Path, help="a new or empty folder")
    init.set_defaults(func=init_command)


def schema_command(args: argparse.Namespace) -> int:
    schema = recipe_schema() if args.kind == "recipe" else host_data_schema(args.partial)
    print(json.dumps(schema, indent=2))
    return 0


def add_schema_command(commands: argparse._SubParsersAction) -> None:
    schema = commands.add_parser(
        "schema", help="print the JSON Schema of host data or of a recipe, for editors"
    )
    schema.add_argument("kind", choices=("host-data", "recipe"))
    schema.add_argument("--partial", action="store_true",
                        help="host-data: no key required (a group-data file carries only some)")
    schema.set_defaults(func=schema_command)


def jobs_epilog() -> str:
    """The jobs are pyinfra runs, not sub-commands: the help says how each is started."""
    from rigbook.jobs import JOBS  # the roles: only for the help's text

    width = max(len(job.__name__) for job in JOBS) + len("rigbook.jobs.")
    lines = [f"  pyinfra INVENTORY {'rigbook.jobs.' + job.__name__:<{width}}  or  {path}"
             for job, path in JOBS.items()]
    return ("jobs, run with pyinfra; in a clone also as its deploy file (docs/deploys.md):\n"
            + "\n".join(lines) + "\n\nexit codes: docs/status.md (Exit status)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="rigbook", description=__doc__.splitlines()[0], epilog=jobs_epilog(),
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"rigbook {_version()}")
    loud = parser.add_mutually_exclusive_group()
    loud.add_argument("-v", "--verbose", action="store_const", dest="log_level",
                      const=logging.DEBUG, default=logging.INFO, help="say more (debug lines)")
    loud.add_argument("-q", "--quiet", action="store_const", dest="log_level",
                      const=logging.WARNING, help="say only warnings and errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_sandbox_commands(commands)
    add_init_command(commands)
    add_docs_command(commands)
    add_schema_command(commands)
    add_status_command(commands)
    add_report_command(commands)
    add_models_commands(commands)
    add_bench_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs one sub-command; a RigbookError is printed plainly and exits EXIT_USAGE."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="rigbook: %(message)s")
    try:
        return args.func(args) or 0  # sub-commands with an exit status of their own return it
    except RigbookError as error:
        print(f"rigbook: error: {error}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
