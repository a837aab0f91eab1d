#!/usr/bin/env bash
# The whole test suite: the unit tier (`-m "not sandbox"`) in parallel on pytest-xdist workers,
# then the end-to-end tier (`-m sandbox`) in one serial session: its rigs are one set, shared
# by every e2e file under one lock. Arguments go to both runs (paths, -k, -x ...); a tier that
# they select nothing of is passed over (pytest's exit 5), not failed. RIGBOOK_TEST_WORKERS sets
# the unit tier's workers (default 3: its tests wait on subprocesses, so one more than 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
workers=${RIGBOOK_TEST_WORKERS:-3}
unit=0
.venv/bin/python -m pytest -ra -m "not sandbox" -n "$workers" "$@" || unit=$?
e2e=0
.venv/bin/python -m pytest -ra -m sandbox "$@" || e2e=$?
for tier in unit e2e; do
    if [ "${!tier}" = 5 ]; then
        echo "test.sh: the arguments select no test of the $tier tier (pytest's exit 5)"
    fi
done
if [ "$unit" = 5 ] && [ "$e2e" = 5 ]; then
    exit 5
fi
for status in "$unit" "$e2e"; do
    if [ "$status" != 0 ] && [ "$status" != 5 ]; then
        exit "$status"
    fi
done
exit 0
