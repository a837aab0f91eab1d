"""Verify and benchmark each rig's running serving recipe, from this machine, over its API.

    pyinfra inventory/rigs.py deploys/verify.py
    pyinfra inventory/rigs.py deploys/verify.py --limit rig-dual3090 --data verify_bench_runs=10
    pyinfra inventory/rigs.py deploys/verify.py --limit rig-dual3090 --data verify_level=stress
    pyinfra inventory/rigs.py deploys/verify.py --limit rig-dual3090 --data verify_level=soak

Per rig, a ladder stopped at the first failure. verify_level=quick (the default): health and
served name, one chat completion, tool calls and thinking where the recipe has their parsers,
a long generation, a prefill of verify_prefill_tokens, a needle probe at each depth and a
beyond-context rejection, speculative acceptance where the recipe speculates, then the
narrative/code streaming bench (TTFT, decode and wall tok/s with mean, spread and CV, 1 stream
and verify_bench_concurrency). stress: salted needles at 10K-90K tokens and the context ceiling
ladder with free VRAM per rung. soak: multi-turn sessions, bounded in time and requests. Each
run is stored as JSON under RIGBOOK_VERIFY_DIR (default ~/.local/share/rigbook/verify);
`rigbook bench compare` tables them, `--ab A B` compares two. A failing rig fails alone: the
others go on, and pyinfra exits non-zero. docs/verify.md.
"""

from rigbook.jobs import verify_serving

verify_serving()
