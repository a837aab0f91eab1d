"""verify's levels (stress, soak) and the bench as a measurement, against the loopback stub of
tests/test_verify.py (one token per word, llama-cpp-python's context error; a crash planted by
`fits`, empty replies planted by `empty_streams`); free VRAM comes from a planted reader."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from rigbook import cli
from rigbook.core.errors import RigbookError
from rigbook.roles import benchab, soak, stress
from rigbook.roles.stepproblem import StepProblem
from rigbook.roles.verify import Stat, VerifyRun, load_runs, run_ladder, save_run
from tests.test_verify import SMALL, server, step, target  # noqa: F401 (server: a fixture)
from tests.test_verify import rig as parse_rig_with

STRESS = replace(SMALL, level="stress", stress_needles=(100, 300, 600), ceiling_start=95000,
                 ceiling_rungs=5)
SOAK = replace(SMALL, level="soak", soak_seconds=30, soak_requests=12, soak_turns=3,
               soak_context_tokens=300, soak_min_retention=0.5, bench_tokens=8)


def reader(*values):
    """A planted free-VRAM reader: one reading per call, the last one repeated."""
    left = list(values)

    def read():
        return left.pop(0) if len(left) > 1 else left[0]
    return read


def test_rungs_and_needle_sizes():
    # from ~95K to 0.92 of the context, evenly, both ends included
    big = stress.rungs(262144)
    assert big[0] == 95000 and big[-1] == int(0.92 * 262144) == 241172 and len(big) == 5
    assert {b - a for a, b in zip(big, big[1:], strict=False)} <= {36543, 36544}
    assert stress.rungs(131072, count=3) == [95000, 107793, 120586]
    # a context whose top rung is not above the start begins at half the top
    assert stress.rungs(1024) == [471, 589, 706, 824, 942]
    assert stress.rungs(1024, count=1) == [942]
    assert stress.needle_sizes(65536, stress.NEEDLE_TOKENS, 64) == ([10000, 30000, 60000],
                                                                   [90000])


def test_stress_passes_with_salted_needles_and_a_ceiling(server):  # noqa: F811
    fake, url = server
    fake.context = 1024
    run = run_ladder(target(url, 1024), STRESS, vram=reader((40000,), (39000,)))
    assert run.ok and run.level == "stress"
    assert [s.name for s in run.steps] == ["health", "chat", "stress-needles", "ceiling"]
    needles = step(run, "stress-needles").detail
    assert "100: " in needles and "300: " in needles and "600: " in needles
    assert needles.count("recalled") == 3
    ceiling = run.ceiling
    assert [r.tokens for r in ceiling.rungs] == [471, 589, 706, 824, 942]
    assert ceiling.free_before_mib == (40000,) and ceiling.rungs[-1].free_mib == (39000,)
    assert ceiling.failed is None and 930 <= ceiling.ceiling <= 960
    assert step(run, "ceiling").detail.endswith("(every rung passed)")
    assert step(run, "ceiling").warnings == ()
    # sizes the context does not hold are skipped, and said
    small = run_ladder(target(url, 512), replace(STRESS, stress_needles=(100, 600)))
    assert "600 skipped (beyond the 512-token context)" in step(small, "stress-needles").detail
    none = run_ladder(target(url, 512), replace(STRESS, stress_needles=(600,)))
    assert step(none, "stress-needles").skipped


def test_a_context_beyond_what_the_engine_holds_gives_the_real_ceiling(server):  # noqa: F811
    """The recipe says 1024; the engine holds 512: the first refused rung is the ceiling."""
    fake, url = server
    run = run_ladder(target(url, 512), replace(STRESS, context_len=1024, stress_needles=(100,)),
                     vram=reader((20000,)))
    assert not run.ok and run.failed_step == "ceiling"
    failed = run.failure()
    assert failed.expected == ("a 589-token prompt to be served (the ladder climbs to 0.92 of "
                               "the 1024-token context)")
    assert "maximum context length is 512 tokens" in failed.got
    assert "the real ceiling is 4" in failed.got and failed.hint == stress.CONTEXT_HINT
    assert [r.error is None for r in run.ceiling.rungs] == [True, False]  # stopped there
    assert 470 <= run.ceiling.ceiling < 512


def test_a_prompt_that_crashes_the_engine_is_the_ceiling_and_thin_margins_warn(server):  # noqa: F811
    fake, url = server
    fake.context, fake.fits = 1024, 700  # an out-of-memory at ~700 tokens kills the engine
    run = run_ladder(target(url, 1024), replace(STRESS, stress_needles=(100,)),
                     vram=reader((3000,), (2000,), (900,), (0,)))
    assert run.failed_step == "ceiling"
    rungs = run.ceiling.rungs
    assert [r.tokens for r in rungs] == [471, 589, 706] and rungs[-1].oom
    assert "ConnectionError" in run.failure().got and run.failure().hint == stress.OOM_HINT
    assert "the real ceiling is 59" in run.failure().got
    warnings = run.failure().warnings
    assert warnings == ("the 589-token rung left GPU 0 900 MiB free, under the 1024 MiB margin: "
                        "a longer prompt, a second request or a display may not fit",)


def test_soak_passes_and_measures(server):  # noqa: F811
    fake, url = server
    fake.context = 1024
    run = run_ladder(target(url, 1024), SOAK, vram=reader((30000,), (29990,)))
    assert run.ok, run.failure()
    assert [s.name for s in run.steps] == ["health", "chat", "soak"]
    figures = run.soak
    assert figures.requests == 12 and figures.sessions == 4
    # the context ramps over the turns of each session
    prompts = [t.prompt_tokens for t in figures.turns if t.session == 0]
    assert prompts[0] < prompts[1] < prompts[2] <= 300
    assert figures.vram_growth_mib == 10 and not figures.empty and not figures.errors
    kept = figures.retention()
    assert kept is not None and kept[0] > 0
    assert step(run, "soak").detail.startswith("12 turns in 4 session(s)")


def test_soak_counts_planted_empty_replies(server):  # noqa: F811
    fake, url = server
    fake.context = 1024
    fake.empty_streams = {4, 9}  # the 5th and 10th turns answer 200 with no text
    run = run_ladder(target(url, 1024), SOAK)
    assert run.failed_step == "soak" and run.soak.requests == 12
    failed = run.failure()
    assert failed.expected == "no empty reply" and failed.hint == soak.EMPTY_HINT
    assert failed.got.startswith("2 of 12 replies empty (s2/t2, s4/t1)")
    # VRAM not read: said as a warning in a soak that passes
    fake.empty_streams = set()
    ok = run_ladder(target(url, 1024), SOAK)
    assert ok.ok and any("free VRAM not read" in w for w in step(ok, "soak").warnings)


def test_soak_stops_at_an_engine_that_dies_and_at_its_bounds(server):  # noqa: F811
    fake, url = server
    fake.context = 1024
    fake.fits = 200  # the conversation's third turn passes 200 tokens: the engine dies
    run = run_ladder(target(url, 1024), SOAK)
    assert run.failed_step == "soak" and run.failure().hint == soak.ERROR_HINT
    assert run.soak.requests == 3 and run.soak.turns[1].error is None
    assert "turn 3 of session 1" in run.failure().got and "ConnectionError" in run.failure().got
    fake.fits = None
    one = run_ladder(target(url, 1024), replace(SOAK, soak_requests=2))
    assert one.ok and one.soak.requests == 2
    assert "retention not measured" in step(one, "soak").detail


def test_a_session_ends_before_a_turn_the_context_cannot_hold(server):  # noqa: F811
    """A ramp the context cannot take: the estimate ends each session, no turn is refused."""
    fake, url = server
    run = run_ladder(target(url, 512), replace(SOAK, soak_context_tokens=5000, soak_turns=20,
                                                soak_requests=20))
    assert run.ok, run.failure()
    # 20 turns of at least 16 tokens of notes, a question and an answer do not fit 512
    assert run.soak.sessions >= 2 and 5 < max(t.turn for t in run.soak.turns) + 1 < 20
    assert max(t.prompt_tokens for t in run.soak.turns) < 512 - 8


def test_retention_and_vram_growth_fail_beyond_the_noise():
    turns = [soak.Turn(session=s, turn=t, at_s=0, tokens=8, decode_tps=tps)
             for s, rates in enumerate([(100, 101, 99), (100, 100, 100), (50, 51, 49)])
             for t, tps in enumerate(rates)]
    figures = soak.Soak(seconds=9, limit_s=60, limit_requests=9, turns_per_session=3,
                        target_tokens=300, free_start_mib=(10000,), free_end_mib=(10000,),
                        turns=tuple(turns))
    with pytest.raises(StepProblem, match="retention of 0.8") as found:
        soak.verdict(figures, 0.8)
    assert found.value.got.startswith("0.50 (first session 100.0, last 50.0 tok/s)")
    grown = figures.model_copy(update={"free_end_mib": (8000,)})
    with pytest.raises(StepProblem, match="fall by at most 1024 MiB"):
        soak.verdict(grown, 0.1)
    # a noisy drop is inside the noise: no failure
    noisy = [soak.Turn(session=s, turn=t, at_s=0, tokens=8, decode_tps=tps)
             for s, rates in enumerate([(100, 40, 160), (60, 110, 30)])
             for t, tps in enumerate(rates)]
    detail, _ = soak.verdict(figures.model_copy(update={"turns": tuple(noisy)}), 0.9)
    assert "(inside the noise)" in detail


def test_the_bench_is_a_measurement_and_ab_says_what_is_noise(server, tmp_path: Path,  # noqa: F811
                                                              monkeypatch, capsys):
    fake, url = server
    monkeypatch.setenv("RIGBOOK_VERIFY_DIR", str(tmp_path))
    settings = replace(SMALL, bench_runs=4)
    a = run_ladder(target(url), settings, driver="580.95.05", caps_w=(290.0,),
                   engine_build=("tiny-3f2a-20261204T000000Z", "0.11.0"))
    bench = a.bench[0]
    assert len(bench.decode_tps.values) == 4 and bench.decode_tps.mean > 0
    assert bench.decode_tps.cv is not None and bench.wall_tps.mean < bench.decode_tps.mean
    assert a.fingerprint.engine_version == "0.11.0" and a.fingerprint.caps_w == (290.0,)
    b = run_ladder(target(url), settings, driver="590.48.01", caps_w=(290.0,))
    for run in (a, b):
        save_run(run)
    row = benchab.measure("x", Stat.of([100, 101, 99, 100]), Stat.of([101, 100, 102, 99]))
    assert row.verdict == "inside the noise"
    row = benchab.measure("x", Stat.of([100, 101, 99, 100]), Stat.of([120, 121, 119, 122]))
    assert row.verdict == "B better" and row.change == "+20.5%"
    row = benchab.measure("TTFT", Stat.of([0.1, 0.11, 0.1]), Stat.of([0.2, 0.21, 0.2]),
                          higher_is_better=False)
    assert row.verdict == "B worse"
    old = Stat(median=1.0, min=1.0, max=1.0)  # stored before the values were kept
    assert "cannot tell" in benchab.measure("x", old, old).verdict
    # the CLI: by stamp prefix, table and JSON
    runs = load_runs()
    capsys.readouterr()
    assert cli.main(["bench", "compare", "--ab", benchab.stamp(a), benchab.stamp(b)]) == 0
    out = capsys.readouterr().out
    assert "narrative x1 decode tok/s" in out and "differs: driver: 580.95.05 -> 590.48.01" in out
    assert "differs: engine_build: tiny-3f2a-20261204T000000Z -> None" in out
    assert cli.main(["bench", "compare", "--json", "--ab", benchab.stamp(a),
                     benchab.stamp(b)]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {row["what"] for row in listed["rows"]} >= {"code x2 all streams tok/s"}
    with pytest.raises(RigbookError, match="2 stored runs with that stamp"):
        benchab.pick(runs, benchab.stamp(a)[:4])
    # every level is stored with the others and tabled with its figures
    fake.context = 1024
    stressed = run_ladder(target(url, 1024), replace(STRESS, stress_needles=(100,)))
    soaked = run_ladder(target(url, 1024), SOAK)
    for run in (stressed, soaked):
        save_run(run)
    assert {r.level for r in load_runs()} == {"quick", "stress", "soak"}
    assert VerifyRun.model_validate_json(json.dumps(soaked.model_dump(mode="json"))) == soaked
    capsys.readouterr()
    assert cli.main(["bench", "compare", "--rig", "rigA"]) == 0
    table = capsys.readouterr().out
    assert "stress" in table and "soak" in table and "ceiling" in table
    assert cli.main(["bench", "compare", "--ab", benchab.stamp(stressed),
                     benchab.stamp(stressed)]) == 0
    assert "stress ceiling tok" in capsys.readouterr().out


def test_levels_are_host_data_validated():
    rig = parse_rig_with(verify_level="stress", verify_stress_needles=[30000, 10000])
    assert rig.verify_level == "stress" and rig.verify_stress_needles == (10000, 30000)
    for bad in ({"verify_level": "stres"}, {"verify_stress_needles": [10]},
                {"verify_soak_requests": 1}, {"verify_soak_min_retention": 1.5}):
        with pytest.raises(RigbookError, match=next(iter(bad))):
            parse_rig_with(**bad)


def test_old_runs_still_load(tmp_path: Path):
    """A run stored before levels and fingerprints reads as a quick one."""
    old = {"schema_version": 1, "rig": "r", "recipe": "x", "engine": "vllm",
           "served_model": "m", "url": "http://h:1", "driver": None, "caps_w": [],
           "started": "2026-11-29T23:20:36Z", "seconds": 1.0, "ok": True, "steps": [],
           "bench": [{"prompt": "narrative", "concurrency": 1, "runs": 3, "tokens": 24,
                      "ttft_s": {"median": 0.1, "min": 0.1, "max": 0.1},
                      "decode_tps": {"median": 9.0, "min": 8.0, "max": 10.0},
                      "aggregate_tps": {"median": 9.0, "min": 8.0, "max": 10.0}}],
           "settings": {}}
    run = VerifyRun.model_validate(old)
    assert run.level == "quick" and run.fingerprint is None and run.bench[0].wall_tps is None


def test_free_vram_is_read_on_the_rig_with_the_gpu_facts_command():
    """The reader sends NvidiaGpus' own command over the rig's connection and parses the real
    H200 capture (143771 MiB total, 0 used); a broken nvidia-smi reads as unknown."""
    from rigbook.core.facts import NvidiaGpus
    from rigbook.roles.verify import free_vram_reader
    from tests.test_gpus import MISMATCH, SMI, attempt, query_lines

    class Output:
        def __init__(self, lines):
            self.stdout_lines = lines

    class Rig:
        sent: list = []
        lines = attempt(SMI, query_lines(), 0)

        def run_shell_command(self, command, **kwargs):
            self.sent.append(str(command))
            return True, Output(self.lines)

    rig = Rig()
    read = free_vram_reader(rig)
    assert read() == (143771,) and rig.sent == [NvidiaGpus().command()]
    rig.lines = attempt("/usr/bin/nvidia-smi", [MISMATCH], 18)
    assert read() is None


def test_a_long_needle_lost_says_what_a_lost_needle_means(server):  # noqa: F811
    fake, url = server
    fake.context, fake.recall = 1024, False
    run = run_ladder(target(url, 1024), STRESS)
    assert run.failed_step == "stress-needles" and run.failure().hint == stress.NEEDLE_HINT
    assert run.failure().expected.startswith("the needle at depth 0.5 of a ~100-token context "
                                             "answered with")
