"""`rigbook report`: what a rig's report may never show (its names, addresses, users, home
folders, tokens), planted where a real report would carry them, and a report of a sandbox rig
read for real."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from rigbook.core.spec import parse_rig
from rigbook.report import Redactor, report_markdown
from rigbook.status import unreachable_status
from tests.conftest import ROOT, SANDBOX_INVENTORY, rig_ssh

NAMES = {"box": "<rig>", "box.lan": "<rig-address>", "alice": "<user>", "gpu-7": "<rig-hostname>"}

PLANTED = {
    "an HF token": ("pull failed for hf_AbCdEf1234567890xyz", "hf_AbCdEf1234567890xyz"),
    "a key=value key": ("VLLM_API_KEY=s3cr3t-v4lue started", "s3cr3t-v4lue"),
    "a bearer token": ("Authorization: Bearer eyJhbGciOi.J9x", "eyJhbGciOi.J9x"),
    "an OpenAI-style key": ("--api-key sk-proj-abcdefgh12345", "sk-proj-abcdefgh12345"),
    "credentials in a URL": ("https://bob:hunter22@mirror.lan/x", "bob:hunter22"),
    "a JSON token": ('{"token": "abcd-efgh-ijkl"}', "abcd-efgh-ijkl"),
    "a home folder": ("/home/carol/.cache/huggingface", "carol"),
    "a macOS home": ("/Users/dave/rigbook", "dave"),
    "a Windows home under WSL2": ("/mnt/c/Users/Erin/AppData", "Erin"),
    "the rig's name": ("[box] converged", "[box]"),
    "the rig's address": ("ssh root@box.lan", "box.lan"),
    "the rig's host name": ("gpu-7 kernel: NVRM: Xid", "gpu-7"),
    "the user": ("sudo -u alice", "alice"),
    "a secret the host data names": ("key is Zq9-known-token", "Zq9-known-token"),
}


@pytest.mark.parametrize(("text", "hidden"), PLANTED.values(), ids=PLANTED)
def test_nothing_that_identifies_or_opens_a_rig_survives_the_redactor(text, hidden):
    redacted = Redactor(NAMES, ("Zq9-known-token",))(text)
    assert hidden not in redacted and "<" in redacted, redacted


def test_the_redactor_leaves_words_that_merely_contain_a_name():
    redacted = Redactor(NAMES)("boxes of box-a.lan, mailbox and root@box")
    assert redacted == "boxes of box-a.lan, mailbox and root@<rig>"


def test_an_unreachable_rigs_report_says_so_and_exits_2():
    rig = parse_rig("box", {"platform": "debian", "gpu_class": "rtx3090", "gpu_count": 2})
    status = unreachable_status("box", rig, "Connection refused")
    text = report_markdown("box", rig, status, None, "0.1.0")
    assert status.exit_code == 2
    assert "**State: unreachable** (exit 2: unreachable, or a GPU gone)" in text
    assert "Connection refused" in text and "(no journal: nothing has served here)" in text


@pytest.mark.sandbox
def test_a_sandbox_rigs_report_reads_its_journal_and_shows_none_of_what_was_planted(sandbox):
    rig = sandbox["rig2"]
    host = rig_ssh(rig, "hostname").stdout.strip()
    planted = (f"MESSAGE=engine on {host} read /home/carol/.cache with token=plantedSecret99 "
               "for hf_PlantedToken12345678")
    rig_ssh(rig, "printf '%s\\nOBJECT_SYSTEMD_UNIT=rigbook-serve.service\\n' "
                 f"'{planted}' | logger --journald")
    done = subprocess.run([sys.executable, "-m", "rigbook.cli", "report", SANDBOX_INVENTORY,
                           "rig2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stderr[-3000:]  # a verdict on the rig
    text = done.stdout
    seen_as = "<rig>" if host == "rig2" else "<rig-hostname>"  # a sandbox rig's host name
    assert (f"engine on {seen_as} read /home/<user>/.cache with token=<secret> for <secret>"
            in text), text[-3000:]
    for hidden in (host, "carol", "plantedSecret99", "hf_PlantedToken", rig["address"],
                   socket.gethostname()):
        assert hidden not in text, hidden
    assert "# rigbook report: <rig>" in text and '"gpu_class": "rtx4090"' in text
