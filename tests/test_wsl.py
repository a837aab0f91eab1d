"""rigbook.roles.wsl: WSL2 detection, the TDR registry values through reg.exe, .wslconfig memory.

reg.exe is exercised through the sandbox's stand-in (sandbox/simulated/reg.exe), which prints
the real tool's format (CRLF line ends, four-space columns, hex REG_DWORD) and refuses HKLM
writes without its simulated administrator file, exactly like a non-elevated WSL session.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
from pyinfra.api import FunctionCommand

from rigbook.core.checks import Facts
from rigbook.core.errors import RigbookError
from rigbook.core.spec import Rig
from rigbook.roles import wsl
from rigbook.roles.wsl import (
    GRAPHICS_DRIVERS,
    RegistryValues,
    RegProbe,
    WindowsProfile,
    WindowsProfiles,
    Wsl,
    WslSignals,
    check_platform,
    memory_bytes,
    memory_findings,
    parse_reg_probe,
    parse_reg_value,
    platform_findings,
    reg_add_command,
    serving_environment,
    tdr_file_dir,
    tdr_ps1_file,
    tdr_reg_file,
    tdr_registry,
    tdr_values,
    windows_path,
    wsl_memory,
    wslconfig_memory,
)
from tests.opkit import Calls, execute, file_states, local_fact, run_op, shell

ROOT = Path(__file__).resolve().parent.parent
SIM_REG = ROOT / "sandbox" / "simulated" / "reg.exe"
GIB = 1024**3
FULL_KEY = r"HKEY_LOCAL_MACHINE\System\CurrentControlSet\Control\GraphicsDrivers"
ADD = "/mnt/c/Windows/System32/reg.exe add"


def rig(**data) -> Rig:
    return Rig(**{"platform": "wsl2", "gpu_class": "rtx3090", "gpu_count": 1, **data})


# --- the serving environment ----------------------------------------------------------------


def test_serving_environment_on_wsl2_and_on_nvlink_rigs():
    """The hardware notes: "not strictly WSL2-only"; the NVLink composes hard-code it off."""
    off = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    assert serving_environment(rig()) == off
    assert serving_environment(rig(platform="debian")) == {}
    assert serving_environment(rig(platform="debian", gpu_count=2, nvlink=True)) == off
    assert serving_environment(rig(platform="ubuntu", gpu_count=2)) == {}


def test_profile_script_exports_it(tmp_path):
    from rigbook.core.render import render

    text = render(wsl.FILES / "wsl" / "rigbook-wsl.sh.j2", cfg=rig(),
                  env=serving_environment(rig()))
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False\n" in text
    script = tmp_path / "rigbook-wsl.sh"
    script.write_text(text)
    out = subprocess.run(["sh", "-c", f'. {script}; echo "$PYTORCH_CUDA_ALLOC_CONF"'],
                         capture_output=True, text=True, check=True).stdout
    assert out == "expandable_segments:False\n"


# --- detection ------------------------------------------------------------------------------


def test_this_machine_is_not_wsl():
    signals = local_fact(Wsl)
    assert signals.kernel == os.uname().release
    assert not signals.detected


@pytest.mark.parametrize(
    ("signals", "detected"),
    [
        (WslSignals("5.15.153.1-microsoft-standard-WSL2", True, True), True),
        (WslSignals("6.6.87.2-custom", True, False), True),  # custom kernel, interop still there
        (WslSignals("6.1.0-28-amd64", False, True), True),  # the sandbox's WSL2 profile
        (WslSignals("6.1.0-28-amd64", False, False), False),
    ],
)
def test_detection_signals(signals, detected):
    assert signals.detected is detected


def test_wsl_fact_parses_its_output():
    fact = Wsl()
    assert fact.process(["5.15.153.1-microsoft-standard-WSL2", "interop", "run-wsl"]) == (
        WslSignals("5.15.153.1-microsoft-standard-WSL2", True, True)
    )
    assert fact.process(["6.1.0-28-amd64"]) == WslSignals("6.1.0-28-amd64", False, False)


def test_platform_mismatch_names_both_sides():
    with pytest.raises(RigbookError) as error:
        check_platform("rig3", "wsl2", WslSignals("6.1.0-28-amd64", False, False))
    assert "rig3: platform: declared wsl2 but this host is not WSL2" in str(error.value)
    with pytest.raises(RigbookError) as error:
        check_platform("rig1", "debian", WslSignals("6.1.0-28-amd64", False, True))
    assert "declared debian but this host is WSL2 (/run/WSL)" in str(error.value)
    check_platform("rig1", "debian", WslSignals("6.1.0-28-amd64", False, False))


def test_the_platform_check_refuses_a_mismatch_and_passes_a_match():
    wsl2 = Rig(platform="wsl2", gpu_class="rtx3090", gpu_count=1)
    (bad,) = platform_findings(wsl2, Facts(wsl=WslSignals("6.1", False, False)), "rig3")
    assert (bad.level, bad.key) == ("error", "platform")
    assert bad.message("rig3").startswith("rig3: platform: declared wsl2 but this host is not")
    assert platform_findings(wsl2, Facts(wsl=WslSignals("6.1", False, True)), "rig3") == []


# --- reg.exe output -------------------------------------------------------------------------

QUERY = ["", FULL_KEY + "\r", "    TdrDelay    REG_DWORD    0x3c\r", "\r"]


def test_parse_reg_value_real_format():
    assert parse_reg_value(QUERY, "TdrDelay") == 60
    assert parse_reg_value(["    TdrLevel    REG_DWORD    0x0"], "TdrLevel") == 0
    assert parse_reg_value(["    TdrDelay    REG_DWORD    0xffffffff"], "tdrdelay") == 2**32 - 1
    assert parse_reg_value(["    TdrDelay    REG_SZ    60"], "TdrDelay") == "60"
    with pytest.raises(ValueError):
        parse_reg_value(QUERY, "TdrDdiDelay")


def test_parse_probe_present_missing_and_broken():
    output = [
        "##RIGBOOK_REG## TdrDelay", *QUERY, "##RIGBOOK_RC## 0",
        "##RIGBOOK_REG## TdrDdiDelay",
        "ERROR: The system was unable to find the specified registry key or value.\r",
        "##RIGBOOK_RC## 1",
    ]
    assert parse_reg_probe(output) == RegProbe({"TdrDelay": 60, "TdrDdiDelay": None})
    broken = parse_reg_probe([
        "##RIGBOOK_REG## TdrDelay",
        "sh: 1: /mnt/c/Windows/System32/reg.exe: Exec format error", "##RIGBOOK_RC## 126",
    ])
    assert "exited 126" in broken.error and "Exec format error" in broken.error
    assert "WSL interop off" in parse_reg_probe(["##RIGBOOK_NO_REG##"]).error


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """The stand-in reg.exe on this machine, its registry and admin file under tmp_path."""
    monkeypatch.setattr(wsl, "REG_EXE", str(SIM_REG))
    monkeypatch.setenv("RIGBOOK_SIM_ROOT", str(tmp_path))
    admin = tmp_path / "etc" / "rigbook-sim" / "windows-admin"
    admin.parent.mkdir(parents=True)
    admin.touch()
    return tmp_path


def registry_file(root: Path) -> dict:
    path = root / "var" / "lib" / "rigbook-sim" / "registry.json"
    return json.loads(path.read_text()) if path.exists() else {}


def probe(names=("TdrDelay", "TdrDdiDelay", "TdrLevel")) -> RegProbe:
    return local_fact(RegistryValues, key=GRAPHICS_DRIVERS, names=names)


def run_shell(command) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", command.get_raw_value()], capture_output=True, text=True)


def test_registry_fact_and_add_against_the_stand_in(registry):
    assert probe() == RegProbe({"TdrDelay": None, "TdrDdiDelay": None, "TdrLevel": None})
    done = run_shell(reg_add_command(GRAPHICS_DRIVERS, {"TdrDelay": 60, "TdrLevel": 0}))
    assert done.returncode == 0, done.stderr
    assert probe() == RegProbe({"TdrDelay": 60, "TdrDdiDelay": None, "TdrLevel": 0})
    stored = registry_file(registry)[FULL_KEY.lower()]
    assert stored["tdrdelay"] == {"name": "TdrDelay", "type": "REG_DWORD", "data": 60}


def test_add_without_admin_changes_nothing_and_does_not_fail(registry):
    (registry / "etc" / "rigbook-sim" / "windows-admin").unlink()
    done = run_shell(reg_add_command(GRAPHICS_DRIVERS, {"TdrDelay": 60}))
    assert done.returncode == 0 and done.stderr == ""
    assert registry_file(registry) == {}
    assert probe(("TdrDelay",)) == RegProbe({"TdrDelay": None})


def test_add_fails_with_reg_exe_message_on_other_errors(registry):
    done = run_shell(reg_add_command(r"HKXX\Nowhere", {"TdrDelay": 60}))
    assert done.returncode == 1
    assert "ERROR: Invalid key name." in done.stderr


def test_registry_fact_without_reg_exe(monkeypatch, tmp_path):
    monkeypatch.setattr(wsl, "REG_EXE", str(tmp_path / "reg.exe"))
    assert "WSL interop off" in probe().error


def test_add_command_quotes_the_key():
    text = reg_add_command(GRAPHICS_DRIVERS, {"TdrDelay": 60}).get_raw_value()
    assert (
        f"{ADD} 'HKLM\\System\\CurrentControlSet\\Control\\GraphicsDrivers' "
        "/v TdrDelay /t REG_DWORD /d 60 /f"
    ) in text


# --- the TDR operation -------------------------------------------------------------------------

WANTED = {"TdrDelay": 60, "TdrDdiDelay": 60}


def test_tdr_values_from_host_data():
    assert tdr_values(rig()) == WANTED
    assert tdr_values(rig(wsl_tdr_delay=90, wsl_tdr_disable=True)) == {
        "TdrDelay": 90, "TdrDdiDelay": 60, "TdrLevel": 0,
    }


def test_tdr_no_change_when_the_registry_has_the_values():
    commands, fake = run_op(tdr_registry, {"RegistryValues": RegProbe(dict(WANTED))},
                            values=WANTED)
    assert commands == [] and "already set" in fake.noops[0]


def test_tdr_adds_only_what_differs_and_says_reboot(caplog):
    facts = {"RegistryValues": Calls([RegProbe({"TdrDelay": 60, "TdrDdiDelay": 5}),
                                      RegProbe(dict(WANTED))])}
    commands, fake = run_op(tdr_registry, facts, values=WANTED)
    adds = shell(commands)
    assert len(adds) == 1 and "/v TdrDdiDelay /t REG_DWORD /d 60 /f" in adds[0]
    assert "/v TdrDelay " not in adds[0]
    assert isinstance(commands[1], FunctionCommand) and len(commands) == 2
    with caplog.at_level(logging.WARNING, logger="pyinfra"):
        assert execute(commands[1], fake) is True
    assert "rig1: reboot Windows to apply TdrDdiDelay=60" in caplog.text


def test_tdr_missing_values_are_added(caplog):
    facts = {"RegistryValues": Calls([RegProbe({"TdrDelay": None, "TdrDdiDelay": None}),
                                      RegProbe(dict(WANTED))])}
    commands, fake = run_op(tdr_registry, facts, values=WANTED)
    assert "/v TdrDelay /t REG_DWORD /d 60 /f" in shell(commands)[0]
    assert "/v TdrDdiDelay /t REG_DWORD /d 60 /f" in shell(commands)[0]
    execute(commands[1], fake)
    assert "reboot Windows to apply TdrDelay=60, TdrDdiDelay=60" in caplog.text


def test_tdr_unreadable_registry_fails_the_host():
    commands, fake = run_op(tdr_registry, {"RegistryValues": RegProbe({}, "no reg.exe")},
                            values=WANTED)
    assert len(commands) == 1 and execute(commands[0], fake) is False
    assert "cannot read the Windows registry: no reg.exe" in fake.logged[0]


def test_tdr_without_admin_writes_reg_and_ps1_and_fails(caplog):
    before = RegProbe({"TdrDelay": 2, "TdrDdiDelay": None})
    facts = {
        "RegistryValues": Calls([before, before]),
        "WindowsProfiles": [WindowsProfile("/mnt/c/Users/rig", "[wsl2]\nmemory=32GB\n")],
        # neither file is there yet
        "FileStates": file_states(dirs={"/mnt/c/Users/rig": 0o755}),
    }
    commands, fake = run_op(tdr_registry, facts, values=WANTED, name="rig3")
    uploads = [c for c in commands if type(c).__name__ == "FileUploadCommand"]
    assert [u.dest for u in uploads] == ["/mnt/c/Users/rig/rigbook-tdr.reg",
                                         "/mnt/c/Users/rig/rigbook-tdr.ps1"]
    assert uploads[0].src.getvalue() == tdr_reg_file("rig3", WANTED)
    last = commands[-1]
    assert isinstance(last, FunctionCommand) and execute(last, fake) is False
    message = fake.logged[0]
    for part in ("rig3", "Access is denied", "NOT set", "TdrDelay=60, TdrDdiDelay=60",
                 r"C:\Users\rig\rigbook-tdr.reg", r"C:\Users\rig\rigbook-tdr.ps1",
                 "reboot Windows"):
        assert part in message
    assert "reboot Windows to apply" not in caplog.text  # nothing changed: no reboot line


def test_tdr_without_admin_second_run_writes_nothing_new():
    before = RegProbe({"TdrDelay": 2, "TdrDdiDelay": None})
    reg_text = tdr_reg_file("rig3", WANTED)
    ps1_text = tdr_ps1_file("rig3", WANTED, r"C:\Users\rig\rigbook-tdr.ps1")
    written = {
        "/mnt/c/Users/rig/rigbook-tdr.reg": reg_text, "/mnt/c/Users/rig/rigbook-tdr.ps1": ps1_text,
    }
    facts = {
        "RegistryValues": Calls([before, before]),
        "WindowsProfiles": [WindowsProfile("/mnt/c/Users/rig", "[wsl2]\nmemory=32GB\n")],
        "FileStates": file_states(written, mode=0o777, dirs={"/mnt/c/Users/rig": 0o777}),
    }
    commands, fake = run_op(tdr_registry, facts, values=WANTED, name="rig3")
    assert [type(c).__name__ for c in commands] == ["StringCommand", "FunctionCommand"]
    assert execute(commands[-1], fake) is False


# --- files for Windows ----------------------------------------------------------------------


def test_reg_file_is_a_windows_registry_file():
    text = tdr_reg_file("rig3", {"TdrDelay": 60, "TdrDdiDelay": 60, "TdrLevel": 0})
    assert text.startswith("Windows Registry Editor Version 5.00\r\n\r\n")
    assert "\n" not in text.replace("\r\n", "")  # CRLF only
    lines = text.split("\r\n")
    key = lines.index(f"[{FULL_KEY}]")
    assert lines[key + 1:key + 4] == [
        '"TdrDelay"=dword:0000003c', '"TdrDdiDelay"=dword:0000003c', '"TdrLevel"=dword:00000000',
    ]
    assert text.endswith("\r\n\r\n")  # regedit wants the last line terminated
    assert all(line.startswith(";") for line in lines[2:key] if line)


def test_ps1_sets_each_value():
    text = tdr_ps1_file("rig3", {"TdrDelay": 60, "TdrDdiDelay": 60}, r"C:\Users\rig\x.ps1")
    lines = text.split("\r\n")
    for name in ("TdrDelay", "TdrDdiDelay"):
        assert (
            'Set-ItemProperty -Path "HKLM:\\System\\CurrentControlSet\\Control\\GraphicsDrivers" '
            f"-Name {name} -Type DWord -Value 60 -Force"
        ) in lines
    assert r'powershell -ExecutionPolicy Bypass -File "C:\Users\rig\x.ps1"' in text
    assert all(line.startswith("#") for line in lines[:6])


def test_windows_path():
    assert windows_path("/mnt/c/Users/rig/rigbook-tdr.reg") == r"C:\Users\rig\rigbook-tdr.reg"
    assert windows_path("/root/rigbook-tdr.reg") == "/root/rigbook-tdr.reg"


def test_profiles_fact_reads_users_folders(tmp_path, monkeypatch):
    users = tmp_path / "Users"
    for name in ("rig", "Public", "Default", "other"):
        (users / name).mkdir(parents=True)
    (users / "rig" / ".wslconfig").write_bytes(b"[wsl2]\r\nmemory=32GB\r\n")
    (users / "desktop.ini").write_text("")
    monkeypatch.setattr(wsl, "USERS", str(users))
    profiles = local_fact(WindowsProfiles)
    assert profiles == [
        WindowsProfile(f"{users}/other", None),
        WindowsProfile(f"{users}/rig", "[wsl2]\nmemory=32GB\n\n"),
    ]
    assert tdr_file_dir(profiles) == f"{users}/rig"


def test_tdr_file_dir_choices():
    one = WindowsProfile("/mnt/c/Users/ann", None)
    two = WindowsProfile("/mnt/c/Users/bob", None)
    assert tdr_file_dir([one]) == one.path
    assert tdr_file_dir([one, two]) == "/root"
    assert tdr_file_dir([]) == "/root"


# --- .wslconfig memory ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "memory"),
    [
        ("[wsl2]\nmemory=32GB\n", "32GB"),
        ("\ufeff[wsl2]\r\nprocessors=8\r\nmemory = 48GB\r\n", "48GB"),
        ("[wsl2]\n# memory=8GB\nswap=0\n", None),
        ("[experimental]\nmemory=8GB\n[wsl2]\nswap=0\n", None),
        ("[WSL2]\nMemory=24576MB  # for vLLM\n", "24576MB"),
        ("", None),
    ],
)
def test_wslconfig_memory(text, memory):
    assert wslconfig_memory(text) == memory


@pytest.mark.parametrize(
    ("value", "size"),
    [("32GB", 32 * GIB), ("24576MB", 24 * GIB), ("16g", 16 * GIB), ("1.5GB", int(1.5 * GIB))],
)
def test_memory_bytes(value, size):
    assert memory_bytes(value) == size


def test_memory_bytes_refuses_garbage():
    with pytest.raises(ValueError):
        memory_bytes("lots")


def profile(text):
    return [WindowsProfile("/mnt/c/Users/rig", text)]


def test_memory_enough_is_fine():
    warnings, fine = memory_findings("rig3", profile("[wsl2]\nmemory=32GB\n"), 31 * GIB, 24)
    assert warnings == [] and "memory=32GB >= 24 GiB" in fine[0]


def test_memory_below_minimum_warns_with_numbers():
    warnings, _ = memory_findings("rig3", profile("[wsl2]\nmemory=16GB\n"), 15 * GIB, 24)
    assert r"rig3: C:\Users\rig\.wslconfig: [wsl2] memory=16GB (16.0 GiB) is below " \
           "wsl_min_memory_gib=24" in warnings[0]
    assert "wsl --shutdown" in warnings[-1] and "does not edit" in warnings[-1]


def test_memory_not_set_reports_the_default():
    warnings, _ = memory_findings("rig3", profile("[wsl2]\nswap=0\n"), 15 * GIB + 123, 24)
    assert "memory is not set, so WSL2 gets 50% of Windows memory: 16 GiB here" in warnings[0]
    _, fine = memory_findings("rig3", profile("[wsl2]\n"), int(31.6 * GIB), 24)
    assert "not set" in fine[0]
    warnings, _ = memory_findings("rig3", [], 15 * GIB, 24)
    assert "no .wslconfig" in warnings[0]


def test_memory_operation_only_reports(caplog):
    from rigbook.roles.tuning import ShmState

    facts = {"WindowsProfiles": profile("[wsl2]\nmemory=8GB\n"),
             "Shm": ShmState("tmpfs", "", 0, 0, 8 * GIB)}
    with caplog.at_level(logging.WARNING, logger="pyinfra"):
        commands, _ = run_op(wsl_memory, facts, min_gib=24, name="rig3")
    assert commands == []
    assert "memory=8GB (8.0 GiB) is below wsl_min_memory_gib=24" in caplog.text


def test_wsl2_without_systemd_is_refused_with_the_wsl_conf_lines():
    """Issue 33 (5): WSL2 starts a distribution without systemd unless /etc/wsl.conf says
    `[boot] systemd=true`; rigbook's units need it, so the preflight refuses and says the fix."""
    from rigbook.roles.wsl import RegProbe, wsl2_findings

    rig = Rig(platform="wsl2", gpu_class="rtx3090", gpu_count=1)
    values = {"TdrDelay": 60, "TdrDdiDelay": 60}
    facts = Facts(registry=RegProbe(values), profiles=[], systemd=False)
    (found,) = wsl2_findings(rig, facts, "rig3")
    assert (found.level, found.key) == ("error", "platform")
    assert "add [boot] / systemd=true (two lines) to /etc/wsl.conf" in found.text
    assert "run `wsl --shutdown` on Windows" in found.text
    assert wsl2_findings(rig, Facts(registry=RegProbe(values), profiles=[], systemd=True),
                         "rig3") == []
