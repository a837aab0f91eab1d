"""Verify and benchmark a serving rig from the operator's machine, over the rig's API address.

A ladder of checks, stopped at the first failure with its evidence (what was expected, what came
back, and a hint of what to do): `health` (/health when the engine has it, then /v1/models lists
the recipe's served name), `chat` (one short chat completion with an OpenAI answer shape),
`tools` and `tools-stream` (when the recipe has a tool_parser: one tool called, its name and JSON
arguments in tool_calls and no call markup in the text; streamed, delta.tool_calls and
finish_reason "tool_calls", with thinking on where the model thinks; rigbook.roles.toolcheck),
`thinking` (when the recipe has a reasoning_parser: the reasoning present and apart from the
answer, plain and streamed; rigbook.roles.thinkcheck), `long-generation` (a ~2K-token essay
without a repeated-line cascade and with lexical variety; rigbook.roles.degeneration),
`prefill` (a prompt of verify_prefill_tokens completes), `needle` (a random fact at each depth
of a haystack that fills verify_needle_fill of the context is asked back, exact match when
verify_needle_exact; and a prompt beyond the context must be REJECTED with the engine's context
error), `speculative` (when the recipe speculates: the engine's /metrics counters before and
after a short generation give the acceptance length, 1 + accepted / drafts, against the recipe's
speculative.min_acceptance_length; rigbook.roles.specmetrics) and `bench` (a
fixed narrative and a fixed code prompt, streamed: time to first token and decode tokens/s,
median and range, single stream and at verify_bench_concurrency). A step that does not apply
to the recipe is stored as skipped, with the reason.

That is the `quick` level (host data verify_level, the default). `stress` runs health and chat,
then `stress-needles` (a salted needle in the middle of a prompt of each verify_stress_needles
size the context holds) and `ceiling` (prompts from verify_ceiling_start up to 0.92 of the
context, free VRAM read on the rig after each, the first failing rung reported as the real
ceiling; rigbook.roles.stress). `soak` runs health and chat, then `soak` (sessions of
verify_soak_turns turns whose context ramps, bounded by verify_soak_requests and
verify_soak_seconds: empty replies, errors, VRAM growth, tok/s retention; rigbook.roles.soak).
The bench's figures keep their values, mean, spread and coefficient of variation (intervals:
rigbook.core.stats), and every run its configuration's fingerprint.

Prompt sizes are in tokens of the served model: the ladder calibrates words -> tokens with two
small requests (the usage the engine reports), so no tokenizer is needed here.

Every run is stored as JSON (`VerifyRun`) under results_dir()/<rig>/<recipe>/<driver>/<cap>/,
history kept, every level beside the others; `rigbook bench compare` tables them (and draws a
PNG), `--ab A B` compares two (rigbook.roles.benchab). docs/verify.md.
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import requests
from pydantic import ValidationError
from pyinfra import host, logger
from pyinfra.api import FunctionCommand, StringCommand, deploy, operation

from rigbook.core import stats
from rigbook.core.errors import RigbookError
from rigbook.core.types import StrictModel
from rigbook.roles import degeneration, soak, specmetrics, stress, thinkcheck, toolcheck
from rigbook.roles.soak import Soak
from rigbook.roles.stepproblem import StepProblem
from rigbook.roles.stress import Ceiling, Rung

#: How an engine says a prompt is longer than its context (llama-cpp-python, vLLM, SGLang).
CONTEXT_ERROR = re.compile(
    r"maximum context length|context window|context length|maximum model length", re.I
)
#: Room left for the answer and the question around a haystack (tokens).
ANSWER_TOKENS = 16
#: Characters of an unexpected answer kept in a failure.
EVIDENCE_CHARS = 300

NARRATIVE_PROMPT = (
    "Write a short story about a lighthouse keeper who finds an old radio that receives "
    "messages from the future. Describe the sea, the weather and the keeper's daily routine."
)
CODE_PROMPT = (
    "Write a Python function that reads a CSV file of GPU power readings (timestamp, gpu "
    "index, watts) and returns the mean and peak watts per GPU, with type hints and a docstring."
)
BENCH_PROMPTS = {"narrative": NARRATIVE_PROMPT, "code": CODE_PROMPT}
Level = Literal["quick", "stress", "soak"]
HAYSTACK = (
    "The rig hums in the corner of the workshop while the fans turn slowly and the night "
    "goes on outside. A kettle boils, the clock ticks, and the model answers every question "
    "that the operator sends across the network from the other room. "
).split()


# --- what to verify ------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """The ladder's knobs (host data verify_*)."""

    prefill_tokens: int = 15000
    needle_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    needle_fill: float = 0.9
    needle_exact: bool = True
    context_len: int | None = None
    bench_warmups: int = 2
    bench_runs: int = 5
    bench_tokens: int = 256
    bench_concurrency: int = 4
    timeout_s: float = 300
    #: quick: the ladder; stress: salted needles and the context ceiling; soak: minutes of turns
    level: Level = "quick"
    stress_needles: tuple[int, ...] = stress.NEEDLE_TOKENS
    ceiling_start: int = stress.CEILING_START
    ceiling_rungs: int = 5
    soak_seconds: int = 600
    soak_requests: int = 200
    soak_turns: int = 8
    soak_context_tokens: int = 25000
    soak_min_retention: float = 0.8


@dataclass(frozen=True)
class Target:
    """One rig's running recipe as the operator's machine reaches it."""

    rig: str
    recipe: str
    engine: str
    served_name: str
    max_model_len: int
    url: str
    key: str | None = field(default=None, repr=False)
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    #: The recipe speculates: the acceptance length its draft must reach (None: it does not).
    min_acceptance_length: float | None = None
    venv: str | None = None
    #: sha256 of the recipe as validated (12 hex): an edited recipe is another configuration.
    recipe_hash: str | None = None


class StepFailed(Exception):
    """A ladder step failed: which step, what was expected, what came back, what to do."""

    def __init__(self, step: str, expected: str, got: str, hint: str = "") -> None:
        super().__init__(f"{step}: expected {expected}; got {got}")
        self.step, self.expected, self.got, self.hint = step, expected, truncate(got), hint


def truncate(text: str, limit: int = EVIDENCE_CHARS) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


# --- results ---------------------------------------------------------------------------------


class Stat(StrictModel):
    """A measurement over runs: median and range, mean with its 95 % interval (runs in order,
    their autocorrelation counted: rigbook.core.stats), spread and coefficient of variation.
    Runs stored before the bench kept its values have the median and range only."""

    median: float
    min: float
    max: float
    mean: float | None = None
    sd: float | None = None
    cv: float | None = None
    half_width: float | None = None
    values: tuple[float, ...] = ()

    @classmethod
    def of(cls, values: list[float]) -> Stat:
        found = stats.estimate(values, 1.0)
        finite = found.half_width if found.half_width != float("inf") else None
        return cls(median=statistics.median(values), min=min(values), max=max(values),
                   mean=found.mean, sd=found.sd,
                   cv=found.sd / found.mean if found.mean else None, half_width=finite,
                   values=tuple(values))

    def estimate(self) -> stats.Estimate | None:
        """The stored values' estimate (None: a run stored without them)."""
        return stats.estimate(self.values, 1.0) if self.values else None

    def text(self, digits: int = 1) -> str:
        cv = f" cv {self.cv:.0%}" if self.cv is not None else ""
        return f"{self.median:.{digits}f} [{self.min:.{digits}f}-{self.max:.{digits}f}]{cv}"


class Step(StrictModel):
    name: Literal["health", "chat", "tools", "tools-stream", "thinking", "long-generation",
                  "prefill", "needle", "speculative", "bench", "stress-needles", "ceiling",
                  "soak"]
    ok: bool
    skipped: bool = False
    seconds: float
    detail: str = ""
    expected: str | None = None
    got: str | None = None
    hint: str | None = None
    warnings: tuple[str, ...] = ()


class BenchFigures(StrictModel):
    """One prompt at one concurrency: per stream TTFT and decode tok/s, and all streams' sum."""

    prompt: Literal["narrative", "code"]
    concurrency: int
    runs: int
    tokens: int
    ttft_s: Stat
    decode_tps: Stat
    aggregate_tps: Stat
    #: tokens / (last token - request sent): what a user waits for, TTFT included
    wall_tps: Stat | None = None


class Fingerprint(StrictModel):
    """What a run measured: two runs with equal fingerprints measured the same configuration
    (`rigbook bench compare --ab` lists the fields that differ)."""

    recipe: str
    recipe_hash: str | None
    engine: str
    engine_build: str | None  # the venv's live build (its spec hash and build time)
    engine_version: str | None  # the engine package's version in that build
    driver: str | None
    caps_w: tuple[float, ...]


class VerifyRun(StrictModel):
    """One verify run of one rig, stored as JSON on the operator's machine."""

    schema_version: Literal[1] = 1
    rig: str
    recipe: str
    engine: str
    served_model: str
    url: str
    driver: str | None
    caps_w: tuple[float, ...]
    started: datetime
    seconds: float
    ok: bool
    failed_step: str | None = None
    steps: tuple[Step, ...]
    bench: tuple[BenchFigures, ...] = ()
    settings: dict[str, object]
    level: Level = "quick"
    fingerprint: Fingerprint | None = None
    ceiling: Ceiling | None = None
    soak: Soak | None = None

    @property
    def cap_label(self) -> str:
        return "/".join(f"{w:g}" for w in self.caps_w) if self.caps_w else "none"

    def failure(self) -> Step | None:
        return next((s for s in self.steps if not s.ok), None)


def results_dir() -> Path:
    """RIGBOOK_VERIFY_DIR, else ~/.local/share/rigbook/verify."""
    env = os.environ.get("RIGBOOK_VERIFY_DIR")
    return Path(env) if env else Path.home() / ".local" / "share" / "rigbook" / "verify"


def _part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text) or "_"


def run_path(run: VerifyRun, root: Path | None = None) -> Path:
    """<root>/<rig>/<recipe>/driver-<version>/cap-<watts>/<started>.json (history kept)."""
    stamp = run.started.strftime("%Y%m%dT%H%M%S.%fZ")
    return ((root or results_dir()) / _part(run.rig) / _part(run.recipe)
            / f"driver-{_part(run.driver or 'none')}" / f"cap-{_part(run.cap_label)}"
            / f"{stamp}.json")


def save_run(run: VerifyRun, root: Path | None = None) -> Path:
    path = run_path(run, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run.model_dump_json(indent=2) + "\n")
    return path


def load_runs(root: Path | None = None) -> list[VerifyRun]:
    """Every stored run, oldest first; a file that does not validate is an error naming it."""
    runs = []
    for path in sorted((root or results_dir()).glob("*/*/*/*/*.json")):
        try:
            runs.append(VerifyRun.model_validate_json(path.read_text()))
        except (OSError, ValidationError) as error:
            raise RigbookError(f"{path}: not a verify result: {truncate(str(error))}") from None
    return sorted(runs, key=lambda r: r.started)


# --- the client --------------------------------------------------------------------------------


class Client:
    """The rig's OpenAI-compatible API with bounded timeouts."""

    def __init__(self, target: Target, timeout_s: float) -> None:
        self.target, self.timeout = target, timeout_s
        self.session = requests.Session()
        if target.key:
            self.session.headers["Authorization"] = f"Bearer {target.key}"

    def get(self, path: str) -> requests.Response:
        return self.session.get(self.target.url + path, timeout=(10, 30))

    def post(self, path: str, body: dict, *, stream: bool = False) -> requests.Response:
        return self.session.post(self.target.url + path, json=body, stream=stream,
                                 timeout=(10, self.timeout))

    def chat(self, content: str, max_tokens: int, **extra) -> requests.Response:
        body = {"model": self.target.served_name, "max_tokens": max_tokens, "temperature": 0,
                "seed": 0, "messages": [{"role": "user", "content": content}], **extra}
        return self.post("/v1/chat/completions", body, stream=bool(extra.get("stream")))


def _json(response: requests.Response) -> dict:
    try:
        data = response.json()
    except ValueError:
        data = None
    return data if isinstance(data, dict) else {}


def _said(response: requests.Response) -> str:
    return f"HTTP {response.status_code}: {response.text}"


def answer_shape_problem(data: dict) -> str | None:
    """Why a chat completion body is not an OpenAI answer (None: it is)."""
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        return "no choices"
    first = choices[0] if isinstance(choices[0], dict) else {}
    message = first.get("message")
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return "choices[0].message is not an assistant message"
    if not isinstance(message.get("content"), str):
        return "choices[0].message.content is not text"
    if not isinstance(first.get("finish_reason"), str):
        return "choices[0].finish_reason is missing"
    usage = data.get("usage")
    if not isinstance(usage, dict) or not all(
        isinstance(usage.get(k), int) for k in ("prompt_tokens", "completion_tokens")
    ):
        return "usage.prompt_tokens / usage.completion_tokens are missing"
    if usage["prompt_tokens"] < 1:
        return "usage.prompt_tokens is 0"
    return None


# --- prompts of a size ------------------------------------------------------------------


def haystack_words(count: int, needle: str | None = None, depth: float = 0.5) -> str:
    """`count` words of filler, with `needle` (a sentence) at `depth` (0 start, 1 end)."""
    words = [HAYSTACK[i % len(HAYSTACK)] for i in range(max(count, 0))]
    if needle is not None:
        words.insert(round(depth * len(words)), needle)
    return " ".join(words)


@dataclass(frozen=True)
class Sizer:
    """prompt tokens = base + per_word x words, fitted from two requests to the engine."""

    base: float
    per_word: float

    def words(self, tokens: int) -> int:
        return max(int((tokens - self.base) / self.per_word), 1)


def calibrate(client: Client) -> Sizer:
    counts, tokens = (8, 32), []
    for count in counts:
        response = client.chat(haystack_words(count), max_tokens=1)
        usage = _json(response).get("usage") or {}
        if response.status_code != 200 or not isinstance(usage.get("prompt_tokens"), int):
            raise StepFailed("prefill", f"usage.prompt_tokens for a {count}-word prompt",
                             _said(response))
        tokens.append(usage["prompt_tokens"])
    per_word = max((tokens[1] - tokens[0]) / (counts[1] - counts[0]), 0.1)
    return Sizer(base=tokens[0] - per_word * counts[0], per_word=per_word)


# --- streaming arithmetic -----------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One streamed answer: time to first token, tokens, decode rate after the first token."""

    started: float
    first: float
    last: float
    tokens: int

    @property
    def ttft_s(self) -> float:
        return self.first - self.started

    @property
    def decode_tps(self) -> float:
        span = self.last - self.first
        return (self.tokens - 1) / span if self.tokens > 1 and span > 0 else 0.0


def sample_of(started: float, events: list[tuple[float, str]], usage_tokens: int | None) -> Sample:
    """From the content chunks' arrival times; the engine's usage count wins over chunk counts."""
    if not events:
        raise ValueError("the stream carried no content")
    tokens = usage_tokens if usage_tokens else len(events)
    return Sample(started=started, first=events[0][0], last=events[-1][0], tokens=tokens)


def sse_chunks(lines: Iterable[bytes | str], head: list[str] | None = None) -> Iterator[dict]:
    """The JSON chunks of an SSE chat stream, up to `data: [DONE]`; ValueError (naming it) for a
    chunk that is not JSON. Its first three lines go to `head`, for a message about it."""
    for raw in lines:
        line = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        if head is not None and len(head) < 3:
            head.append(line)
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        try:
            yield json.loads(payload)
        except ValueError as error:
            raise ValueError(f"{payload[:200]!r} ({error})") from None


def read_stream(response: requests.Response, clock: Callable[[], float] = time.monotonic,
                ) -> tuple[list[tuple[float, str]], int | None]:
    """(arrival time, text) of each content chunk of an SSE chat stream, and usage tokens.

    A chunk whose content is "" still carries a token (llama.cpp holds back the bytes of an
    unfinished UTF-8 character); a role-only or finish chunk carries none.
    """
    events, usage, head = [], None, []
    for chunk in sse_chunks(response.iter_lines(), head):
        for choice in chunk.get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if isinstance(text, str):
                events.append((clock(), text))
        if isinstance(chunk.get("usage"), dict):
            usage = chunk["usage"].get("completion_tokens") or usage
    if not events:
        raise ValueError(f"no content chunks in the stream, which began: {' | '.join(head)}")
    return events, usage


def stream_once(client: Client, prompt: str, tokens: int) -> Sample:
    started = time.monotonic()
    return sample_of(started, *stream_events(client, prompt, tokens))


def stream_events(client: Client, prompt: str, tokens: int,
                  clock: Callable[[], float] = time.monotonic,
                  ) -> tuple[list[tuple[float, str]], int | None]:
    """One streamed answer of `tokens` tokens: its chunks' arrival times (`clock`) and the
    engine's usage count (the power sweep reads them on the wall clock)."""
    extra: dict = {"stream": True, "stream_options": {"include_usage": True}}
    # a fixed answer length: min_tokens (vLLM, llama-cpp-python) or ignore_eos (SGLang)
    extra.update({"ignore_eos": True} if client.target.engine == "sglang" else
                 {"min_tokens": tokens})
    with client.chat(prompt, max_tokens=tokens, **extra) as response:
        if response.status_code != 200:
            raise StepFailed("bench", "HTTP 200 and a token stream", _said(response))
        try:
            return read_stream(response, clock)
        except ValueError as error:
            raise StepFailed("bench", "a stream of tokens", str(error)) from None


def figures(prompt: str, concurrency: int, runs: list[list[Sample]]) -> BenchFigures:
    """Median and range over the measured runs; aggregate = all streams' tokens / wall time."""
    streams = [s for run in runs for s in run]
    aggregate = [
        sum(s.tokens for s in run) / max(max(s.last for s in run) - min(s.started for s in run),
                                         1e-9)
        for run in runs
    ]
    return BenchFigures(
        prompt=prompt, concurrency=concurrency, runs=len(runs),
        tokens=int(statistics.median(s.tokens for s in streams)),
        ttft_s=Stat.of([s.ttft_s for s in streams]),
        decode_tps=Stat.of([s.decode_tps for s in streams]),
        aggregate_tps=Stat.of(aggregate),
        wall_tps=Stat.of([s.tokens / max(s.last - s.started, 1e-9) for s in streams]),
    )


# --- the ladder ----------------------------------------------------------------------------------


class Ladder:
    """The steps, in order, against one target."""

    def __init__(self, target: Target, settings: Settings,
                 vram: Callable[[], tuple[int, ...] | None] = lambda: None) -> None:
        self.target, self.settings, self.vram = target, settings, vram
        self.client = Client(target, settings.timeout_s)
        self.context = settings.context_len or target.max_model_len
        self.bench: list[BenchFigures] = []
        self.ceiling: Ceiling | None = None
        self.soak: Soak | None = None
        self.warnings: list[str] = []  # the running step's, taken by run_ladder
        self._sizer: Sizer | None = None

    @property
    def sizer(self) -> Sizer:
        if self._sizer is None:
            self._sizer = calibrate(self.client)
        return self._sizer

    def health(self) -> str:
        try:
            health = self.client.get("/health")
        except requests.RequestException as error:
            raise StepFailed("health", f"an answer from {self.target.url}", repr(error)) from None
        if health.status_code not in (200, 404):  # 404: the engine has no /health route
            raise StepFailed("health", "GET /health -> 200", _said(health))
        models = self.client.get("/v1/models")
        ids = [m.get("id") for m in _json(models).get("data") or [] if isinstance(m, dict)]
        if models.status_code != 200:
            raise StepFailed("health", "GET /v1/models -> 200", _said(models))
        if self.target.served_name not in ids:
            raise StepFailed("health", f"/v1/models to list {self.target.served_name!r}",
                             f"{ids!r}")
        return f"/health {health.status_code}, /v1/models lists {self.target.served_name}"

    def chat(self) -> str:
        response = self.client.chat("Reply with the single word OK.", max_tokens=16)
        data = _json(response)
        problem = "not HTTP 200" if response.status_code != 200 else answer_shape_problem(data)
        if problem:
            raise StepFailed("chat", f"an OpenAI chat completion ({problem})", _said(response))
        content = data["choices"][0]["message"]["content"]
        return f"answered {truncate(content, 60)!r} ({data['usage']['completion_tokens']} tokens)"

    def _tool_request(self, step: str, stream: bool) -> requests.Response:
        body = toolcheck.request(self.target.served_name, self.target.engine, stream=stream)
        if stream and self.target.reasoning_parser is not None:
            # thinking on, as agent clients stream a call from a reasoning model: the parser
            # must end the reasoning before the call
            body.update(thinkcheck.THINKING_ON, max_tokens=toolcheck.THINKING_TOKENS)
        response = self.client.post("/v1/chat/completions", body, stream=stream)
        if response.status_code != 200:
            raise StepFailed(step, "HTTP 200 to a chat completion with a tool", _said(response),
                             toolcheck.HTTP_HINT)
        return response

    def tools(self) -> str:
        try:
            return toolcheck.check_answer(_json(self._tool_request("tools", False)))
        except StepProblem as problem:
            raise StepFailed("tools", problem.expected, problem.got, problem.hint) from None

    def tools_stream(self) -> str:
        with self._tool_request("tools-stream", True) as response:
            try:
                return toolcheck.check_stream(sse_chunks(response.iter_lines()))
            except StepProblem as problem:
                raise StepFailed("tools-stream", problem.expected, problem.got,
                                 problem.hint) from None
            except ValueError as error:  # a chunk that is not JSON
                raise StepFailed("tools-stream", "a stream of JSON chunks", str(error),
                                 toolcheck.SHAPE_HINT) from None

    def _thinking_request(self, stream: bool) -> requests.Response:
        body = thinkcheck.request(self.target.served_name, stream=stream)
        response = self.client.post("/v1/chat/completions", body, stream=stream)
        if response.status_code != 200:
            raise StepFailed("thinking", "HTTP 200 to a chat completion with thinking on",
                             _said(response), thinkcheck.SHAPE_HINT)
        return response

    def thinking(self) -> str:
        """The reasoning apart from the answer, in the message and in the streamed deltas."""
        try:
            plain = thinkcheck.check_answer(_json(self._thinking_request(False)))
            with self._thinking_request(True) as response:
                streamed = thinkcheck.check_stream(sse_chunks(response.iter_lines()))
        except StepProblem as problem:
            raise StepFailed("thinking", problem.expected, problem.got, problem.hint) from None
        except ValueError as error:  # a chunk that is not JSON
            raise StepFailed("thinking", "a stream of JSON chunks", str(error),
                             thinkcheck.SHAPE_HINT) from None
        return f"{plain}; streamed: {streamed}"

    def long_generation(self) -> str:
        """An essay of up to ESSAY_TOKENS (what the context leaves), at the engine's own
        sampling defaults (the model card's, which a client that sets none gets): its content
        and any reasoning checked for a repetition loop."""
        tokens = min(degeneration.ESSAY_TOKENS, self.context - 4 * ANSWER_TOKENS)
        body = {"model": self.target.served_name, "max_tokens": tokens, "seed": 0,
                "messages": [{"role": "user", "content": degeneration.ESSAY_PROMPT}]}
        response = self.client.post("/v1/chat/completions", body)
        data = _json(response)
        if response.status_code != 200 or answer_shape_problem(data):
            raise StepFailed("long-generation", f"a {tokens}-token essay", _said(response))
        message = data["choices"][0]["message"]
        notes = [f"{data['usage']['completion_tokens']} tokens, finish_reason "
                 f"{data['choices'][0]['finish_reason']}"]
        try:
            reasoning = thinkcheck.reasoning_of(message)
            if reasoning:
                notes.append(degeneration.check(reasoning, "the reasoning"))
            notes.append(degeneration.check(message["content"]))
        except degeneration.Degenerate as found:
            raise StepFailed("long-generation", found.expected, found.got, found.hint) from None
        return "; ".join(notes)

    def prefill_once(self) -> tuple[int, float]:
        """(prompt tokens the engine counted, seconds) of one ~prefill_tokens prompt."""
        want = self.settings.prefill_tokens
        started = time.monotonic()
        response = self.client.chat(haystack_words(self.sizer.words(want)), max_tokens=1)
        data = _json(response)
        if response.status_code != 200 or answer_shape_problem(data):
            raise StepFailed("prefill", f"a ~{want}-token prompt to complete", _said(response))
        return data["usage"]["prompt_tokens"], time.monotonic() - started

    def prefill(self) -> str:
        got, took = self.prefill_once()
        return f"{got} prompt tokens in {took:.2f} s ({got / took:.0f} tok/s prefill)"

    def _haystack_request(self, tokens: int, needle: str | None, depth: float,
                          question: str, salt: str = "", step: str = "needle",
                          ) -> requests.Response:
        """A haystack of about `tokens` prompt tokens in all (with a needle, the needle, the
        question and the salt are measured and counted). A salt at its very start: a salted
        prompt shares no cached prefix with another."""
        fixed = 0.0
        lead = f"{salt} " if salt else ""
        if needle is not None:  # measure what the needle and the question add on their own
            alone = self.client.chat(f"{lead}{needle}\n\n{question}", max_tokens=1)
            usage = _json(alone).get("usage") or {}
            if alone.status_code != 200 or not isinstance(usage.get("prompt_tokens"), int):
                raise StepFailed(step, "usage.prompt_tokens of the bare question",
                                 _said(alone))
            fixed = usage["prompt_tokens"] - self.sizer.base
        text = haystack_words(self.sizer.words(int(tokens - fixed)), needle, depth)
        return self.client.chat(f"{lead}{text}\n\n{question}", max_tokens=ANSWER_TOKENS)

    def _needle_probe(self, step: str, tokens: int, depth: float, salt: str = "",
                      stressed: bool = False) -> int:
        """One needle at `depth` of a ~`tokens`-token prompt, asked back; the prompt tokens the
        engine counted. `stressed`: a failure says what a long prompt's failure means."""
        code = str(random.Random().randrange(1_000_000, 10_000_000))
        response = self._haystack_request(
            tokens, f"The secret number of the rig is {code}.", depth,
            "What is the secret number of the rig? Answer with the number only.", salt, step)
        data = _json(response)
        where = f"the needle at depth {depth:g} of a ~{tokens}-token context"
        if response.status_code != 200 or answer_shape_problem(data):
            refused = "" if not stressed else (
                stress.CONTEXT_HINT if CONTEXT_ERROR.search(response.text) else stress.OOM_HINT)
            raise StepFailed(step, f"{where} to be accepted and answered "
                                   f"(context {self.context})", _said(response), refused)
        answer = data["choices"][0]["message"]["content"]
        if self.settings.needle_exact and not re.search(rf"\b{code}\b", answer):
            raise StepFailed(step, f"{where} answered with {code}", repr(answer),
                             stress.NEEDLE_HINT if stressed else "")
        return data["usage"]["prompt_tokens"]

    def needle(self) -> str:
        fill = int(self.settings.needle_fill * self.context) - 2 * ANSWER_TOKENS
        notes = []
        for depth in self.settings.needle_depths:
            counted = self._needle_probe("needle", fill, depth)
            notes.append(f"{depth:g}: {counted} tok "
                         + ("recalled" if self.settings.needle_exact else "accepted"))
        beyond = int(self.context * 1.25)
        response = self._haystack_request(beyond, None, 0, "Say OK.")
        message = response.text
        if response.status_code < 400 or not CONTEXT_ERROR.search(message):
            raise StepFailed("needle", f"a ~{beyond}-token prompt (beyond the {self.context}-token"
                                       " context) rejected with a context-length error",
                             _said(response))
        notes.append(f"{beyond} tok rejected (HTTP {response.status_code})")
        return "; ".join(notes)

    def _metrics(self) -> str:
        response = self.client.get("/metrics")
        if response.status_code != 200:
            raise StepFailed("speculative", "GET /metrics -> 200", _said(response),
                             specmetrics.NO_METRICS_HINT)
        return response.text

    def speculative(self) -> str:
        """The acceptance over one greedy narrative of bench_tokens, from the counters' growth
        (other traffic on the engine in that window counts too)."""
        floor = self.target.min_acceptance_length
        before = self._metrics()
        response = self.client.chat(NARRATIVE_PROMPT, max_tokens=self.settings.bench_tokens)
        if response.status_code != 200:
            raise StepFailed("speculative", "HTTP 200 to a chat completion", _said(response))
        try:
            grown = specmetrics.acceptance(before, self._metrics())
        except StepProblem as problem:
            raise StepFailed("speculative", problem.expected, problem.got, problem.hint) from None
        if grown.length < floor:
            raise StepFailed("speculative", f"an acceptance length of {floor:g} or more (the "
                             "recipe's speculative.min_acceptance_length)", grown.text(),
                             specmetrics.FLOOR_HINT)
        return f"{grown.text()} (floor {floor:g})"

    def stress_sizes(self) -> tuple[list[int], list[int]]:
        return stress.needle_sizes(self.context, self.settings.stress_needles, 4 * ANSWER_TOKENS)

    def stress_needles(self) -> str:
        """A salted needle in the middle of a prompt of each size that fits the context."""
        fits, skipped = self.stress_sizes()
        notes = []
        for size in fits:
            begun = time.monotonic()
            counted = self._needle_probe("stress-needles", size, 0.5, secrets.token_hex(8),
                                         stressed=True)
            notes.append(f"{size}: {counted} tok "
                         + ("recalled" if self.settings.needle_exact else "accepted")
                         + f" in {time.monotonic() - begun:.1f} s")
        if skipped:
            notes.append(f"{', '.join(map(str, skipped))} skipped (beyond the "
                         f"{self.context}-token context)")
        return "; ".join(notes)

    def _rung(self, size: int) -> Rung:
        """One rung of the ceiling ladder: a salted prompt of ~size tokens, then free VRAM."""
        begun, counted, error, oom = time.monotonic(), None, None, False
        try:
            response = self._haystack_request(size, None, 0, "Say OK.", secrets.token_hex(8),
                                              "ceiling")
            data = _json(response)
            if response.status_code == 200 and not answer_shape_problem(data):
                counted = data["usage"]["prompt_tokens"]
            else:
                error = truncate(_said(response))
                oom = not CONTEXT_ERROR.search(response.text)
        except requests.RequestException as failed:  # a crash, a hang past verify_timeout_s
            error, oom = truncate(repr(failed)), True
        return Rung(tokens=size, prompt_tokens=counted, seconds=round(time.monotonic() - begun, 3),
                    free_mib=self.vram(), error=error, oom=oom)

    def ceiling_(self) -> str:
        """Prompts from ceiling_start to 0.92 of the context, stopped at the first failure."""
        s = self.settings
        before, done = self.vram(), []
        for size in stress.rungs(self.context, s.ceiling_start, s.ceiling_rungs):
            done.append(self._rung(size))
            if done[-1].error is not None:
                break
        self.ceiling = Ceiling(context=self.context, free_before_mib=before, rungs=tuple(done))
        self.warnings += stress.margin_warnings(self.ceiling)
        try:
            return stress.verdict(self.ceiling)
        except StepProblem as problem:
            raise StepFailed("ceiling", problem.expected, problem.got, problem.hint) from None

    def _soak_turn(self, messages: list[dict], session: int, turn: int,
                   at_s: float) -> tuple[soak.Turn, str]:
        """One streamed turn of a conversation: what it gave back, and its answer's text."""
        body = {"model": self.target.served_name, "max_tokens": self.settings.bench_tokens,
                "temperature": 0, "seed": 0, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}}
        place = {"session": session, "turn": turn, "at_s": round(at_s, 3)}
        events, usage, started = [], {}, time.monotonic()
        try:
            with self.client.post("/v1/chat/completions", body, stream=True) as response:
                if response.status_code != 200:
                    return soak.Turn(**place, error=truncate(_said(response))), ""
                for chunk in sse_chunks(response.iter_lines()):
                    for choice in chunk.get("choices") or []:
                        delta = choice.get("delta") if isinstance(choice, dict) else None
                        delta = delta if isinstance(delta, dict) else {}
                        text = delta.get("content")
                        said = (text if isinstance(text, str) else "") + (
                            thinkcheck.reasoning_of(delta))
                        if said:
                            events.append((time.monotonic(), said, isinstance(text, str)))
                    if isinstance(chunk.get("usage"), dict):
                        usage = chunk["usage"]
        except (requests.RequestException, ValueError) as error:
            return soak.Turn(**place, error=truncate(repr(error))), ""
        counted = usage.get("prompt_tokens") if isinstance(usage.get("prompt_tokens"), int) \
            else None
        if not "".join(text for _, text, _ in events).strip():  # silent: nothing to show
            return soak.Turn(**place, prompt_tokens=counted, empty=True), ""
        tokens = usage.get("completion_tokens")
        sample = sample_of(started, [(t, x) for t, x, _ in events],
                           tokens if isinstance(tokens, int) else None)
        answer = "".join(text for _, text, content in events if content)
        return soak.Turn(**place, prompt_tokens=counted, tokens=sample.tokens,
                         decode_tps=round(sample.decode_tps, 3)), answer

    def _turn_tokens(self) -> int:
        """Prompt tokens a soak turn's wrapper and question add, measured on the engine."""
        response = self.client.chat(f"Notes, part 1: \n\n{soak.QUESTION}", max_tokens=1)
        usage = _json(response).get("usage") or {}
        if response.status_code != 200 or not isinstance(usage.get("prompt_tokens"), int):
            raise StepFailed("soak", "usage.prompt_tokens of the bare question", _said(response))
        return max(round(usage["prompt_tokens"] - self.sizer.base), 1)

    def soak_(self) -> str:
        """Sessions of soak_turns turns, each adding notes so the context ramps to
        soak_context_tokens, until soak_requests or soak_seconds (checked between requests)."""
        s = self.settings
        target = min(s.soak_context_tokens, int(0.9 * self.context))
        # what a turn adds besides its notes: its question, measured, and the answer before
        # it, at twice its tokens (a text that is tokenized again may take more)
        fixed = self._turn_tokens() + 2 * s.bench_tokens
        chunk = soak.chunk_tokens(target, s.soak_turns, fixed)
        words = self.sizer.words(chunk)
        began = time.monotonic()
        free_start, turns, session = self.vram(), [], 0

        def more() -> bool:
            return (len(turns) < s.soak_requests and time.monotonic() - began < s.soak_seconds
                    and not (turns and turns[-1].error))

        while more():
            salt, messages = secrets.token_hex(8), []
            for turn in range(s.soak_turns):
                # never a turn the context cannot hold (the estimate, not the engine, ends it)
                if not more() or self.sizer.base + (turn + 1) * (chunk + fixed) \
                        + s.bench_tokens > self.context:
                    break
                lead = f"Session {salt}. " if turn == 0 else ""
                messages.append({"role": "user", "content": f"{lead}Notes, part {turn + 1}: "
                                 f"{haystack_words(words)}\n\n{soak.QUESTION}"})
                result, answer = self._soak_turn(messages, session, turn,
                                                 time.monotonic() - began)
                turns.append(result)
                messages.append({"role": "assistant", "content": answer})
            session += 1
        self.soak = Soak(seconds=round(time.monotonic() - began, 3), limit_s=s.soak_seconds,
                         limit_requests=s.soak_requests, turns_per_session=s.soak_turns,
                         target_tokens=target, free_start_mib=free_start,
                         free_end_mib=self.vram(), turns=tuple(turns))
        try:
            detail, warnings = soak.verdict(self.soak, s.soak_min_retention)
        except StepProblem as problem:
            raise StepFailed("soak", problem.expected, problem.got, problem.hint) from None
        self.warnings += warnings
        return detail

    def levels(self) -> tuple[list[int], str]:
        """The bench's concurrencies for this engine, and why one was skipped ("" if none)."""
        s = self.settings
        levels = [1] + ([s.bench_concurrency] if s.bench_concurrency > 1 else [])
        if self.target.engine == "llama.cpp" and len(levels) > 1:
            # llama-cpp-python's server runs one request at a time and a new request cuts the
            # running stream short (its interrupt_requests, on by default): nothing to measure
            return [1], "; concurrent bench skipped (llama.cpp: one stream at a time)"
        return levels, ""

    def warm_up(self, name: str) -> None:
        """bench_warmups unmeasured runs of one prompt: the first runs pay for warm-up."""
        for _ in range(self.settings.bench_warmups):
            stream_once(self.client, BENCH_PROMPTS[name], self.settings.bench_tokens)

    def measure(self, name: str, level: int) -> BenchFigures:
        """bench_runs measured runs of one prompt at `level` streams at once."""
        s, runs = self.settings, []
        with ThreadPoolExecutor(max_workers=level) as pool:
            for _ in range(s.bench_runs):
                jobs = [pool.submit(stream_once, self.client, BENCH_PROMPTS[name], s.bench_tokens)
                        for _ in range(level)]
                runs.append([job.result() for job in jobs])
        return figures(name, level, runs)

    def bench_(self) -> str:
        levels, skipped = self.levels()
        for name in BENCH_PROMPTS:
            self.warm_up(name)
            for level in levels:
                self.bench.append(self.measure(name, level))
        return "; ".join(
            f"{f.prompt} x{f.concurrency}: {f.decode_tps.text()} tok/s, TTFT "
            f"{f.ttft_s.text(3)} s" + (f", all {f.aggregate_tps.median:.1f} tok/s"
                                        if f.concurrency > 1 else "")
            for f in self.bench
        ) + skipped

    def steps(self) -> Iterator[tuple[str, Callable[[], str] | str]]:
        """Each step, or the reason it does not apply to the recipe."""
        yield "health", self.health
        yield "chat", self.chat
        if self.settings.level == "stress":
            yield "stress-needles", (self.stress_needles if self.stress_sizes()[0] else
                                     f"no size of {list(self.settings.stress_needles)} fits the "
                                     f"{self.context}-token context")
            yield "ceiling", self.ceiling_
            return
        if self.settings.level == "soak":
            yield "soak", self.soak_
            return
        # the engine parses calls and thinking only with its parser
        no_tools = "the recipe has no tool_parser: the engine parses no tool calls"
        yield "tools", self.tools if self.target.tool_parser else no_tools
        yield "tools-stream", self.tools_stream if self.target.tool_parser else no_tools
        yield "thinking", (self.thinking if self.target.reasoning_parser else
                           "the recipe has no reasoning_parser: its model does not think")
        yield "long-generation", self.long_generation
        yield "prefill", self.prefill
        yield "needle", self.needle
        yield "speculative", (self.speculative if self.target.min_acceptance_length else
                              "the recipe does not speculate")
        yield "bench", self.bench_


def run_ladder(target: Target, settings: Settings, *, driver: str | None = None,
               caps_w: tuple[float, ...] = (),
               engine_build: tuple[str | None, str | None] = (None, None),
               vram: Callable[[], tuple[int, ...] | None] = lambda: None,
               log: Callable[[str], None] = lambda line: None) -> VerifyRun:
    """Every step of the settings' level in order until the first failure; returns the run (ok
    or not) to store. `vram` reads free VRAM (MiB per GPU) on the rig; `engine_build` is the
    venv's live build and the engine's version there."""
    ladder = Ladder(target, settings, vram)
    started, clock = datetime.now(UTC), time.monotonic()
    steps: list[Step] = []
    for name, step in ladder.steps():
        if isinstance(step, str):
            steps.append(Step(name=name, ok=True, skipped=True, seconds=0,
                              detail=f"skipped: {step}"))
            log(f"{name}: skipped, {step}")
            continue
        begun = time.monotonic()
        try:
            detail = step()
        except StepFailed as failed:
            steps.append(Step(name=name, ok=False, seconds=time.monotonic() - begun,
                              detail=f"{failed.step}: failed", expected=failed.expected,
                              got=failed.got, hint=failed.hint or None,
                              warnings=tuple(ladder.warnings)))
            break
        except (requests.RequestException, ValueError) as error:
            steps.append(Step(name=name, ok=False, seconds=time.monotonic() - begun,
                              detail="request failed", expected="an answer from the engine",
                              got=truncate(repr(error))))
            break
        steps.append(Step(name=name, ok=True, seconds=time.monotonic() - begun, detail=detail,
                          warnings=tuple(ladder.warnings)))
        log(f"{name}: ok, {detail}")
        for warning in ladder.warnings:
            log(f"{name}: WARNING {warning}")
        ladder.warnings = []
    failed = next((s for s in steps if not s.ok), None)
    return VerifyRun(
        rig=target.rig, recipe=target.recipe, engine=target.engine,
        served_model=target.served_name, url=target.url, driver=driver, caps_w=caps_w,
        started=started, seconds=round(time.monotonic() - clock, 3), ok=failed is None,
        failed_step=failed.name if failed else None, steps=tuple(steps),
        bench=tuple(ladder.bench),
        settings=json.loads(json.dumps({**settings.__dict__, "context": ladder.context})),
        level=settings.level, ceiling=ladder.ceiling, soak=ladder.soak,
        fingerprint=Fingerprint(recipe=target.recipe, recipe_hash=target.recipe_hash,
                                engine=target.engine, engine_build=engine_build[0],
                                engine_version=engine_build[1], driver=driver, caps_w=caps_w),
    )


def failure_message(run: VerifyRun) -> str:
    """What a failed run says: the step, the rig, what was expected and what came back."""
    step = run.failure()
    if step is None:
        return f"{run.rig}: {run.recipe} passed every step"
    return (f"{run.rig}: verify of {run.recipe} ({run.url}) failed at step {step.name}: "
            f"expected {step.expected}; got {step.got}"
            + (f"\nfix: {step.hint}" if step.hint else ""))


# --- compare ---------------------------------------------------------------------------------


def _bench(run: VerifyRun, prompt: str, concurrency: int) -> BenchFigures | None:
    return next((b for b in run.bench if b.prompt == prompt and
                 (b.concurrency == 1) == (concurrency == 1)), None)


def compare_rows(runs: list[VerifyRun], rig: str | None = None) -> list[VerifyRun]:
    """Across rigs: the latest run per rig, recipe, driver, cap and level; one rig: all its
    runs."""
    if rig is not None:
        return [r for r in runs if r.rig == rig]
    latest: dict[tuple, VerifyRun] = {}
    for run in runs:
        latest[(run.rig, run.recipe, run.driver, run.caps_w, run.level)] = run
    return sorted(latest.values(), key=lambda r: (r.rig, r.recipe, r.started))


def compare_table(runs: list[VerifyRun], rig: str | None = None):
    """A rich Table of the rows compare_rows picks."""
    from rich.table import Table

    title = (f"verify runs of {rig}" if rig else
             "latest verify run per rig, recipe, driver, cap and level")
    table = Table(title=title)
    for column in ("rig", "recipe", "driver", "cap W", "when (UTC)", "level", "ladder",
                   "narrative tok/s", "code tok/s", "TTFT s", "xN all tok/s", "stress / soak"):
        table.add_column(column, justify="right" if "tok" in column or "TTFT" in column
                         else "left")
    for run in compare_rows(runs, rig):
        cells = []
        for prompt in ("narrative", "code"):
            single = _bench(run, prompt, 1)
            cells.append(single.decode_tps.text() if single else "-")
        single = _bench(run, "narrative", 1)
        cells.append(single.ttft_s.text(3) if single else "-")
        many = _bench(run, "narrative", 2)
        cells.append(f"x{many.concurrency} {many.aggregate_tps.text()}" if many else "-")
        ladder = "pass" if run.ok else f"FAIL {run.failed_step}"
        table.add_row(run.rig, run.recipe, run.driver or "none", run.cap_label,
                      run.started.strftime("%Y-%m-%d %H:%M:%S"), run.level, ladder, *cells,
                      level_summary(run))
    return table


def level_summary(run: VerifyRun) -> str:
    """The stress level's ceiling or the soak's figures, in one cell ("-" for the quick one)."""
    if run.ceiling is not None:
        return run.ceiling.summary()
    if run.soak is not None:
        return run.soak.summary()
    return "-"


def settings_of(rig) -> Settings:
    return Settings(
        prefill_tokens=rig.verify_prefill_tokens, needle_depths=rig.verify_needle_depths,
        needle_fill=rig.verify_needle_fill, needle_exact=rig.verify_needle_exact,
        context_len=rig.verify_context_len, bench_warmups=rig.verify_bench_warmups,
        bench_runs=rig.verify_bench_runs, bench_tokens=rig.verify_bench_tokens,
        bench_concurrency=rig.verify_bench_concurrency, timeout_s=rig.verify_timeout_s,
        level=rig.verify_level, stress_needles=rig.verify_stress_needles,
        ceiling_start=rig.verify_ceiling_start, ceiling_rungs=rig.verify_ceiling_rungs,
        soak_seconds=rig.verify_soak_seconds, soak_requests=rig.verify_soak_requests,
        soak_turns=rig.verify_soak_turns, soak_context_tokens=rig.verify_soak_context_tokens,
        soak_min_retention=rig.verify_soak_min_retention,
    )


def api_url(rig, rig_name: str, address: str, bind: str, port: int) -> str:
    """Where this machine reaches the API: verify_url, the bind address, or the SSH address."""
    import ipaddress

    if rig.verify_url:
        return rig.verify_url
    ip = ipaddress.ip_address(bind)
    if ip.is_loopback:
        raise RigbookError(
            f"{rig_name}: serving_bind: the API listens on {bind} only, which this machine "
            "cannot reach; set verify_url (e.g. http://127.0.0.1:PORT through an SSH tunnel), "
            "or bind the rig's address with serving_api_key_file"
        )
    host_ = address if ip.is_unspecified else bind
    return f"http://[{host_}]:{port}" if ":" in host_ else f"http://{host_}:{port}"


#: The verify keys whose size must fit the context the ladder expects.
SIZE_KEYS = ("verify_prefill_tokens", "verify_bench_tokens")


def size_problems(rig, recipe, keys=SIZE_KEYS) -> list[str]:
    """verify's sizes among `keys` against the context the ladder expects (verify_context_len,
    else the context the rig serves: serving_max_model_len or the recipe's), each with room for
    an answer. Before connecting only the keys the operator set are checked (the defaults are
    verify's run options, not a contradiction); verify_plan checks all. verify_context_len
    itself is a claim the needle step tests against the engine, not a size."""
    from rigbook.roles.recipes import max_model_len_of

    context = rig.verify_context_len or max_model_len_of(recipe, rig)
    problems = []
    for key, low in zip(SIZE_KEYS, (16, 8), strict=True):
        if key in keys and getattr(rig, key) + ANSWER_TOKENS > context:
            problems.append(f"{key}: {getattr(rig, key)} does not fit the {context}-token "
                            f"context of {recipe.name}; allowed: {low}..{context - ANSWER_TOKENS}")
    return problems


def verify_plan(rig, rig_name: str, address: str) -> tuple[Target, Settings]:
    """The target and settings of a rig with a recipe; RigbookError names the field and range."""
    from rigbook.roles.recipes import bind_of, max_model_len_of, port_of, recipe_for
    from rigbook.roles.serving import read_api_key

    recipe = recipe_for(rig, rig_name)
    settings = settings_of(rig)
    problems = size_problems(rig, recipe)
    if problems:
        raise RigbookError("\n".join(f"{rig_name}: {problem}" for problem in problems))
    key_file = rig.serving_api_key_file or recipe.api_key_file
    try:
        key = read_api_key(key_file) if key_file else None
    except RigbookError as error:
        raise RigbookError(f"{rig_name}: {error}") from None
    url = api_url(rig, rig_name, address, bind_of(recipe, rig), port_of(recipe, rig))
    import hashlib

    target = Target(rig=rig_name, recipe=recipe.name, engine=recipe.engine,
                    served_name=recipe.served_name(), max_model_len=max_model_len_of(recipe, rig),
                    url=url, key=key, tool_parser=recipe.tool_parser,
                    reasoning_parser=recipe.reasoning_parser,
                    min_acceptance_length=recipe.speculative.min_acceptance_length
                    if recipe.speculative else None, venv=recipe.venv,
                    recipe_hash=hashlib.sha256(recipe.model_dump_json().encode()).hexdigest()[:12])
    return target, settings


def _hardware(host) -> tuple[str | None, tuple[float, ...]]:
    """Driver version and enforced power caps as the rig reports them now (none: no GPUs)."""
    from rigbook.core.facts import NvidiaGpus

    probe = host.get_fact(NvidiaGpus)
    if probe is None or not probe.ok:
        return None, ()
    caps = tuple(float(g.power_limit_w) for g in probe.gpus if g.power_limit_w is not None)
    return probe.driver_version, caps


#: The engine's package in a venv's manifest, by recipe engine.
ENGINE_PACKAGES = {"vllm": "vllm", "sglang": "sglang", "llama.cpp": "llama-cpp-python"}


def _engine_build(host, target: Target) -> tuple[str | None, str | None]:
    """The recipe's venv's live build and the engine's version in it (None: not known)."""
    from rigbook.roles.venvs import VenvBuilds

    if target.venv is None:
        return None, None
    state = host.get_fact(VenvBuilds, venv_name=target.venv)
    packages = (state.manifest or {}).get("packages") or {}
    want = ENGINE_PACKAGES.get(target.engine, target.engine)
    version = next((str(v) for k, v in packages.items()
                    if re.sub(r"[-_.]+", "-", str(k)).lower() == want), None)
    return state.target_build, version


def free_vram_reader(host) -> Callable[[], tuple[int, ...] | None]:
    """Free VRAM (MiB per GPU: nvidia-smi's memory.total less memory.used) read on the rig each
    call, with the command and parse of the GPU fact (NvidiaGpus); None where it cannot."""
    from rigbook.core.facts import NvidiaGpus

    def read() -> tuple[int, ...] | None:
        fact = NvidiaGpus()
        ok, output = host.run_shell_command(StringCommand(fact.command()), print_output=False)
        probe = fact.process(output.stdout_lines) if ok else None
        if probe is None or not probe.ok:
            return None
        free = tuple(g.memory_total_mib - g.memory_used_mib for g in probe.gpus
                     if g.memory_total_mib is not None and g.memory_used_mib is not None)
        return free or None

    return read


def _verify(state, host, target: Target, settings: Settings, root: Path | None) -> bool:
    """FunctionCommand body: run the ladder, store the run, fail this rig alone on a failure."""
    driver, caps = _hardware(host)

    def say(line: str) -> None:
        (logger.warning if "WARNING" in line else logger.info)(
            f"{host.print_prefix}verify {line}")

    run = run_ladder(target, settings, driver=driver, caps_w=caps,
                     engine_build=_engine_build(host, target), vram=free_vram_reader(host),
                     log=say)
    path = save_run(run, root)
    if run.ok:
        logger.info(f"{host.print_prefix}{target.recipe} passed the verify ladder "
                    f"({settings.level}) in "
                    f"{run.seconds:.1f} s; stored {path}")
        return True
    host.log_styled(f"{failure_message(run)}\nStored {path}", fg="red", log_func=logger.error)
    return False


@operation(is_idempotent=False)
def verify_serving(target: Target, settings: Settings, root: str | None = None):
    """
    Run the verify ladder against a rig's running recipe from this machine; store the run.

    + target: a ``Target`` (``verify_plan``): URL, served name, context, API key
    + settings: the ladder's ``Settings`` (host data verify_*)
    + root: results folder; none = ``results_dir()`` (RIGBOOK_VERIFY_DIR)

    Changes nothing on the rig: it sends requests to its API when the deploy executes and
    writes one JSON file here. A failed step fails this rig only.
    """
    yield FunctionCommand(_verify, (target, settings, Path(root) if root else None), {})


@deploy("Verify")
def verify(rig) -> None:
    """Verify the rig's running recipe (deploy-level: plans one operation for this host)."""
    from rigbook.core.messages import refused

    if rig.recipe is None:
        refused(name="Check the serving recipe",
                message=f"{host.name}: recipe: no recipe to verify; pass --data recipe=NAME")
        return
    address = host.data.get("ssh_hostname") or host.name
    try:
        target, settings = verify_plan(rig, host.name, address)
    except RigbookError as error:
        refused(name="Check the verify settings", message=str(error))
        return
    verify_serving(name=f"Verify {target.recipe} on {target.url}", target=target,
                   settings=settings)
