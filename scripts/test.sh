#!/usr/bin/env bash
# The whole test suite: unit and operation tests, then end-to-end tests on sandbox rigs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -ra "$@"
