"""The pure parts of bench/transfer.py and bench/breakdown.py, without sandbox rigs: rates,
the pull's timing from pyinfra's output, roles from the modules that planned the work, the
per-role sums and the markdown tables."""

from __future__ import annotations

from bench.breakdown import PREFLIGHT, PYINFRA, ROLES, per_role, role_of, slowest
from bench.breakdown import markdown as breakdown_markdown
from bench.transfer import MIB, pull_timing, rate, ratio
from bench.transfer import markdown as transfer_markdown


def test_rate_is_mib_per_second_and_zero_seconds_is_no_rate():
    assert rate(320 * MIB, 2.0) == 160.0
    assert rate(3 * MIB, 0.0) == 0.0
    assert ratio(90.0, 100.0) == 0.9
    assert ratio(1.0, 0.0) == 0.0


def test_pull_timing_from_the_lines_that_start_and_end_the_pull():
    label = "rigbook-bench/pull@0123456789ab"
    lines = [
        (1.0, "[rig1] Starting operation: Models in the Hugging Face cache | Pull ..."),
        (1.25, f"[rig1] pulling {label} (no snapshot of commit 0123456789ab yet) ..."),
        (2.0, f"[rig1] {label}: 120.00 MiB of 320.00 MiB (37%) at 80.00 MiB/s"),
        (4.75, f"[rig1] {label}: pulled 4 file(s), 320.00 MiB in 3.2 s (100.00 MiB/s); "
               "complete: 4 file(s), 320.00 MiB"),
    ]
    assert pull_timing(lines, label) == (3.5, 3.2)


def test_roles_come_from_the_outermost_rigbook_module():
    assert role_of("rigbook.roles.driver") == "driver"
    assert role_of("rigbook.roles.venvs") == "venvs"
    # What the deploy script calls outside the roles is the preflight (validation, checks).
    assert role_of("rigbook.preflight") == PREFLIGHT
    assert role_of("rigbook.core.spec") == PREFLIGHT
    assert role_of(None) == PYINFRA  # no rigbook module asked for it
    assert set(ROLES) >= {"driver", "tuning", "wsl", "guards", "power", "venvs", "models",
                          "serving"}


def test_per_role_sums_commands_operations_and_seconds():
    events = [
        {"kind": "plan", "seconds": 2.0},
        {"kind": "command", "module": "rigbook.preflight", "phase": "plan", "seconds": 0.25},
        {"kind": "deploy", "module": "rigbook.roles.driver", "seconds": 0.5},
        {"kind": "command", "module": "rigbook.roles.driver", "phase": "plan", "seconds": 0.1},
        {"kind": "op_added", "module": "rigbook.roles.driver", "op": "a"},
        {"kind": "op_added", "module": "rigbook.roles.driver", "op": "b"},
        {"kind": "deploy", "module": "rigbook.roles.models", "seconds": 0.75},
        {"kind": "op_added", "module": "rigbook.roles.models", "op": "c"},
        {"kind": "op", "module": "rigbook.roles.driver", "op": "a", "seconds": 0.125},
        {"kind": "command", "module": "rigbook.roles.driver", "phase": "exec", "seconds": 0.1},
        {"kind": "op", "module": "rigbook.roles.models", "op": "c", "seconds": 0.375},
    ]
    rows = {row["role"]: row for row in per_role(events, wall=3.0)}
    assert [row["role"] for row in per_role(events, 3.0)] == [PREFLIGHT, *ROLES, PYINFRA]
    driver = rows["driver"]
    assert (driver["operations"], driver["commands_plan"], driver["commands_exec"]) == (2, 1, 1)
    assert (driver["seconds_plan"], driver["seconds_exec"], driver["seconds"]) == (
        0.5, 0.125, 0.625)
    assert driver["seconds_waiting"] == 0.2
    assert rows["models"]["seconds"] == 1.125
    # Planning outside the roles' @deploy calls is the preflight's: 2.0 - 0.5 - 0.75.
    assert rows[PREFLIGHT]["seconds_plan"] == 0.75 and rows[PREFLIGHT]["commands"] == 1
    # The rest of the wall time (start-up, connection, output) is pyinfra's: 3 - 2 - 0.5.
    assert rows[PYINFRA]["seconds"] == 0.5
    assert sum(row["seconds"] for row in rows.values()) == 3.0
    assert rows["serving"]["commands"] == 0 and rows["serving"]["seconds"] == 0


def test_breakdown_table_has_a_row_per_role_and_the_totals():
    events = [{"kind": "plan", "seconds": 1.0},
              {"kind": "command", "module": "rigbook.roles.power", "phase": "plan", "seconds": 0.5}]
    result = {"deploy": "deploys/rig.py", "rig": "rig1", "seconds": 1.5, "runs": [1.4, 1.5, 1.6],
              "median_of": 3, "changes": 0, "roles": per_role(events, 1.5),
              "slowest_operations": [{"operation": "Power limits | Power unit", "role": "power",
                                      "seconds": 0.25, "commands": 2}]}
    text = breakdown_markdown(result)
    roles_table, slow_table = text.split("Slowest operations at execution:")
    assert "| role | operations | remote commands (plan + exec) |" in text
    assert "| power | 0 | 1 (1 + 0) | 0.00 (0.00 + 0.00) | 0.50 |" in text
    assert "| preflight | 0 | 0 (0 + 0) | 1.00 (1.00 + 0.00) | 0.00 |" in text
    assert "| pyinfra | 0 | 0 (0 + 0) | 0.50 (0.50 + 0.00) | 0.00 |" in text
    assert roles_table.rstrip().endswith("| total | 0 | 1 | 1.50 | 0.50 |")
    assert len([line for line in roles_table.splitlines() if line.startswith("| ")]) == \
        2 + len(ROLES) + 2 + 1  # header and rule, roles, preflight and pyinfra, total
    # pyinfra's "deploy | operation" names keep their bar out of the table's cells.
    assert "| Power limits &#124; Power unit | power | 0.25 | 2 |" in slow_table


def test_slowest_operations_with_their_commands_at_execution():
    events = [
        {"kind": "op", "op": "a", "module": "rigbook.roles.driver",
         "names": ["NVIDIA driver | Hold"], "seconds": 0.1},
        {"kind": "op", "op": "b", "module": "rigbook.roles.power", "names": ["Power limits | Unit"],
         "seconds": 0.3},
        {"kind": "command", "op": "b", "phase": "exec", "seconds": 0.1},
        {"kind": "command", "op": "b", "phase": "exec", "seconds": 0.1},
        {"kind": "command", "op": "b", "phase": "plan", "seconds": 0.1},
    ]
    assert slowest(events, 1) == [{"operation": "Power limits | Unit", "role": "power",
                                   "seconds": 0.3, "commands": 2}]
    assert [op["role"] for op in slowest(events)] == ["power", "driver"]


def test_transfer_tables():
    row = {"rigbook_cli_seconds": 6.0, "rigbook_build_seconds": 3.1, "bare_uv_seconds": 1.2,
           "bare_uv_ssh_seconds": 1.5, "cli_vs_bare": 4.0, "build_vs_bare": 2.58,
           "runs": {"rigbook_cli": [6.0], "bare_uv_ssh": [1.5]}}
    result = {
        "pull": {"bytes": 320 * MIB + 1024, "weights_bytes": 320 * MIB, "files": 4,
                 "first_pull_cli_seconds": 9.0, "rigbook_cli_seconds": 6.4,
                 "rigbook_pull_seconds": 3.2, "rigbook_download_seconds": 2.5,
                 "curl_seconds": 0.8, "runs": {"rigbook_pull": [3.2], "curl": [0.8]},
                 "rigbook_pull_mib_s": 100.0, "rigbook_download_mib_s": 128.0,
                 "curl_mib_s": 400.0, "pull_vs_curl": 0.25, "download_vs_curl": 0.32},
        "venv": {"packages": 24, "lock_of": "llama-cpp-python[server]==0.3.36",
                 "warm": row, "cold": row},
    }
    text = transfer_markdown(result)
    assert "4 files, 320.0 MiB (curl copies the 320.0 MiB weights file); medians of 1 runs" \
        in text
    assert "| curl -o file | 0.8 | 400.0 | 1.0 |" in text
    assert "| rigbook pull step (list, download, sha256, manifest) | 3.2 | 100.0 | 0.25 |" in text
    assert "| rigbook CLI, whole deploys/models.py | 6.4 | 50.0 | |" in text
    assert "| warm | 6.0 s | 3.1 s | 1.5 s | 1.2 s | 4.0 | 2.58 |" in text
    assert "| cold | 6.0 s |" in text
