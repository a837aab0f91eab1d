"""scripts/setup.sh, the first step of both README commands, works offline once the venv is
current: run again in a network namespace with no interface up, it fetches nothing and succeeds."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.conftest import ROOT


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_setup_with_a_current_venv_needs_no_network():
    done = subprocess.run(["unshare", "--net", "bash", "scripts/setup.sh"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "nothing fetched" in done.stdout
