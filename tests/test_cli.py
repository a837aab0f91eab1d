"""The rigbook command's conventions: --version, exit codes, --json, -v / -q."""

from __future__ import annotations

import logging

import pytest

from rigbook import cli
from rigbook.core.errors import EXIT_USAGE
from tests.conftest import rigbook


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("rigbook ")


@pytest.mark.parametrize("argv", [[], ["nosuch"], ["status", "a.py", "b.py"], ["-v", "-q", "docs"],
                                  ["bench", "compare", "--rig"]])
def test_a_usage_error_exits_3_not_2_which_means_a_gpu_is_gone(argv, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    assert done.value.code == EXIT_USAGE == 3
    assert "usage: rigbook" in capsys.readouterr().err


def test_a_configuration_error_exits_3_and_says_why(tmp_path):
    done = rigbook("status", str(tmp_path / "missing.py"), check=False)  # (gevent: own process)
    assert done.returncode == 3
    assert f"rigbook: error: no inventory file {tmp_path / 'missing.py'}" in done.stderr


def test_status_without_a_path_takes_the_folders_one_inventory_or_asks_which():
    done = rigbook("status", check=False)  # the clone has two: inventory/rigs.py and sandbox.py
    assert done.returncode == 3
    assert ("rigbook: error: which inventory? name one (found: inventory/rigs.py, "
            "inventory/sandbox.py)") in done.stderr
    # a folder with one inventory.py: tests/test_package.py runs `rigbook status` in one


def test_the_docs_check_passes_on_the_checkout_and_writes_nothing(capsys):
    assert cli.main(["docs", "--check"]) == 0
    assert capsys.readouterr().out == ""


def test_bench_compare_without_runs_is_a_usage_error_naming_where_it_looked(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RIGBOOK_VERIFY_DIR", str(tmp_path))
    assert cli.main(["bench", "compare", "--json"]) == 3  # test_verify: --json with runs
    assert str(tmp_path) in capsys.readouterr().err


@pytest.mark.parametrize("flag, level", [("-v", logging.DEBUG), ("-q", logging.WARNING),
                                         (None, logging.INFO)])
def test_verbose_and_quiet_set_the_log_level(flag, level):
    args = cli.build_parser().parse_args([*([flag] if flag else []), "docs", "--check"])
    assert args.log_level == level
