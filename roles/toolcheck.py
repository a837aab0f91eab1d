"""The verify ladder's tool-call steps: what to ask and how to read the answer (docs/verify.md).

Agent clients send `tools=[...]` and read `choices[0].message.tool_calls[]` (streamed:
`delta.tool_calls` and `finish_reason` "tool_calls"); they do not read a call written in the
text. The engine turns the model's call markup into that field only with its tool parser
(the recipe's `tool_parser`): without it, or with another model family's parser, the markup is
left in `content`, which is what these checks tell apart from a model that did not call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

from rigbook.roles.stepproblem import StepProblem

#: The one tool asked for (the function of SGLang's and vLLM's tool-calling docs).
TOOL_NAME = "get_current_weather"
TOOL = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. 'San Francisco'"},
                "state": {"type": "string", "description": "The two-letter state code"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "state", "unit"],
        },
    },
}
PROMPT = "What's the weather like in Boston, MA, in celsius? Call the get_current_weather tool."
#: Room for a call (and a thinking model's reasoning before it, with thinking on).
MAX_TOKENS = 512
THINKING_TOKENS = 2048

#: Call markup of the parsers' model families, which a working parser takes out of the text:
#: Hermes/Qwen <tool_call>, Mistral [TOOL_CALLS], Llama 3 <|python_tag|>, Qwen3-Coder's and
#: Llama 3.1's <function=, DeepSeek's <｜tool▁calls▁begin｜>, a call written as JSON by name.
MARKUP = re.compile(
    r"<tool_call>|\[TOOL_CALLS\]|<\|python_tag\|>|<function=|<｜tool▁calls?▁begin｜>"
    rf'|"name"\s*:\s*"{TOOL_NAME}"'
)

LEAK_HINT = ("the engine put the call in content: the tool parser is off or wrong: set the "
             "recipe's tool_parser to the parser of the model's family (docs/verify.md, tools)")
NO_CALL_HINT = ("the model answered in text and called no tool: check that the model and its chat "
                "template support tools (a template without tools never shows them to the model)")
NAME_HINT = "the call names another function: the tool parser does not match the model's format"
ARGS_HINT = ("the call's arguments are not a JSON object: the tool parser does not match the "
             "model's call format; set tool_parser to the model family's own parser")
HTTP_HINT = ("the engine refused a request with tools: vLLM needs --enable-auto-tool-choice "
             "(rendered from tool_parser); read the engine's journal for the reason")
SHAPE_HINT = ("the engine answered a request with tools in another shape than the OpenAI "
              "chat completion (the chat step passed): read the engine's journal for it")
FINISH_HINT = ("the stream did not end with finish_reason tool_calls: clients that wait for it "
               "never run the tool; update the engine or use a parser that streams calls")


def request(model: str, engine: str, *, stream: bool) -> dict:
    """The chat completion body. tool_choice "auto" where the engine's parser reads the answer
    (vLLM and SGLang answer "required" and a named tool by guided decoding, without the parser,
    which would hide a wrong parser); llama-cpp-python's chatml-function-calling constrains a
    named tool by grammar, so even a small model calls it."""
    choice: str | dict = ("auto" if engine != "llama.cpp" else
                          {"type": "function", "function": {"name": TOOL_NAME}})
    body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "seed": 0,
            "messages": [{"role": "user", "content": PROMPT}], "tools": [TOOL],
            "tool_choice": choice}
    return {**body, "stream": True} if stream else body


@dataclass
class Call:
    """One tool call as a client assembles it."""

    name: str | None
    arguments: str


def _markup(content: str) -> str | None:
    """The first call markup in the text and the text around it (None: there is none)."""
    match = MARKUP.search(content)
    if match is None:
        return None
    start = max(match.start() - 40, 0)
    return f"{match.group(0)!r} in content {'...' if start else ''}{content[start:start + 200]!r}"


def check_calls(calls: list[Call], content: str, finish: str | None, *, where: str) -> str:
    """The calls a client read, against the tool asked for; the step's detail when they pass."""
    leaked = _markup(content)
    if not calls:
        if leaked:
            raise StepProblem(f"the call in {where}, not in the text", leaked, LEAK_HINT)
        raise StepProblem(f"a call of {TOOL_NAME} in {where}",
                          f"finish_reason {finish!r}, content {_quote(content)}", NO_CALL_HINT)
    first = calls[0]
    if first.name != TOOL_NAME:
        raise StepProblem(f"{where}[0] to call {TOOL_NAME}", repr(first.name), NAME_HINT)
    try:
        arguments = json.loads(first.arguments)
    except ValueError as error:
        raise StepProblem(f"{where}[0].function.arguments to parse as JSON",
                          f"{first.arguments!r} ({error})", ARGS_HINT) from None
    if not isinstance(arguments, dict):
        raise StepProblem(f"{where}[0].function.arguments to be a JSON object",
                          repr(first.arguments), ARGS_HINT)
    if leaked:
        raise StepProblem(f"no call markup left in the content beside {where}", leaked, LEAK_HINT)
    return (f"{TOOL_NAME}({json.dumps(arguments, sort_keys=True)[:80]}), "
            f"{len(calls)} call(s), finish_reason {finish}")


def first_choice(data: dict) -> dict:
    """choices[0] of a chat completion, or {} when the answer has none to read."""
    choices = data.get("choices")
    return choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) \
        else {}


def check_answer(data: dict) -> str:
    """A non-streamed answer: choices[0].message.tool_calls[] holds the call."""
    first = first_choice(data)
    message = first.get("message") if isinstance(first.get("message"), dict) else None
    if message is None:
        raise StepProblem("an OpenAI chat completion with choices[0].message",
                          json.dumps(data)[:300], SHAPE_HINT)
    calls = []
    for item in _list(message.get("tool_calls")):
        function = item.get("function") if isinstance(item, dict) else None
        if isinstance(function, dict):
            arguments = function.get("arguments")
            calls.append(Call(function.get("name"),
                              arguments if isinstance(arguments, str) else json.dumps(arguments)))
    content = message.get("content")
    return check_calls(calls, content if isinstance(content, str) else "",
                       first.get("finish_reason"),
                       where="choices[0].message.tool_calls")


def check_stream(chunks: Iterable[dict]) -> str:
    """A streamed answer, its chunks as rigbook.roles.verify.sse_chunks reads them: delta.tool_calls
    carry the call (name, then argument fragments, per index) and the last finish_reason is
    "tool_calls"."""
    calls: dict[int, Call] = {}
    content, finish, deltas, thought = [], None, 0, 0
    for chunk in chunks:
        for choice in _list(chunk.get("choices") if isinstance(chunk, dict) else None):
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            if isinstance(delta.get("content"), str):
                content.append(delta["content"])
            thought += any(isinstance(delta.get(k), str) and delta[k]
                           for k in ("reasoning_content", "reasoning"))
            for item in _list(delta.get("tool_calls")):
                function = item.get("function") if isinstance(item, dict) else None
                if not isinstance(function, dict):
                    continue
                deltas += 1
                index = item.get("index") if isinstance(item.get("index"), int) else 0
                call = calls.setdefault(index, Call(None, ""))
                call.name = call.name or function.get("name")
                if isinstance(function.get("arguments"), str):
                    call.arguments += function["arguments"]
            if isinstance(choice.get("finish_reason"), str):
                finish = choice["finish_reason"]
    text = "".join(content)
    detail = check_calls([calls[i] for i in sorted(calls)], text, finish, where="delta.tool_calls")
    if finish != "tool_calls":
        raise StepProblem("the stream to end with finish_reason 'tool_calls'",
                          f"finish_reason {finish!r} after {deltas} tool-call delta(s)",
                          FINISH_HINT)
    return f"{detail}, {deltas} delta(s)" + (f", after {thought} reasoning delta(s)"
                                            if thought else "")


def _list(value: object) -> list:
    return value if isinstance(value, list) else []


def _quote(text: str) -> str:
    return repr(text[:200] + ("..." if len(text) > 200 else ""))
