"""Verify end to end on the dual-3090 sandbox rig (rig1): the ladder against a REAL engine.

The engine is llama-cpp-python's server on CPU serving the tiny random-weights GGUF from the
test recipe tiny-cpu-a (context 512), set up exactly as tests/test_serving_e2e.py does (its
helpers are imported). It binds 0.0.0.0 with an API key, so this machine reaches it at the
rig's own address, as an operator's machine reaches a rig on the LAN. One story:

1. deploys/verify.py with small sizes: the whole ladder passes (the needle step checks the
   plumbing: accepted at each depth, rejected beyond the context); the run is stored as JSON;
   a planted degeneration: the same engine, one word forced by logit_bias, loops, and the
   long-generation step's detector says so;
2. a ladder told the context is 1024 fails at the needle step with the engine's own error;
3. the stress level passes (salted needles, the ceiling ladder to 0.92 of 512 tokens); told the
   context is 1024, its ceiling ladder fails at the first rung beyond 512 and names the real
   ceiling; the soak level runs its bounded multi-turn sessions on the same engine;
4. with the engine stopped, the ladder fails at its first step;
5. `rigbook bench compare` tables the runs of every level and writes a PNG; `--ab` compares two;
6. the tool-call steps on tiny-cpu-tools (llama-cpp-python's chatml-function-calling, the tool
   named in tool_choice, so its grammar writes the call): the random model's call is cut off
   inside a string (the grammar allows any character there) and `tools` fails on its arguments;
   the GGUF written to call (tests/tinymodel.py, caller) passes `tools` and `tools-stream`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests

from rigbook import cli
from rigbook.roles import degeneration
from rigbook.roles.serving import UNIT_NAME
from rigbook.roles.verify import load_runs
from tests.conftest import SANDBOX_INVENTORY, rig_ssh, run_pyinfra
from tests.standins import place_model, wheelhouse_for_llama
from tests.test_serving_e2e import (
    CACHE,
    CONF_DIR,
    CONVERGE,
    KEY,
    UNIT_PATH,
    VENVS_DIR,
    data_args,
)
from tests.tinymodel import FILE, WORDS, revision_of, vocabulary, write_tiny_gguf

VERIFY = "deploys/verify.py"

pytestmark = pytest.mark.sandbox
SMALL = {
    "verify_prefill_tokens": "300", "verify_needle_depths": "[0.1, 0.5, 0.9]",
    "verify_needle_exact": "false", "verify_bench_warmups": "1", "verify_bench_runs": "3",
    "verify_bench_tokens": "24", "verify_bench_concurrency": "2", "verify_timeout_s": "60",
}


def extra(**more: str) -> list[str]:
    args = []
    for key, value in {**SMALL, **more}.items():
        args += ["--data", f"{key}={value}"]
    return args


def test_verify_story(sandbox, tmp_path: Path, monkeypatch, capsys):
    wheelhouse_for_llama()
    rig = sandbox["rig1"]
    results = tmp_path / "results"
    monkeypatch.setenv("RIGBOOK_VERIFY_DIR", str(results))
    gguf = write_tiny_gguf(tmp_path / FILE)
    revision = revision_of(gguf)
    place_model(rig, gguf, revision)
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    base = data_args("tiny-cpu-a", revision, key_file)

    def verify(**more: str):
        return run_pyinfra(SANDBOX_INVENTORY, VERIFY, *base, *extra(**more))

    try:
        up = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, *base)
        assert up.returncode == 0, up.explain()

        # 1. the whole ladder passes, and the run is stored
        ok = verify()
        print(ok.stderr)
        assert ok.returncode == 0, ok.explain()
        assert "tiny-cpu-a passed the verify ladder" in ok.stderr
        runs = load_runs()
        assert len(runs) == 1 and runs[0].ok and runs[0].rig == "rig1"
        run = runs[0]
        steps = {s.name: s for s in run.steps}
        assert list(steps) == ["health", "chat", "tools", "tools-stream", "thinking",
                               "long-generation", "prefill", "needle", "speculative", "bench"]
        # tiny-cpu-a has no tool or reasoning parser and does not speculate: those steps are
        # skipped, saying why
        assert [s.name for s in run.steps if s.skipped] == ["tools", "tools-stream", "thinking",
                                                            "speculative"]
        assert run.url == f"http://{rig['address']}:8100" and run.served_model == "local/tiny"
        # the essay gets what the 512-token context leaves; the random model's text is varied
        assert "repeated 4-grams" in steps["long-generation"].detail
        needle = steps["needle"].detail
        assert needle.count("accepted") == 3 and "tok rejected (HTTP 400)" in needle
        assert {(b.prompt, b.concurrency) for b in run.bench} == {("narrative", 1), ("code", 1)}
        assert "concurrent bench skipped (llama.cpp: one stream at a time)" in \
            steps["bench"].detail
        assert all(b.tokens == 24 and b.decode_tps.median > 0 for b in run.bench)
        stored = next(results.glob("rig1/tiny-cpu-a/*/*/*.json"))
        assert json.loads(stored.read_text())["ok"] is True

        # a planted degeneration on the real engine: the essay with one word's token forced
        forced = vocabulary()[0].index(f"\u2581{WORDS[4]}")  # "rig"
        loop = requests.post(
            f"{run.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
            json={"model": "local/tiny", "max_tokens": 200, "logit_bias": {str(forced): 100},
                  "messages": [{"role": "user", "content": degeneration.ESSAY_PROMPT}]},
            timeout=60).json()["choices"][0]["message"]["content"]
        with pytest.raises(degeneration.Degenerate, match="lexical variety") as found:
            degeneration.check(loop)
        print(f"planted degeneration: {found.value.got}")
        assert "'rig rig rig rig'" in found.value.got

        # 2. the ladder believes 1024 tokens: the engine (n_ctx 512) rejects the needle probe
        beyond = verify(verify_context_len="1024")
        assert beyond.returncode != 0
        print(beyond.stderr)
        assert "rig1: verify of tiny-cpu-a" in beyond.stderr
        assert "failed at step needle" in beyond.stderr
        assert "(context 1024)" in beyond.stderr
        assert "This model's maximum context length is 512 tokens" in beyond.stderr

        # 3. the stress level: needles that fit (60000 does not), a ceiling of three rungs
        stressed = verify(verify_level="stress", verify_stress_needles="[100, 300, 60000]",
                          verify_ceiling_rungs="3")
        print(stressed.stderr)
        assert stressed.returncode == 0, stressed.explain()
        assert "tiny-cpu-a passed the verify ladder (stress)" in stressed.stderr
        run = load_runs()[-1]
        assert run.level == "stress"
        assert [s.name for s in run.steps] == ["health", "chat", "stress-needles", "ceiling"]
        needles = run.steps[2].detail
        assert needles.count("accepted") == 2 and "60000 skipped (beyond the 512-token" in needles
        assert [r.tokens for r in run.ceiling.rungs] == [235, 353, 471]
        assert run.ceiling.failed is None and run.ceiling.ceiling > 471
        # free VRAM per rung: rig1's stand-in nvidia-smi answers once an earlier e2e file of the
        # session installed the simulated driver (its two cards); alone, this file's rig1 has
        # none, and the step says so
        free = [r.free_mib for r in run.ceiling.rungs]
        if free == [None] * 3:
            assert "free VRAM not read" in run.steps[3].detail
        else:
            assert all(f is not None and len(f) == 2 and min(f) > 0 for f in free), free
            assert run.steps[3].detail.count(" MiB") == 3
        # the context set beyond what the engine holds: the first rung beyond 512 fails
        ceiling = verify(verify_level="stress", verify_stress_needles="[100]",
                         verify_ceiling_rungs="3", verify_ceiling_start="300",
                         verify_context_len="1024")
        print(ceiling.stderr)
        assert ceiling.returncode != 0
        assert "failed at step ceiling: expected a 621-token prompt to be served" in ceiling.stderr
        assert "the real ceiling is 3" in ceiling.stderr
        assert "This model's maximum context length is 512 tokens" in ceiling.stderr
        # the soak: sessions of up to three turns whose context ramps (the tiny vocabulary spells
        # the question out, so the estimate ends each session before a turn 512 cannot hold;
        # llama-cpp-python answers such a turn with an empty stream). Retention is measured,
        # not judged: the sandbox's CPU is shared. Its streams carry no usage: no prompt sizes.
        soaked = verify(verify_level="soak", verify_soak_seconds="120", verify_soak_requests="6",
                        verify_soak_turns="3", verify_soak_context_tokens="400",
                        verify_soak_min_retention="0.0")
        print(soaked.stderr)
        run = load_runs()[-1]
        assert run.level == "soak" and run.soak.requests == 6 and run.soak.sessions >= 2
        assert [t.turn for t in run.soak.turns if t.session == 0][:2] == [0, 1]  # multi-turn
        # no VRAM read without the simulated driver; with it, the stand-in's constant use
        assert not run.soak.errors and run.soak.vram_growth_mib in (None, 0)
        # the random model may end a turn at once: an empty reply, counted and failing
        assert (soaked.returncode == 0) == (not run.soak.empty), soaked.explain()

        # 4. the engine stopped: the first step fails
        rig_ssh(rig, f"systemctl stop {UNIT_NAME}")
        dead = verify()
        print(dead.stderr)
        assert dead.returncode != 0
        assert "failed at step health" in dead.stderr and "ConnectionError" in dead.stderr
        assert [r.failed_step for r in load_runs()][:4] == [None, "needle", None, "ceiling"]
        assert load_runs()[-1].failed_step == "health"

        # 5. the compare table and the chart
        capsys.readouterr()
        png = tmp_path / "bench.png"
        assert cli.main(["bench", "compare", "--rig", "rig1", "--png", str(png)]) == 0
        table = capsys.readouterr().out
        with capsys.disabled():
            print(table)
        assert table.count("rig1") >= 3 and "FAIL needle" in table and "FAIL health" in table
        assert "FAIL ceiling" in table and "stress" in table and "soak" in table
        assert png.read_bytes().startswith(b"\x89PNG")
        first, stressed_run = load_runs()[0], load_runs()[2]
        assert cli.main(["bench", "compare", "--ab", str(stored), str(stored)]) == 0
        assert "inside the noise" in capsys.readouterr().out
        assert first.fingerprint.engine == "llama.cpp" and stressed_run.fingerprint is not None

        # 6. tool calls: the random model under the parser's grammar never closes a string
        def tools_on(gguf_revision: str):
            args = data_args("tiny-cpu-tools", gguf_revision, key_file)
            served = run_pyinfra(SANDBOX_INVENTORY, CONVERGE, *args)
            assert served.returncode == 0, served.explain()
            return run_pyinfra(SANDBOX_INVENTORY, VERIFY, *args, *extra())

        cut = tools_on(revision)
        print(cut.stderr)
        assert cut.returncode != 0
        assert "failed at step tools: expected choices[0].message.tool_calls[0].function." \
            "arguments to parse as JSON" in cut.stderr
        assert "{ \"city\": \"" in cut.stderr and "the tool parser does not match" in cut.stderr
        # the GGUF written to call: the call in tool_calls[], streamed as delta.tool_calls
        written = tmp_path / "caller"
        written.mkdir()
        caller = write_tiny_gguf(written / FILE, caller=True)
        place_model(rig, caller, revision_of(caller))
        called = tools_on(revision_of(caller))
        print(called.stderr)
        assert called.returncode == 0, called.explain()
        run = load_runs()[-1]
        assert run.recipe == "tiny-cpu-tools" and run.url.endswith(":8102")
        assert [s.name for s in run.steps if s.skipped] == ["thinking", "speculative"]
        steps = {s.name: s.detail for s in run.steps}
        call = 'get_current_weather({"city": "", "state": "", "unit": "celsius"}), 1 call(s)'
        assert steps["tools"] == f"{call}, finish_reason tool_calls"
        assert steps["tools-stream"].startswith(f"{call}, finish_reason tool_calls, ")
        assert int(steps["tools-stream"].split(", ")[-1].split()[0]) > 1  # argument fragments
    finally:
        rig_ssh(rig, f"systemctl disable --now {UNIT_NAME}; rm -rf {UNIT_PATH} {CONF_DIR} "
                     f"{CACHE}/models--local--tiny {VENVS_DIR}/tiny-cpu {VENVS_DIR}/tiny-cpu-* "
                     f"{VENVS_DIR}/tiny-cpu.env; systemctl daemon-reload", check=False)
