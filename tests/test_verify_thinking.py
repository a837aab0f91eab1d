"""The thinking step, and thinking in the streamed tool call, against the loopback stub of
tests/test_verify.py answering with the engines' published reasoning answers
(tests/fixtures/thinking/SOURCES.md)."""

from __future__ import annotations

import json

import pytest

from rigbook.roles import thinkcheck
from rigbook.roles.stepproblem import StepProblem
from rigbook.roles.verify import Target, run_ladder, sse_chunks
from tests.test_verify import SMALL, THINKING, fixture, server, step, target  # noqa: F401


def thinking_target(url: str, tools: bool = False) -> Target:
    return Target(**{**target(url).__dict__, "engine": "sglang", "reasoning_parser": "deepseek-r1",
                     "tool_parser": "qwen25" if tools else None})


def test_the_thinking_step_passes_on_sglangs_own_answers(server):  # noqa: F811
    fake, url = server
    run = run_ladder(thinking_target(url), SMALL)
    assert run.ok and not step(run, "thinking").skipped
    detail = step(run, "thinking").detail
    assert detail.startswith("163 chars of reasoning in message.reasoning_content/reasoning, "
                             "answer '**Solution:**")
    assert "; streamed: 183 chars of reasoning in delta.reasoning_content/reasoning" in detail
    plain, streamed = fake.think_bodies
    assert plain["chat_template_kwargs"] == {"enable_thinking": True, "thinking": True}
    assert "temperature" not in plain and streamed["stream"] is True  # the model card's sampling


def test_the_streamed_tool_call_has_thinking_on_where_the_model_thinks(server):  # noqa: F811
    fake, url = server
    run = run_ladder(thinking_target(url, tools=True), SMALL)
    assert run.ok
    plain, streamed = fake.tool_bodies
    assert "chat_template_kwargs" not in plain and plain["max_tokens"] == 512
    assert streamed["chat_template_kwargs"] == thinkcheck.THINKING_ON["chat_template_kwargs"]
    assert streamed["max_tokens"] == 2048  # room for the reasoning before the call


def failure(fake, url, *, answer=None, stream=None):
    if answer is not None:
        fake.think_answer = (200, answer)
    if stream is not None:
        fake.think_stream = stream
    run = run_ladder(thinking_target(url), SMALL)
    assert run.failed_step == "thinking" and run.steps[-1] == run.failure()
    return run.failure()


def test_thinking_left_in_content_is_the_parser_off(server):  # noqa: F811
    fake, url = server
    off = failure(fake, url, answer=fixture("sglang-r1-separate-reasoning-off.json", THINKING))
    assert off.expected == "the thinking apart from the content, no thinking markup in it"
    assert off.got.startswith("'</think>' in content") and off.hint == thinkcheck.LEAK_HINT
    qwen3 = failure(fake, url, answer=fixture("vllm-21130-think-in-content.json", THINKING))
    assert qwen3.got.startswith("'<think>' in content '<think>\\nOkay, the user is asking")


def test_the_answer_streamed_as_reasoning_leaves_content_empty(server):  # noqa: F811
    fake, url = server
    bad = failure(fake, url, stream=fixture("vllm-40816-answer-in-reasoning.sse", THINKING))
    assert bad.expected == "the answer in content after the reasoning"
    assert bad.got == "content empty, finish_reason 'stop', reasoning '12' (2 chars)"
    assert bad.hint == thinkcheck.EMPTY_HINT


def test_no_reasoning_and_a_thinking_cut_short():
    plain = json.loads(fixture("sglang-r1-reasoning.json", THINKING))
    message = plain["choices"][0]["message"]
    message["reasoning_content"] = None  # planted: an engine that returned no reasoning
    with pytest.raises(StepProblem) as problem:
        thinkcheck.check_answer(plain)
    assert problem.value.hint == thinkcheck.NONE_HINT
    assert problem.value.expected == "the model's reasoning in message.reasoning_content/reasoning"
    # planted: the reasoning ran to max_tokens (vLLM's `reasoning` field), no answer yet
    message.update(reasoning="Let me think. " * 3, content=None)
    plain["choices"][0]["finish_reason"] = "length"
    with pytest.raises(StepProblem) as problem:
        thinkcheck.check_answer(plain)
    assert problem.value.hint == thinkcheck.LENGTH_HINT
    # vLLM sends reasoning and reasoning_content alike in some releases: read once
    both = ['data: {"choices":[{"delta":{"reasoning":"ab","reasoning_content":"ab"}}]}',
            'data: {"choices":[{"delta":{"content":"42"},"finish_reason":"stop"}]}',
            "data: [DONE]"]
    assert thinkcheck.check_stream(sse_chunks(both)).startswith("2 chars of reasoning")
    for shape in ({}, {"choices": ["x"]}, {"choices": [{"message": 3}]}):
        with pytest.raises(StepProblem, match="an OpenAI chat completion"):
            thinkcheck.check_answer(shape)
