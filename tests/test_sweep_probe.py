"""Where concurrency plateaus (sweep_concurrency_probe): 1, 2, 4, ... streams at the rig's
current cap; the smallest level within noise of the best, on synthetic windows of known answer."""

from __future__ import annotations

import random

import pytest

from rigbook.roles import charts
from rigbook.roles.sweep import probe_skipped, report_lines, save_sweep
from rigbook.roles.sweepresult import (
    ConcurrencyProbe,
    Sample,
    decode_window,
    plateau_level,
    probe_levels,
    probe_line,
)
from tests.test_power import UUID0
from tests.test_sweep import reading, sample_run

#: The synthetic card's aggregate tok/s per level: it rises until about 12 streams, then gains
#: under 2 % more (a known answer: 16 streams are within noise of the best, 8 are not).
RATES = {1: 30.0, 2: 60.0, 4: 120.0, 8: 240.0, 16: 355.0, 32: 360.0, 64: 362.0}
#: Each 0.5 s bin jittered by this share, the same seeded jitter at every level: the levels differ
#: by their rates alone, and each window's interval is about +-2 %.
NOISE, SEED = 0.06, 7


def probe_window(level: int, rate: float):
    """A 20 s decode window of `level` streams at `rate` aggregate tok/s, the draw steady."""
    rng, begin = random.Random(SEED), 1000.0
    tokens = []
    for i in range(40):
        count = max(1, round(rate * 0.5 * rng.gauss(1.0, NOISE)))
        tokens += [(begin + i * 0.5 + j * 0.5 / count, 1.0) for j in range(count)]
    samples = [Sample(begin + i * 0.25, {UUID0: reading(300.0)}) for i in range(-2, 84)]
    return decode_window("decode-concurrent", "narrative", level, level, tokens, begin, 20.0,
                         samples, 350.0)


def test_probe_levels_double_up_to_max_num_seqs_or_64():
    assert probe_levels(None) == [1, 2, 4, 8, 16, 32, 64]
    assert probe_levels(8) == [1, 2, 4, 8]
    assert probe_levels(12) == [1, 2, 4, 8, 12]
    assert probe_levels(256) == [1, 2, 4, 8, 16, 32, 64]
    assert probe_levels(1) == [1]


def test_the_plateau_is_the_smallest_level_within_noise_of_the_best():
    """16, 32 and 64 streams (355-362 tok/s) cannot be told apart by these windows, so the
    plateau is 16, the smallest; 8 streams (240 tok/s) are told apart."""
    windows = [probe_window(level, rate) for level, rate in RATES.items()]
    best = max(windows, key=lambda win: win.tps.mean)
    assert best.concurrency == 64 and 0.01 < (best.tps.high - best.tps.mean) / 362 < 0.04
    assert plateau_level(windows) == 16
    # 16 streams clearly short of the best: the plateau moves to 32
    short = [probe_window(level, 320.0 if level == 16 else rate) for level, rate in RATES.items()]
    assert plateau_level(short) == 32
    # a card that never saturates within the levels: the highest level is the plateau
    assert plateau_level([probe_window(level, RATES[level]) for level in (1, 2, 4, 8)]) == 8


def test_the_probe_is_reported_and_charted(tmp_path):
    if not charts.available():
        pytest.skip("matplotlib (the charts extra) is not installed")
    windows = tuple(probe_window(level, RATES[level]) for level in probe_levels(32))
    probe = ConcurrencyProbe(caps_w={UUID0: 350.0}, windows=windows, plateau=16)
    run = sample_run(concurrency=probe)
    line = probe_line(probe)
    assert line.startswith("concurrency plateaus at 16 streams (") and "current cap 350 W" in line
    assert line.endswith("the sweep's decode-concurrent ran at 16")
    assert report_lines(run)[0] == line
    path, written = save_sweep(run, tmp_path)
    assert path.with_name(path.stem + "-concurrency.png") in written
    assert (tmp_path / path.relative_to(tmp_path)).with_name(
        path.stem + "-concurrency.png").read_bytes().startswith(b"\x89PNG")


def test_the_probe_is_skipped_where_it_cannot_run():
    assert probe_skipped("llama.cpp", probe_levels(None)) == (
        "skipped (llama.cpp: one stream at a time)")
    assert probe_skipped("vllm", probe_levels(1)) == "skipped (the recipe's max_num_seqs is 1)"
    assert probe_skipped("vllm", probe_levels(8)) is None


def test_the_sweep_runs_the_probe_on_the_meter_and_keeps_its_plateau():
    """_Sweep.probe_concurrency with the rig's side replaced: each level's decode window is the
    synthetic card's, the meter's samples steady; the plateau is kept for the caps' windows."""
    from types import SimpleNamespace

    from rigbook.roles.sweep import SweepSettings, _Sweep

    sweep = object.__new__(_Sweep)
    begin = 1000.0
    samples = [Sample(begin + i * 0.25, {UUID0: reading(300.0)}) for i in range(-2, 84)]
    asked, warmed = [], []

    def decode(prompt, level, offset):
        asked.append((prompt, level))
        rng, tokens = random.Random(SEED), []
        for i in range(40):
            count = max(1, round(RATES[level] * 0.5 * rng.gauss(1.0, NOISE)))
            tokens += [(begin + i * 0.5 + j * 0.5 / count, 1.0) for j in range(count)]
        return begin, level, tokens

    sweep.target = SimpleNamespace(engine="vllm")
    sweep.settings_sweep = SweepSettings(window_s=20.0)
    sweep.ladder = SimpleNamespace(warm_up=warmed.append)
    sweep.live = lambda: {UUID0: 350.0}
    sweep.meter_start = lambda name: 0.0
    sweep.meter_stop = lambda name: ("nvidia-smi", None, samples)
    sweep.decode = decode
    sweep.probe = None
    said = sweep.probe_concurrency(None)
    assert asked == [("narrative", level) for level in RATES] and warmed == ["narrative"]
    assert sweep.probe is not None and sweep.probe.plateau == 16
    assert [win.concurrency for win in sweep.probe.windows] == list(RATES)
    assert said == probe_line(sweep.probe)
    assert all(win.evidence.samples == 81 for win in sweep.probe.windows)  # the meter's, 20 s
    sweep.target = SimpleNamespace(engine="llama.cpp")
    assert sweep.probe_concurrency(None) == (
        "concurrency probe skipped (llama.cpp: one stream at a time)")
