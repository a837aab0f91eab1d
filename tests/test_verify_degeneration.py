"""The long-generation step's detector on loops people published and on normal text
(tests/fixtures/degeneration/SOURCES.md), and the step against the loopback stub of
tests/test_verify.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from rigbook.roles import degeneration
from rigbook.roles.verify import run_ladder
from tests.test_verify import SMALL, server, step, target  # noqa: F401

FIXTURES = Path(__file__).parent / "fixtures" / "degeneration"
LOOPS = {
    "vllm-13952-repeated-lines.txt": "no line of the essay repeated 3 times",
    "llamacpp-6762-let-me-loop.txt": "lexical variety",
    "qwen3-asr-129-i-think.txt": "lexical variety",
    "sglang-logit-bias-privacy.txt": "lexical variety",
}
NORMAL = ["tt-metal-53077-normal-answers.txt", "sglang-ancient-rome-normal.txt",
          "sglang-separate-reasoning-normal.txt"]


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_published_loops_are_degenerate(name):
    with pytest.raises(degeneration.Degenerate) as found:
        degeneration.check((FIXTURES / name).read_text())
    assert found.value.expected.startswith(LOOPS[name])
    assert found.value.hint == degeneration.HINT


def test_the_evidence_is_the_repeated_line_or_window():
    with pytest.raises(degeneration.Degenerate) as found:
        degeneration.check((FIXTURES / "vllm-13952-repeated-lines.txt").read_text())
    line = "台灣最受歡迎的飲料是奶茶，下圖是台灣各地最受歡迎的奶茶品牌。"
    assert found.value.got == f"{line!r} 3 times"
    with pytest.raises(degeneration.Degenerate) as found:
        degeneration.check((FIXTURES / "llamacpp-6762-let-me-loop.txt").read_text())
    assert found.value.got == ("distinct-1 0.33, repeated 4-grams 0.45 in the least varied "
                               "189-token window at token 0; 'let me let me' 34 times in it")


@pytest.mark.parametrize("name", NORMAL)
def test_normal_answers_pass(name):
    assert "repeated 4-grams" in degeneration.check((FIXTURES / name).read_text())


@pytest.mark.parametrize("doc", ["docs/architecture.md", "docs/sweep.md"])
def test_long_normal_prose_passes_in_every_window(doc):
    text = Path(doc).read_text()
    tokens = degeneration.tokens_of(text)
    assert len(tokens) > 5 * degeneration.WINDOW
    worst = degeneration.variety(tokens)
    assert worst.distinct >= 0.4 and worst.repeated_4grams <= 0.05
    degeneration.check(text)


def test_a_loop_late_in_a_long_text_is_not_averaged_away():
    """rigbook's prose, then a published loop: the loop's window fails, not the average."""
    prose = Path("docs/architecture.md").read_text()
    loop = (FIXTURES / "qwen3-asr-129-i-think.txt").read_text()
    with pytest.raises(degeneration.Degenerate, match="lexical variety"):
        degeneration.check(prose + "\n" + loop.replace("\n", " ") * 4)
    assert degeneration.check("Short answer.") == "the essay: 2 tokens, too short to measure " \
                                                  "variety"


def test_the_step_fails_with_the_evidence_and_the_hint(server):  # noqa: F811
    fake, url = server
    fake.essay = (FIXTURES / "vllm-13952-repeated-lines.txt").read_text()
    run = run_ladder(target(url), SMALL)
    assert run.failed_step == "long-generation"
    failed = run.failure()
    assert failed.expected == "no line of the essay repeated 3 times or more"
    assert "3 times" in failed.got and failed.hint == degeneration.HINT
    fake.essay = Path("docs/architecture.md").read_text()
    run = run_ladder(target(url), SMALL)
    assert run.ok
    detail = step(run, "long-generation").detail
    # the stub's context is 512: the essay's budget is what it leaves
    assert detail.startswith("448 tokens, finish_reason length; the essay: ")
