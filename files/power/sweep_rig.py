"""The rig's side of a power sweep (deploys/power_sweep.py): the cap guard and the draw meter.

Copied by rigbook to /run/rigbook-sweep/ beside cap_check.py (whose unit parser it uses) and run
with the rig's python3 (standard library only; the meter uses pynvml when the interpreter has
it, as the tools venv's does):

    python3 sweep_rig.py guard --unit /etc/systemd/system/nvidia-power-limit.service --dir D
    python3 sweep_rig.py meter --dir D --name cap-290 --interval 0.25 --smi /usr/bin/nvidia-smi \
        --engine-unit rigbook-serve.service --hwmon /sys/class/hwmon

guard: started as a unit of its own (systemd-run) when the sweep begins, it waits while the lease
file (D/lease, JSON {"deadline": epoch seconds, "release": bool}) is held, and as soon as the sweep
releases it, or its deadline passes because the operator's process died, it sets every GPU's
live cap back to what the boot unit says (read from the unit at that moment), writes
D/restored.json and exits. The sweep renews the deadline before every request it sends. It fails
closed: a hung, failing or missing nvidia-smi costs only its GPU (each call has --smi-timeout s),
and the record is always written, naming every GPU restored or not (with why):
{"ok", "complete", "caps", "restored": [uuid], "not_restored": {uuid: why}, "errors", "at"}.
D/guard.pid holds its process id while it runs.

meter: samples each GPU's power draw (W), its total-energy counter where the card has one (mJ
since the driver loaded), temperature, utilisation, SM clock and clock-event reasons, beside them
the whole system's power where a PSU reports it (a Corsair HXi/RMi through the kernel's
corsair-psu driver: the hwmon folder named `corsairpsu`, its power1_input the DC output in uW),
and every few seconds the GPU processes outside the serving unit, until D/<name>.stop appears or
the lease lapses: one JSON line a sample in D/<name>.jsonl (a header line first, naming the PSU
folder or null), D/<name>.done at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cap_check import unit_caps  # noqa: E402  (copied beside this file)

#: A `-pl` call that has not answered in this long (s) is given up: its GPU is named not restored.
SMI_TIMEOUT_S = 20


def read_json(path: str) -> dict | None:
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_text(path: str, text: str) -> None:
    """Written whole, then renamed: a reader never sees half a file."""
    with open(path + ".tmp", "w") as handle:
        handle.write(text)
    os.replace(path + ".tmp", path)


def write_json(path: str, data: dict) -> None:
    write_text(path, json.dumps(data))


def lease_over(directory: str, now: float) -> bool:
    """The sweep released its lease, let it lapse, or it cannot be read."""
    lease = read_json(os.path.join(directory, "lease"))
    if lease is None or lease.get("release"):
        return True
    deadline = lease.get("deadline")
    return not isinstance(deadline, (int, float)) or now > deadline


def set_cap(smi: str, uuid: str, watts: float, timeout: float) -> str | None:
    """`nvidia-smi -i UUID -pl W`; None when it took, else why not. A hung call is killed and
    given up after `timeout` (never waited on again: a card stuck in the driver may not die)."""
    try:
        child = subprocess.Popen([smi, "-i", uuid, "-pl", f"{watts:g}"], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as error:
        return f"cannot run {smi}: {error.strerror or error}"
    try:
        said, _ = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        return f"{smi} -pl {watts:g} timed out after {timeout:g} s"
    if child.returncode != 0:
        lines = said.strip().splitlines()
        return (f"{smi} -pl {watts:g} exited {child.returncode}: "
                f"{lines[0] if lines else 'no output'}")
    return None


def restore(unit: str, timeout: float) -> dict:
    """Every cap line of the boot unit run again: the live caps become the unit's. Each GPU is
    named, restored or not (with why); an error of one GPU does not stop the others."""
    record: dict = {"ok": False, "complete": False, "caps": {}, "restored": [],
                    "not_restored": {}, "errors": []}
    try:
        with open(unit) as handle:
            smi, caps = unit_caps(handle.read())
    except OSError as error:
        record["errors"].append(f"cannot read {unit}: {error.strerror}")
        return record
    record["caps"] = caps
    for uuid, watts in caps.items():
        try:
            why = set_cap(smi, uuid, watts, timeout)
        except Exception as error:  # noqa: BLE001  (any failure names this GPU, the rest go on)
            why = f"{type(error).__name__}: {error}"
        if why is None:
            record["restored"].append(uuid)
        else:
            record["not_restored"][uuid] = why
            record["errors"].append(f"{uuid}: {why}")
    record.update(ok=bool(caps) and not record["not_restored"], complete=True)
    return record


def guard(unit: str, directory: str, poll: float, timeout: float) -> int:
    write_text(os.path.join(directory, "guard.pid"), f"{os.getpid()}\n")  # the sweep waits on it
    while not lease_over(directory, time.time()):
        time.sleep(poll)
    # Closed first: the sweep renews no lease and sets no cap past this file (a step it set
    # meanwhile it sets back itself).
    open(os.path.join(directory, "closed"), "w").close()
    result = {"ok": False, "complete": False, "caps": {}, "restored": [], "not_restored": {},
              "errors": ["the guard stopped before it restored anything"]}
    try:
        result = restore(unit, timeout)
    except Exception as error:  # noqa: BLE001  (the record is written whatever went wrong)
        result["errors"].append(f"{type(error).__name__}: {error}")
    finally:
        result["at"] = time.time()
        write_json(os.path.join(directory, "restored.json"), result)
    return 0 if result["ok"] else 1


#: NVML's clock-event reason bits (nvml.h, nvmlClocksEventReasons), as nvidia-smi names them.
REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap",
           0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal_slowdown",
           0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
           0x100: "display_clock_setting"}
#: Other GPU processes are looked for at most this often (s): a full list costs more than a draw.
PROCESS_EVERY_S = 2.0


def reasons(mask) -> list:
    """The names of the active clock-event reasons in NVML's bit mask (an int or "0x..." text)."""
    if isinstance(mask, str):
        try:
            mask = int(mask.strip(), 16)
        except ValueError:
            return []
    return [name for bit, name in REASONS.items() if isinstance(mask, int) and mask & bit]


def number(text):
    try:
        return float(text)
    except (TypeError, ValueError):  # [N/A], [Not Supported]
        return None


def nvml_reader():
    """(read, processes) through NVML, or None without pynvml: read() gives {uuid: {"w": W,
    "mj": total energy or None, "t": C, "u": %, "sm": MHz, "why": [reasons]}}, processes() the
    compute processes' pids."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no pynvml in this python, or NVML does not load: nvidia-smi instead
        return None
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    uuids = [pynvml.nvmlDeviceGetUUID(h) for h in handles]
    uuids = [u.decode() if isinstance(u, bytes) else u for u in uuids]
    events = (getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
              or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons)  # the name before NVML 12.2

    def ask(function, *args):
        try:  # a field the card does not have (energy before Volta) is None, not a failed read
            return function(*args)
        except pynvml.NVMLError:
            return None

    def read():
        found = {}
        for uuid, h in zip(uuids, handles, strict=True):
            util = ask(pynvml.nvmlDeviceGetUtilizationRates, h)
            found[uuid] = {
                "w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
                "mj": ask(pynvml.nvmlDeviceGetTotalEnergyConsumption, h),
                "t": ask(pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU),
                "u": getattr(util, "gpu", None),
                "sm": ask(pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM),
                "why": reasons(ask(events, h)),
            }
        return found

    def processes():
        return sorted({p.pid for h in handles
                       for p in ask(pynvml.nvmlDeviceGetComputeRunningProcesses, h) or ()})
    return read, processes


SMI_FIELDS = "uuid,power.draw,temperature.gpu,utilization.gpu,clocks.sm,clocks_event_reasons.active"


def smi_reader(smi: str):
    """(read, processes) from nvidia-smi (NVML's own command line; it shows no energy counter)."""
    def read():
        out = subprocess.run([smi, f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        found = {}
        for row in out.splitlines():
            cells = [cell.strip() for cell in row.split(",")]
            if len(cells) != 6 or number(cells[1]) is None:
                continue
            found[cells[0]] = {"w": number(cells[1]), "mj": None, "t": number(cells[2]),
                               "u": number(cells[3]), "sm": number(cells[4]),
                               "why": reasons(cells[5])}
        return found

    def processes():
        out = subprocess.run([smi, "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return sorted({int(cell) for cell in out.split() if cell.isdigit()})
    return read, processes


#: Where the kernel's hwmon drivers show their sensors, and the name the corsair-psu driver gives
#: its folder (Documentation/hwmon/corsair-psu.rst: power1_input is the total power).
HWMON = "/sys/class/hwmon"
PSU_NAME = "corsairpsu"


def find_psu(root: str = HWMON):
    """The first hwmon folder under `root` that a corsair-psu driver named, with a power1_input;
    None where there is none (most rigs: no PSU with USB-HID telemetry)."""
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return None
    for entry in entries:
        folder = os.path.join(root, entry)
        try:
            with open(os.path.join(folder, "name")) as handle:
                if handle.read().strip() != PSU_NAME:
                    continue
        except OSError:
            continue
        if os.path.exists(os.path.join(folder, "power1_input")):
            return folder
    return None


def psu_watts(folder):
    """The PSU's total DC output (W) from power1_input (uW), None when a read fails (the driver
    answers an error when the PSU does not reply over USB)."""
    try:
        with open(os.path.join(folder, "power1_input")) as handle:
            return int(handle.read().strip()) / 1e6
    except (OSError, ValueError):
        return None


def others(pids, engine_unit: str) -> list:
    """[pid, command] of each GPU process outside the serving engine's unit (its cgroup)."""
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cgroup") as handle:
                if engine_unit and engine_unit in handle.read():
                    continue
            with open(f"/proc/{pid}/comm") as handle:
                name = handle.read().strip()
        except OSError:
            name = "(not visible here)"  # gone, or in a pid namespace this one cannot see
        found.append([pid, name])
    return found


def meter(directory: str, name: str, interval: float, smi: str, engine_unit: str,
          hwmon: str = HWMON) -> int:
    """Samples, one JSON line each, appended to D/<name>.jsonl as they are taken (a stop that
    comes in the middle of a slow read loses nothing already taken); D/<name>.done when over.
    Each line: [epoch s, {uuid: {...}}, others or null, PSU DC W or null] (others: looked for
    every few s; the PSU read right after the cards)."""
    readers = nvml_reader()
    source = "nvml" if readers else "nvidia-smi"
    read, processes = readers or smi_reader(smi)
    psu = find_psu(hwmon)
    stop = os.path.join(directory, f"{name}.stop")
    looked = 0.0
    with open(os.path.join(directory, f"{name}.jsonl"), "w") as out:
        out.write(json.dumps({"source": source, "interval": interval, "psu": psu}) + "\n")
        out.flush()
        while not os.path.exists(stop) and not lease_over(directory, time.time()):
            began = time.time()
            seen = None
            try:
                gpus = read()
            except (OSError, subprocess.SubprocessError) as error:
                gpus = {"error": str(error)}
            psu_w = psu_watts(psu) if psu else None
            if began - looked >= PROCESS_EVERY_S:
                looked = began
                try:
                    seen = others(processes(), engine_unit)
                except Exception as error:  # noqa: BLE001  (an unknown is recorded, not fatal)
                    seen = [[0, f"unknown: {type(error).__name__}"]]
            out.write(json.dumps([began, gpus, seen, psu_w]) + "\n")
            out.flush()
            time.sleep(max(interval - (time.time() - began), 0.0))
    write_text(os.path.join(directory, f"{name}.done"), "")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    g = modes.add_parser("guard")
    g.add_argument("--unit", required=True)
    g.add_argument("--dir", required=True)
    g.add_argument("--poll", type=float, default=0.5)
    g.add_argument("--smi-timeout", type=float, default=SMI_TIMEOUT_S)
    m = modes.add_parser("meter")
    m.add_argument("--dir", required=True)
    m.add_argument("--name", required=True)
    m.add_argument("--interval", type=float, default=0.2)
    m.add_argument("--smi", required=True)
    m.add_argument("--engine-unit", default="")
    m.add_argument("--hwmon", default=HWMON)
    args = parser.parse_args(argv)
    if args.mode == "guard":
        return guard(args.unit, args.dir, args.poll, args.smi_timeout)
    return meter(args.dir, args.name, args.interval, args.smi, args.engine_unit, args.hwmon)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
