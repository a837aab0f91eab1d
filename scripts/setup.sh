#!/usr/bin/env bash
# Install what rigbook and its sandbox rigs need on a Debian 12 / Ubuntu 24.04 machine (as root):
# the tools that build and boot sandbox rigs, and a venv with rigbook and its test dependencies.
# With --bench, also the peers that `python -m bench` measures rigbook against (ansible-core,
# the `bench` extra); nothing else needs them.
set -euo pipefail
cd "$(dirname "$0")/.."
bench=0
[ "${1:-}" = --bench ] && bench=1

bench_tools() {
    if [ "$bench" = 1 ] && [ ! -x .venv/bin/ansible-playbook ]; then
        .venv/bin/python -m pip install -q -e '.[dev,bench]'
        echo "setup: installed the bench's peers (ansible-core)"
    fi
}

packages=(debootstrap systemd-container iproute2 zstd openssh-client dpkg-dev python3-venv)
missing=()
for pkg in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi

# The venv is current when it was installed from this pyproject.toml and its packages are all
# there: then nothing is fetched, so the demo also runs offline.
stamp=.venv/.rigbook-pyproject.sha256
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] &&
        .venv/bin/python -m pip check -q >/dev/null 2>&1 && [ -x .venv/bin/rigbook ]; then
    echo "setup: .venv is current (pyproject.toml unchanged since its install): nothing fetched"
    bench_tools
    exit 0
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
rm -f "$stamp"
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
echo "$want" > "$stamp"
bench_tools
