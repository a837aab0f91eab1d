#!/usr/bin/env bash
# The whole test suite: the unit tier (`-m "not sandbox"`) in parallel on pytest-xdist workers,
# then the end-to-end tier (`-m sandbox`) in one serial session: its rigs are one set, shared
# by every e2e file under one lock. Arguments go to both runs (paths, -k, -x ...); a tier that
# they select nothing of is passed over (pytest's exit 5), not failed. RIGBOOK_TEST_WORKERS sets
# the unit tier's workers (default 3: its tests wait on subprocesses, so one more than 2 cores).
# RIGBOOK_TEST_SANDBOX_SETS=N (opt-in, default 1) runs the e2e tier on N workers, each with a
# set of rigs of its own (RIGBOOK_SANDBOX_SET, docs/sandbox.md), whole files per worker.
set -euo pipefail
cd "$(dirname "$0")/.."
workers=${RIGBOOK_TEST_WORKERS:-3}
sets=${RIGBOOK_TEST_SANDBOX_SETS:-1}
if ! [[ $sets =~ ^[1-9]$ ]]; then
    echo "test.sh: RIGBOOK_TEST_SANDBOX_SETS must be 1 to 9, not '$sets'" >&2
    exit 2
fi
spread=()
if [ "$sets" -gt 1 ]; then
    spread=(-n "$sets" --dist loadfile)
fi
bash scripts/setup.sh
.venv/bin/ruff check .
unit=0
.venv/bin/python -m pytest -ra -m "not sandbox" -n "$workers" "$@" || unit=$?
e2e=0
.venv/bin/python -m pytest -ra -m sandbox ${spread[@]+"${spread[@]}"} "$@" || e2e=$?
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
