"""Verify and benchmark each rig's running serving recipe, from this machine, over its API.

    pyinfra inventory/rigs.py deploys/verify.py
    pyinfra inventory/rigs.py deploys/verify.py --limit rig-dual3090 --data verify_bench_runs=10

Per rig, a ladder stopped at the first failure: health and served name, one chat completion,
a prefill of verify_prefill_tokens, a needle probe at each depth and a beyond-context rejection,
then the narrative/code streaming bench (TTFT and decode tok/s, 1 stream and
verify_bench_concurrency). Each run is stored as JSON under RIGBOOK_VERIFY_DIR (default
~/.local/share/rigbook/verify); `rigbook bench compare` tables them. A failing rig fails alone:
the others go on, and pyinfra exits non-zero. docs/verify.md.
"""

from rigbook.jobs import verify_serving

verify_serving()
