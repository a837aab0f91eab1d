#!/usr/bin/env bash
# The main job on the embedded default: boot three local sandbox rigs (dual 3090, single 4090,
# WSL2 3090; simulated GPUs) and converge them with the real pyinfra CLI over SSH.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/rigbook sandbox up "${RIGS:-3}"
.venv/bin/pyinfra -y inventory/sandbox.py deploys/rig.py
echo
echo "Converged. Run it again to see no changes:  .venv/bin/pyinfra -y inventory/sandbox.py deploys/rig.py"
echo "Tear the sandbox rigs down with:             .venv/bin/rigbook sandbox down"
