"""The verify ladder's `thinking` step: a reasoning model's thinking, present and apart from the
answer (docs/verify.md, thinking).

With its reasoning parser (the recipe's `reasoning_parser`) the engine moves the model's
thinking out of the text into `message.reasoning_content` (SGLang, older vLLM) or
`message.reasoning` (vLLM; some releases send both), streamed as `delta.reasoning_content` /
`delta.reasoning`. Without it, or with another family's parser, the thinking and its markup stay
in `content` (clients then show the model's scratchpad as its answer); with a parser that never
sees the end of the thinking, the answer goes into the reasoning and `content` stays empty.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from rigbook.roles.stepproblem import StepProblem
from rigbook.roles.toolcheck import first_choice  # one evidence shape for the steps

PROMPT = "What is 12 + 30? Think it through briefly, then answer with the number."
#: Room for a thinking model's reasoning before the answer.
MAX_TOKENS = 2048
#: The chat-template switches of the parsers' model families (Qwen3 `enable_thinking`,
#: DeepSeek V3.1 `thinking`); a template reads the ones it knows and ignores the others.
THINKING_ON = {"chat_template_kwargs": {"enable_thinking": True, "thinking": True}}

#: Thinking markup of the parsers' families, which a working parser takes out of the content:
#: <think>/</think> (DeepSeek-R1, Qwen3, GLM, MiniMax...), Kimi's ◁think▷, gpt-oss's channels.
MARKUP = re.compile(r"</?think>|◁/?think▷|<\|channel\|>(?:analysis|commentary)")

LEAK_HINT = ("the model's thinking is in content: the reasoning parser is off or of another "
             "family: set the recipe's reasoning_parser to the model family's parser "
             "(docs/verify.md, thinking)")
NONE_HINT = ("no reasoning came back: the model did not think (its chat template's thinking "
             "switch is off, or it is not a reasoning model) or the parser does not match its "
             "markup; check reasoning_parser against the model family")
EMPTY_HINT = ("the answer went into the reasoning and content is empty: the parser never saw "
              "the end of the thinking (another family's parser, or an engine release with "
              "that bug, e.g. vLLM issue 40816): use the family's own parser or another release")
LENGTH_HINT = (f"the thinking did not end within {MAX_TOKENS} tokens: the model thinks without "
               "end on a short question (check the model card's sampling settings)")
SHAPE_HINT = "the engine answered in another shape than the OpenAI chat completion"


def request(model: str, *, stream: bool) -> dict:
    """The chat completion body: the engine's own sampling defaults (the model card's, which
    thinking models ask for), thinking switched on."""
    body = {"model": model, "max_tokens": MAX_TOKENS, "seed": 0,
            "messages": [{"role": "user", "content": PROMPT}], **THINKING_ON}
    return {**body, "stream": True} if stream else body


def reasoning_of(part: dict) -> str:
    """A message's or a delta's reasoning: reasoning_content, else reasoning (vLLM sends both,
    the same text, in some releases: one is read)."""
    for key in ("reasoning_content", "reasoning"):
        if isinstance(part.get(key), str) and part[key]:
            return part[key]
    return ""


def check_parts(reasoning: str, content: str, finish: str | None, *, where: str) -> str:
    """The reasoning and the answer a client read; the step's detail when they pass."""
    leaked = MARKUP.search(content)
    if leaked:
        start = max(leaked.start() - 40, 0)
        raise StepProblem("the thinking apart from the content, no thinking markup in it",
                           f"{leaked.group(0)!r} in content {content[start:start + 200]!r}",
                           LEAK_HINT)
    if not reasoning.strip():
        raise StepProblem(f"the model's reasoning in {where}",
                           f"no reasoning; finish_reason {finish!r}, content {_quote(content)}",
                           NONE_HINT)
    if not content.strip():
        hint = LENGTH_HINT if finish == "length" else EMPTY_HINT
        raise StepProblem("the answer in content after the reasoning",
                           f"content empty, finish_reason {finish!r}, reasoning "
                           f"{_quote(reasoning)} ({len(reasoning)} chars)", hint)
    return (f"{len(reasoning)} chars of reasoning in {where}, answer {_quote(content, 60)}, "
            f"finish_reason {finish}")


def check_answer(data: dict) -> str:
    first = first_choice(data)
    message = first.get("message")
    if not isinstance(message, dict):
        raise StepProblem("an OpenAI chat completion with choices[0].message",
                           str(data)[:300], SHAPE_HINT)
    content = message.get("content") if isinstance(message.get("content"), str) else ""
    return check_parts(reasoning_of(message), content, first.get("finish_reason"),
                       where="message.reasoning_content/reasoning")


def check_stream(chunks: Iterable[dict]) -> str:
    """A streamed answer, its chunks as rigbook.roles.verify.sse_chunks reads them."""
    reasoning, content, finish = [], [], None
    for chunk in chunks:
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            reasoning.append(reasoning_of(delta))
            if isinstance(delta.get("content"), str):
                content.append(delta["content"])
            if isinstance(choice.get("finish_reason"), str):
                finish = choice["finish_reason"]
    return check_parts("".join(reasoning), "".join(content), finish,
                       where="delta.reasoning_content/reasoning")


def _quote(text: str, limit: int = 200) -> str:
    return repr(text[:limit] + ("..." if len(text) > limit else ""))
