#!/usr/bin/env bash
# Install what rigbook and its sandbox rigs need on a Debian 12 / Ubuntu 24.04 machine (as root):
# the tools that build and boot sandbox rigs, and a venv with rigbook and its test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(debootstrap systemd-container iproute2 zstd openssh-client dpkg-dev python3-venv)
missing=()
for pkg in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
