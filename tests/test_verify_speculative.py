"""The speculative step against the loopback stub of tests/test_verify.py serving vLLM's own
/metrics exposition (tests/fixtures/metrics/SOURCES.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rigbook.roles import specmetrics
from rigbook.roles.verify import Target, failure_message, run_ladder, verify_plan
from tests.test_verify import SMALL, rig, server, step, target  # noqa: F401

CAPTURE = (Path(__file__).parent / "fixtures" / "metrics" / "vllm-41916-spec-decode.prom") \
    .read_text()
LABELS = '{engine="0",model_name="Qwen/Qwen3.6-35B-A3B-FP8"}'


def metrics(drafts: float = 0, draft_tokens: float = 0, accepted: float | None = None) -> str:
    """The capture with its counters grown by these (planted), and the accepted-tokens sample
    the stored text cut (planted: 6.491797e+06 + `accepted`, in the capture's own form)."""
    text = (CAPTURE
            .replace(f"drafts_total{LABELS} 6.491797e+06", f"drafts_total{LABELS} "
                     f"{6491797 + drafts:.7g}")
            .replace(f"draft_tokens_total{LABELS} 6.491797e+06", f"draft_tokens_total{LABELS} "
                     f"{6491797 + draft_tokens:.7g}"))
    if accepted is not None:
        text += f"vllm:spec_decode_num_accepted_tokens_total{LABELS} {4000000 + accepted:.7g}\n"
    return text


def spec_target(url: str, floor: float = 2.5) -> Target:
    return Target(**{**target(url).__dict__, "min_acceptance_length": floor})


def test_the_capture_reads_as_counters_not_created_gauges():
    got = specmetrics.counters(CAPTURE)
    assert got == {specmetrics.DRAFTS: 6491797.0, specmetrics.DRAFT_TOKENS: 6491797.0}
    # two engines (data parallel ranks) are summed; a timestamp and odd labels are read
    two = (metrics(accepted=0) + 'vllm:spec_decode_num_drafts_total{engine="1",model_name="a b}"}'
           " 3.0 1700000000000\n")
    assert specmetrics.counters(two)[specmetrics.DRAFTS] == 6491800.0


def test_a_draft_that_pays_passes_and_one_that_does_not_fails_at_the_floor(server):  # noqa: F811
    fake, url = server
    # planted: 300 drafts of 3 tokens, 960 accepted: 4.2 tokens a pass (the failure log's
    # working draft model)
    fake.metrics = [metrics(accepted=0), metrics(300, 900, 960)]
    run = run_ladder(spec_target(url), SMALL)
    assert run.ok, failure_message(run)
    assert step(run, "speculative").detail == ("acceptance length 4.20: 960 of 900 drafted "
                                               "tokens accepted in 300 drafts (floor 2.5)")
    # planted: 300 drafts, 81 accepted: 1.27, the failure log's quantised MTP head
    fake.metrics = [metrics(accepted=0), metrics(300, 900, 81)]
    run = run_ladder(spec_target(url), SMALL)
    failed = run.failure()
    assert run.failed_step == "speculative" and failed.hint == specmetrics.FLOOR_HINT
    assert failed.expected == ("an acceptance length of 2.5 or more (the recipe's "
                               "speculative.min_acceptance_length)")
    assert failed.got.startswith("acceptance length 1.27: 81 of 900")


def test_no_counters_no_drafts_no_metrics(server):  # noqa: F811
    fake, url = server
    fake.metrics = [CAPTURE, CAPTURE]  # the capture as stored: no accepted-tokens sample
    failed = run_ladder(spec_target(url), SMALL).failure()
    assert failed.got == "no vllm:spec_decode_num_accepted_tokens_total"
    assert failed.hint == specmetrics.NO_METRICS_HINT
    fake.metrics = [metrics(accepted=0), metrics(accepted=0)]  # nothing drafted in between
    failed = run_ladder(spec_target(url), SMALL).failure()
    assert failed.hint == specmetrics.NO_DRAFTS_HINT
    assert failed.got == "6.4918e+06 before, 6.4918e+06 after"
    failed = run_ladder(spec_target(url), SMALL).failure()  # no /metrics route at all
    assert failed.expected == "GET /metrics -> 200" and failed.got.startswith("HTTP 404")


@pytest.mark.parametrize("floor", [1.0, 4.2])
def test_the_floor_is_inclusive(server, floor):  # noqa: F811
    fake, url = server
    fake.metrics = [metrics(accepted=0), metrics(300, 900, 960)]
    assert run_ladder(spec_target(url, floor), SMALL).ok


def test_the_plan_takes_the_floor_from_a_recipe_that_speculates():
    vllm = [{"name": "vllm-0.33", "engine": "vllm", "packages": ["vllm==0.33.0"]}]
    draft = rig(recipe="dual-3090-draft", gpu_count=2, venvs=vllm, verify_prefill_tokens=300,
                verify_url="http://127.0.0.1:18000")
    assert verify_plan(draft, "rigA", "x")[0].min_acceptance_length == 1.5  # the default
    plain = rig(verify_prefill_tokens=300, verify_url="http://127.0.0.1:18000")
    assert verify_plan(plain, "rigA", "x")[0].min_acceptance_length is None
