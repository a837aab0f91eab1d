"""Wait until the rig's own engine answers its OpenAI-compatible API, from the rig itself.

Installed by rigbook (roles/serving.py) at /opt/rigbook/serving/health.py and run as root with
the rig's python3 (standard library only), so it works whatever the bind address is, loopback
included. The API key is read from the root-only env file the unit reads, never from argv.

    python3 health.py --url http://127.0.0.1:8000 --timeout 900 \
        --key-file /etc/rigbook/serving/api-key.env --unit rigbook-serve.service

Polls GET /v1/models until it lists a model, then asks for one short completion. Gives up
early when the unit leaves its running state (the engine exited: systemd restarts it later,
but this start has failed), or, without systemd, when rigbook's supervisor (--pidfile) exits.
Prints one JSON line; exit 0 = healthy, 1 = not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

POLL_S = 2.0


def read_key(path: str | None) -> str | None:
    """The value of the one VAR=value line of a systemd env file (None without a file)."""
    if not path:
        return None
    try:
        with open(path) as handle:
            for line in handle:
                line = line.strip()
                if line and not line.startswith("#") and "=" in line:
                    return line.split("=", 1)[1].strip().strip('"')
    except FileNotFoundError:
        return None
    return None


def unit_state(unit: str) -> dict[str, str]:
    try:
        out = subprocess.run(
            ["systemctl", "show", unit, "-p", "ActiveState,SubState,NRestarts,ExecMainStatus"],
            capture_output=True, text=True, check=False,
        ).stdout
    except OSError:  # no systemctl: nothing to say about the unit, the API still answers
        return {}
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def supervisor_gone(pidfile: str) -> bool:
    """Whether rigbook's supervisor (no systemd) has exited: it gave up, or a GPU check
    refused the start (its log says which)."""
    try:
        pid = int(open(pidfile).read().strip())
    except (OSError, ValueError):
        return True
    return not os.path.exists(f"/proc/{pid}")


def request(url: str, key: str | None, body: dict | None = None, timeout: float = 10.0):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as response:
        return response.status, json.loads(response.read().decode() or "null")


def wait(url: str, key: str | None, unit: str | None, timeout: float, once: bool,
         pidfile: str | None = None) -> dict:
    start = time.monotonic()
    restarts = unit_state(unit).get("NRestarts", "0") if unit else "0"
    last = "no answer yet"
    while True:
        if pidfile and supervisor_gone(pidfile):
            return {"ok": False, "stage": "engine",
                    "message": f"the supervisor of {pidfile} exited: the engine is not running",
                    "seconds": round(time.monotonic() - start, 1)}
        if unit:
            state = unit_state(unit)
            sub = state.get("SubState", "")
            if (
                state.get("ActiveState") in ("failed", "inactive")
                or sub == "auto-restart"
                or state.get("NRestarts", "0") != restarts
            ):
                return {
                    "ok": False, "stage": "engine",
                    "message": f"{unit} is {state.get('ActiveState')}/{sub}: the engine exited "
                    f"(status {state.get('ExecMainStatus', '?')})",
                    "seconds": round(time.monotonic() - start, 1),
                }
        try:
            status, models = request(f"{url}/v1/models", key, timeout=5)
            ids = [m.get("id") for m in (models or {}).get("data", []) if isinstance(m, dict)]
            if status == 200 and ids:
                break
            last = f"/v1/models answered {status} with no model"
        except urllib.error.HTTPError as error:
            last = f"/v1/models answered {error.code}"
            if error.code in (401, 403):
                return {"ok": False, "stage": "auth", "message": last + " (API key refused)",
                        "seconds": round(time.monotonic() - start, 1)}
        except (OSError, ValueError) as error:
            last = f"/v1/models: {error}"
        if once or time.monotonic() - start > timeout:
            return {"ok": False, "stage": "models", "message": last,
                    "seconds": round(time.monotonic() - start, 1)}
        time.sleep(POLL_S)
    model = ids[0]
    if once:
        return {"ok": True, "model": model, "seconds": round(time.monotonic() - start, 1)}
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    try:
        status, answer = request(f"{url}/v1/completions", key, body, timeout=120)
        text = answer["choices"][0].get("text", "")
    except (OSError, ValueError, KeyError, IndexError, TypeError) as error:
        return {"ok": False, "stage": "completion", "model": model,
                "message": f"/v1/completions: {error}",
                "seconds": round(time.monotonic() - start, 1)}
    return {"ok": True, "model": model, "completion": text,
            "seconds": round(time.monotonic() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="http://HOST:PORT of the engine")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--key-file", help="systemd env file holding the API key")
    parser.add_argument("--unit", help="systemd unit running the engine")
    parser.add_argument("--pidfile", help="pidfile of rigbook's supervisor (no systemd)")
    parser.add_argument("--once", action="store_true", help="one /v1/models request, no wait")
    args = parser.parse_args(argv)
    result = wait(args.url.rstrip("/"), read_key(args.key_file), args.unit, args.timeout,
                  args.once, args.pidfile)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
