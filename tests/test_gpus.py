"""rigbook.rigside.gpus and the GPU facts, on output captured from a real H200 host
(tests/fixtures).

The error messages below are nvidia-smi's own, verbatim: the facts must carry them to the
operator instead of failing the deploy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from pyinfra.api.exceptions import FactProcessError

from rigbook.core.facts import (
    NVIDIA_SMI_PATHS,
    LoadedNvidiaModule,
    NvidiaDriverVersion,
    NvidiaGpus,
)
from rigbook.rigside import gpus
from rigbook.rigside.gpus import QUERY_FIELDS, Gpu, GpuProbe, parse_query_csv, query_args
from rigbook.roles.health import health_from_probe

ROOT = Path(__file__).resolve().parent.parent
H200 = Path(__file__).parent / "fixtures" / "nvidia-h200"
UUID = "GPU-b76da475-45a0-f91f-b11d-022ca55575ef"

MISMATCH = "Failed to initialize NVML: Driver/library version mismatch"
NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)
NO_DEVICES = "No devices were found"


def fixture(name: str) -> str:
    return (H200 / name).read_text()


def query_lines() -> list[str]:
    """The capture's first query: its header and the H200 row (line 3 is another query)."""
    return fixture("query-gpu.csv").splitlines()[:2]


# --- nvidia-smi --query-gpu ----------------------------------------------------------------


def test_query_csv_h200_row():
    [gpu] = parse_query_csv(fixture("query-gpu.csv"), skip_mismatched=True)
    assert gpu == Gpu(
        index=0, uuid=UUID, name="NVIDIA H200", bus_id="00000000:00:06.0",
        driver_version="580.159.04", power_limit_w=700.0, default_limit_w=700.0,
        min_limit_w=200.0, max_limit_w=700.0, enforced_limit_w=700.0,
        memory_total_mib=143771, memory_used_mib=0, persistence=True,
        pcie_gen=5, pcie_gen_max=5, pcie_width=16, temperature_c=38, compute_cap="9.0",
    )
    # not in that capture's query: left unknown, not guessed
    assert gpu.power_draw_w is None and gpu.pcie_width_max is None


def test_query_csv_foreign_row_is_an_error_by_default():
    with pytest.raises(ValueError, match=r"line 3: expected 19 columns, got 5: '0, GPU-b76"):
        parse_query_csv(fixture("query-gpu.csv"))


def test_query_csv_header_decides_the_order():
    header, row = query_lines()
    names = [cell.split(" [")[0] for cell in header.split(", ")]
    # the same real row without its header needs the field list, given in the header's order
    assert parse_query_csv(row, fields=names) == parse_query_csv("\n".join(query_lines()))
    # in QUERY_FIELDS' order the columns shift and the row does not parse
    with pytest.raises(ValueError, match="line 1"):
        parse_query_csv(row)


def test_query_csv_headerless_nounits_in_query_fields_order():
    # assembled from the H200's `nvidia-smi -q` values, in QUERY_FIELDS order, as the fact
    # would get them with --format=csv,noheader,nounits
    row = (
        f"0, {UUID}, NVIDIA H200, 00000000:00:06.0, 580.159.04, 700.00, 700.00, 200.00, 700.00,"
        " 700.00, 128.95, 143771, 0, Enabled, 5, 5, 16, 16, 38, 9.0"
    )
    [gpu] = parse_query_csv(row + "\n")
    assert (gpu.power_draw_w, gpu.pcie_width_max, gpu.min_limit_w) == (128.95, 16, 200.0)


def test_query_args_asks_for_every_field_in_order():
    assert query_args() == (
        "--query-gpu=" + ",".join(QUERY_FIELDS) + " --format=csv,noheader,nounits"
    )
    assert query_args(header=True).endswith(" --format=csv,nounits")
    assert QUERY_FIELDS[:4] == ("index", "uuid", "name", "pci.bus_id")
    assert QUERY_FIELDS[-1] == "compute_cap" and len(QUERY_FIELDS) == 20


@pytest.mark.parametrize("na", ["[N/A]", "N/A", "[Not Supported]"])
def test_query_csv_unavailable_values_are_none(na):
    header, row = query_lines()
    cells = row.split(", ")
    cells[5] = cells[7] = cells[12] = na  # power.limit, power.min_limit, persistence_mode
    [gpu] = parse_query_csv(f"{header}\n{', '.join(cells)}")
    assert gpu.power_limit_w is None and gpu.min_limit_w is None and gpu.persistence is None
    assert gpu.max_limit_w == 700.0


def test_query_csv_required_value_unavailable_is_an_error():
    header, row = query_lines()
    broken = row.replace(UUID, "[N/A]")
    with pytest.raises(ValueError, match=r"line 2: uuid is \[N/A\]"):
        parse_query_csv(f"{header}\n{broken}")


@pytest.mark.parametrize(
    ("old", "new", "column"),
    [("700.00 W, 700.00 W", "seven hundred W, 700.00 W", "power.limit"),
     ("Enabled", "Maybe", "persistence_mode"),
     ("143771 MiB", "lots MiB", "memory.total")],
)
def test_query_csv_malformed_value_names_column_and_line(old, new, column):
    header, row = query_lines()
    broken = row.replace(old, new, 1)
    with pytest.raises(ValueError, match=f"line 2: bad {column}") as error:
        parse_query_csv(f"{header}\n{broken}")
    assert broken in str(error.value)


def test_query_csv_unknown_column_count():
    header, row = query_lines()
    with pytest.raises(ValueError, match="line 2: expected 19 columns, got 20"):
        parse_query_csv(f"{header}\n{row}, 42")
    assert parse_query_csv(f"{header}\n{row}, 42", skip_mismatched=True) == []


def test_query_csv_without_required_fields_is_an_error():
    with pytest.raises(ValueError, match="lacks required fields: name, pci.bus_id"):
        parse_query_csv("0, GPU-x", fields=("index", "uuid"))


# --- NVML ----------------------------------------------------------------------------------


class _FakeNvmlError(Exception):
    pass


def _fake_pynvml(init_error: str | None = None) -> types.SimpleNamespace:
    """pynvml answering with the H200's values from nvml.txt and nvml-health.json (one GPU);
    only the calls the probe makes (any other is an AttributeError)."""
    h200 = json.JSONDecoder().raw_decode(fixture("nvml.txt"))[0]["gpus"][0]

    def init():
        if init_error:
            raise _FakeNvmlError(init_error)

    def not_supported(*_):
        raise _FakeNvmlError("Not Supported")

    return types.SimpleNamespace(
        NVMLError=_FakeNvmlError, NVML_TEMPERATURE_GPU=0,
        nvmlInit=init, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 1, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUUID=lambda _: h200["uuid"],
        nvmlDeviceGetCurrPcieLinkGeneration=lambda _: h200["pcie_gen"],
        nvmlDeviceGetMaxPcieLinkGeneration=lambda _: h200["pcie_gen_max"],
        nvmlDeviceGetCurrPcieLinkWidth=lambda _: h200["pcie_width"],
        nvmlDeviceGetMaxPcieLinkWidth=not_supported,
        nvmlDeviceGetTemperature=lambda _, sensor: h200["temp"],
        # GPU health, as NVML answered on an H200 (nvml-health.json)
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1, NVML_VOLATILE_ECC=0, NVML_AGGREGATE_ECC=1,
        nvmlDeviceGetMarginTemperature=lambda _: types.SimpleNamespace(marginTemperature=51),
        nvmlDeviceGetTotalEccErrors=lambda _, kind, counter: 0,
        nvmlDeviceGetRetiredPagesPendingStatus=not_supported,
        nvmlDeviceGetRemappedRows=lambda _: (0, 0, 0, 0),
        nvmlDeviceGetCurrentClocksEventReasons=lambda _: 1,
        nvmlDeviceGetUtilizationRates=lambda _: types.SimpleNamespace(gpu=0, memory=0),
        nvmlDeviceGetPowerUsage=lambda _: h200["power_usage_mw"],
        nvmlDeviceGetEnforcedPowerLimit=lambda _: h200["enforced_mw"],
    )


def test_probe_main_prints_the_health_readings(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    assert gpus.main(["--probe"]) == 0
    printed = json.loads(capsys.readouterr().out)
    [gpu] = printed["gpus"]
    [from_smi] = parse_query_csv("\n".join(query_lines()))
    # the probe reads the card nvidia-smi reads; a value NVML does not support is null
    assert (gpu["index"], gpu["uuid"], gpu["temp"]) == (0, UUID, from_smi.temperature_c)
    assert (gpu["pcie_gen"], gpu["pcie_gen_max"], gpu["pcie_width"], gpu["pcie_width_max"]) == (
        from_smi.pcie_gen, from_smi.pcie_gen_max, from_smi.pcie_width, None)
    health = ("tlimit", "ecc_uncorrected", "retired_pending", "remapped", "events", "util")
    real = json.loads(fixture("nvml-health.json"))["gpus"][0]
    assert {key: gpu[key] for key in health} == {key: real[key] for key in health}
    [reading] = health_from_probe(printed)  # what roles/health.py makes of it
    assert (reading.uuid, reading.values["temperature.gpu"]) == (UUID, "38")
    h200 = json.JSONDecoder().raw_decode(fixture("nvml.txt"))[0]["gpus"][0]
    assert (gpu["power_usage_mw"], gpu["enforced_mw"]) == (h200["power_usage_mw"],
                                                           h200["enforced_mw"])
    assert reading.watts("enforced.power.limit") == h200["enforced_mw"] / 1000


def test_probe_without_nvml_prints_error_and_exits_3(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(init_error="Driver Not Loaded"))
    assert gpus.main(["--probe"]) == gpus.PROBE_NO_NVML == 3
    assert json.loads(capsys.readouterr().out) == {
        "error": "NVML did not initialise: Driver Not Loaded"}


def test_probe_command_line_on_this_machine():
    """The real entry point: a probe with a driver, or the error object and 3 without one."""
    proc = subprocess.run([sys.executable, "-m", "rigbook.rigside.gpus", "--probe"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    data = json.loads(proc.stdout)
    if proc.returncode == 0:
        assert len(health_from_probe(data)) == len(data["gpus"])
    else:
        assert proc.returncode == 3 and set(data) == {"error"}, proc.stdout + proc.stderr


# --- facts ---------------------------------------------------------------------------------

SMI = "/usr/local/nvidia/bin/nvidia-smi"


def attempt(path: str, lines: list[str], status: int) -> list[str]:
    """Stdout of one nvidia-smi attempt, as the fact's shell wrapper prints it."""
    return [f"##RIGBOOK_SMI## {path}", *lines, "", f"##RIGBOOK_RC## {status}"]


def test_nvidia_gpus_fact_h200():
    probe = NvidiaGpus().process(attempt(SMI, query_lines(), 0))
    assert probe.ok and probe.smi == SMI and probe.exit_code == 0
    assert [(g.name, g.power_limit_w, g.persistence) for g in probe.gpus] == [
        ("NVIDIA H200", 700.0, True)]
    assert probe.driver_version == "580.159.04"


@pytest.mark.parametrize(("message", "status"), [(MISMATCH, 18), (NO_DRIVER, 9),
                                                 (NO_DEVICES, 6)])
def test_nvidia_gpus_fact_broken_layer_is_reported(message, status):
    probe = NvidiaGpus().process(attempt("/usr/bin/nvidia-smi", [message], status))
    assert probe == GpuProbe(smi="/usr/bin/nvidia-smi", error=message, exit_code=status)
    assert not probe.ok and probe.driver_version is None


def test_nvidia_gpus_fact_no_devices_with_exit_0_is_still_broken():
    probe = NvidiaGpus().process(attempt(SMI, [NO_DEVICES], 0))
    assert not probe.ok and probe.error.startswith(NO_DEVICES) and probe.gpus == ()


def test_nvidia_gpus_fact_later_path_answers_when_path_one_fails():
    # WSL2: a distro nvidia-smi on PATH fails, the Windows driver's copy answers
    output = attempt("/usr/bin/nvidia-smi", [NO_DRIVER], 9) + attempt(
        "/usr/lib/wsl/lib/nvidia-smi", query_lines(), 0)
    probe = NvidiaGpus().process(output)
    assert probe.ok and probe.smi == "/usr/lib/wsl/lib/nvidia-smi" and len(probe.gpus) == 1


def test_nvidia_gpus_fact_first_failure_is_reported():
    output = attempt("/usr/bin/nvidia-smi", [MISMATCH], 18) + attempt(
        "/usr/lib/wsl/lib/nvidia-smi", [NO_DRIVER], 9)
    assert NvidiaGpus().process(output).error == MISMATCH


def test_nvidia_gpus_fact_without_nvidia_smi_is_none():
    assert NvidiaGpus().process(["##RIGBOOK_NO_SMI##"]) is None


def test_nvidia_gpus_fact_unexpected_output_fails_processing():
    with pytest.raises(FactProcessError):
        NvidiaGpus().process(["sh: 1: syntax error"])


def test_nvidia_gpus_fact_json_for_the_pyinfra_cli():
    probe = NvidiaGpus().process(attempt(SMI, [MISMATCH], 18))
    assert json.loads(json.dumps(probe.to_json())) == {
        "smi": SMI, "gpus": [], "error": MISMATCH, "exit_code": 18}


def _run_fact_command(path_dir: Path) -> list[str]:
    """Run NvidiaGpus' shell command for real with PATH limited to path_dir."""
    env = {"PATH": f"{path_dir}:/usr/bin:/bin"}
    proc = subprocess.run(["/bin/sh", "-c", NvidiaGpus().command()], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def _fake_smi(tmp_path: Path, stdout: str, status: int) -> Path:
    (tmp_path / "out.txt").write_text(stdout)
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args.txt\ncat {tmp_path}/out.txt\n'
                   f"exit {status}\n")
    smi.chmod(0o755)
    return smi


@pytest.fixture
def no_system_smi():
    found = [p for p in ("/usr/bin/nvidia-smi", *NVIDIA_SMI_PATHS) if os.path.exists(p)]
    if found:
        pytest.skip(f"this machine has a real nvidia-smi: {found[0]}")


@pytest.mark.usefixtures("no_system_smi")
def test_nvidia_gpus_command_reports_failure_and_exits_0(tmp_path):
    smi = _fake_smi(tmp_path, MISMATCH + "\n", 18)
    probe = NvidiaGpus().process(_run_fact_command(tmp_path))
    assert probe == GpuProbe(smi=str(smi), error=MISMATCH, exit_code=18)
    assert (tmp_path / "args.txt").read_text().strip() == query_args(header=True)


@pytest.mark.usefixtures("no_system_smi")
def test_nvidia_gpus_command_parses_real_output(tmp_path):
    _fake_smi(tmp_path, "\n".join(query_lines()) + "\n", 0)
    probe = NvidiaGpus().process(_run_fact_command(tmp_path))
    assert probe.ok and probe.gpus[0].uuid == UUID


@pytest.mark.usefixtures("no_system_smi")
def test_nvidia_gpus_command_without_nvidia_smi(tmp_path):
    assert NvidiaGpus().process(_run_fact_command(tmp_path)) is None


def test_driver_version_short_fact():
    fact = NvidiaDriverVersion()
    assert fact.process_data(NvidiaGpus().process(attempt(SMI, query_lines(), 0))) == "580.159.04"
    assert fact.process_data(NvidiaGpus().process(attempt(SMI, [MISMATCH], 18))) is None
    assert fact.process_data(None) is None


def test_loaded_module_open_h200():
    proc_version = fixture("host.txt").splitlines()[:2]
    assert proc_version[1].startswith("GCC version:")
    assert LoadedNvidiaModule().process(proc_version) == "580.159.04"


def test_loaded_module_proprietary():
    line = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  515.76  Mon Sep 12 19:21:56 UTC 2022"
    assert LoadedNvidiaModule().process([line]) == "515.76"


def test_loaded_module_unreadable_content_fails_processing():
    with pytest.raises(FactProcessError, match="no NVRM version line"):
        LoadedNvidiaModule().process(["GCC version:  gcc version 15.3.0 (GCC)"])


def test_nvidia_gpus_fact_hung_nvidia_smi_is_reported():
    probe = NvidiaGpus().process(attempt(SMI, [], 124))
    assert not probe.ok and probe.exit_code == 124 and "did not answer within 60 s" in probe.error


def test_full_query_captured_with_rigbook_fields_parses_every_field():
    """The exact query NvidiaGpus sends, as the real H200 host answered it (units in the header)."""
    [gpu] = parse_query_csv(fixture("query-full-nounits.csv"))
    assert (gpu.uuid, gpu.bus_id, gpu.driver_version) == (
        "GPU-26318cf3-2491-8ba9-5e54-60691789063b", "00000000:00:06.0", "580.159.04"
    )
    assert (gpu.min_limit_w, gpu.max_limit_w, gpu.power_limit_w) == (200.0, 700.0, 700.0)
    assert (gpu.pcie_width, gpu.pcie_width_max, gpu.compute_cap) == (16, 16, "9.0")
    assert gpu.persistence is True and gpu.memory_total_mib == 143771


def test_loaded_module_version_from_the_real_proc_file():
    lines = fixture("proc-driver-version.txt").splitlines()
    assert LoadedNvidiaModule().process(lines) == "580.159.04"


def _probe_of(fixture: str) -> GpuProbe:
    """The cards a real published nvidia-smi output shows (tests/fixtures/real, the names its
    hand-written reading gives), as the GPU fact returns them."""
    reading = json.loads((ROOT / "tests/fixtures/real/expected.json").read_text())["files"]
    names = reading[fixture]["names"]
    return GpuProbe(smi="/usr/bin/nvidia-smi", gpus=tuple(
        Gpu(index=i, uuid=f"GPU-{i}", name=name, bus_id=f"00000000:0{i}:00.0")
        for i, name in enumerate(names)))


@pytest.mark.parametrize(("fixture", "known"), [
    ("smi-table/new-610-2x-rtx3090.txt", "rtx3090"),
    ("smi-table/new-610-2x-rtx5090.txt", "rtx5090"),
])
def test_a_known_card_declared_other_is_refused(fixture, known):
    """Issue 33 (1): `gpu_class: other` skipped the card-name, SM86 and VRAM checks of a card
    rigbook knows; the rig's nvidia-smi says what it is, and the preflight refuses."""
    from rigbook.core.checks import Facts
    from rigbook.core.facts import gpu_findings
    from rigbook.core.spec import Rig

    probe = _probe_of(fixture)
    rig = Rig(platform="ubuntu", gpu_class="other", gpu_count=len(probe.gpus),
              gpu_limits_watts=(100, 320), power_profile="stock")
    findings = gpu_findings(rig, Facts(probe=probe), "box")
    assert [f.level for f in findings] == ["error"] * len(probe.gpus)
    assert findings[0].text == (
        f"gpu_class: other declared, card is {probe.gpus[0].name}: rigbook knows it as {known}; "
        f"allowed: gpu_class {known} (other would skip its checks: card, SM86 limits, VRAM)")
    declared = rig.model_copy(update={"gpu_class": known})
    assert gpu_findings(declared, Facts(probe=probe), "box") == []


def test_a_card_rigbook_has_no_class_for_may_be_other():
    from rigbook.core.checks import Facts
    from rigbook.core.facts import gpu_findings
    from rigbook.core.spec import Rig

    probe = _probe_of("smi-csv/noheader-27fields-many-na-rtx3080.txt")
    rig = Rig(platform="ubuntu", gpu_class="other", gpu_count=1, gpu_limits_watts=(100, 320),
              power_profile="stock")
    assert gpu_findings(rig, Facts(probe=probe), "box") == []
