"""The verify ladder against a tiny fake OpenAI server on 127.0.0.1 (a thread of this test).

The fake counts one token per word (+4 for the chat wrapper), rejects prompts at or beyond its
context with llama-cpp-python's own message, streams one word per SSE chunk, and can be told
to serve another model name, answer in a wrong shape, or accept any length.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rigbook import cli
from rigbook.core.errors import RigbookError
from rigbook.core.spec import parse_rig
from rigbook.roles import degeneration, toolcheck
from rigbook.roles.stepproblem import StepProblem
from rigbook.roles.verify import (
    Settings,
    Target,
    VerifyRun,
    api_url,
    compare_rows,
    compare_table,
    failure_message,
    load_runs,
    read_stream,
    run_ladder,
    sample_of,
    save_run,
    sse_chunks,
    verify_plan,
)

KEY = "k-123"
LADDER = ["health", "chat", "tools", "tools-stream", "thinking", "long-generation", "prefill",
          "needle", "speculative", "bench"]
SMALL = Settings(prefill_tokens=100, needle_depths=(0.1, 0.9), needle_fill=0.9,
                 needle_exact=True, bench_warmups=1, bench_runs=2, bench_tokens=8,
                 bench_concurrency=2, timeout_s=10)


FIXTURES = Path(__file__).parent / "fixtures" / "toolcalls"
THINKING = Path(__file__).parent / "fixtures" / "thinking"


def fixture(name: str, folder: Path = FIXTURES) -> str:
    return (folder / name).read_text()


def step(run: VerifyRun, name: str):
    return next(s for s in run.steps if s.name == name)


class Fake:
    model = "org/served"
    context = 512
    shape_ok = True
    reject = True
    recall = True
    # what a request with tools gets: (HTTP code, JSON body) and the SSE stream
    tool_answer = (200, fixture("sglang-qwen25-tool-call.json"))
    tool_stream = fixture("sglang-qwen25-stream.sse")
    tool_bodies: list = []
    # what a request with thinking on gets (the thinking step), and the essay's text
    think_answer = (200, fixture("sglang-r1-reasoning.json", THINKING))
    think_stream = fixture("sglang-r1-stream.sse", THINKING)
    think_bodies: list = []
    essay: str | None = None
    # the /metrics texts the engine serves, one per GET (the speculative step reads two)
    metrics: list = []
    # prompts of this many tokens or more crash the engine (the connection drops unanswered,
    # as when an out-of-memory kills it); None: every prompt the context allows is served
    fits: int | None = None
    # the streamed answers (counted from 0) that carry no text: a silent empty reply
    empty_streams: set = set()
    streams = 0


class Handler(BaseHTTPRequestHandler):
    fake = Fake

    def log_message(self, *args):  # quiet
        pass

    def _send(self, code: int, body: dict | str, kind: str = "application/json") -> None:
        data = (json.dumps(body) if isinstance(body, dict) else body).encode()
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            return self._send(404, {"detail": "Not Found"})
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            return self._send(401, {"error": "bad key"})
        if self.path == "/metrics":
            if not self.fake.metrics:
                return self._send(404, {"detail": "Not Found"})
            return self._send(200, self.fake.metrics.pop(0), "text/plain; version=0.0.4")
        self._send(200, {"object": "list", "data": [{"id": self.fake.model}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if "tools" in body:
            self.fake.tool_bodies.append(body)
            if body.get("stream"):
                return self._send(200, self.fake.tool_stream, "text/event-stream")
            return self._send(*self.fake.tool_answer)
        if "chat_template_kwargs" in body:
            self.fake.think_bodies.append(body)
            if body.get("stream"):
                return self._send(200, self.fake.think_stream, "text/event-stream")
            return self._send(*self.fake.think_answer)
        content = body["messages"][0]["content"]
        every = " ".join(m["content"] for m in body["messages"])  # a conversation's turns
        if content == degeneration.ESSAY_PROMPT and self.fake.essay is not None:
            return self._send(200, {
                "object": "chat.completion", "model": self.fake.model,
                "choices": [{"index": 0, "finish_reason": "length",
                             "message": {"role": "assistant", "content": self.fake.essay}}],
                "usage": {"prompt_tokens": 40, "completion_tokens": body["max_tokens"]}})
        prompt = len(every.split()) + 4
        if self.fake.fits is not None and prompt >= self.fake.fits:
            self.close_connection = True
            self.connection.shutdown(2)
            return None
        if self.fake.reject and prompt >= self.fake.context:
            return self._send(400, {"error": {"message": (
                f"This model's maximum context length is {self.fake.context} tokens. However, "
                f"you requested {prompt} tokens")}})
        code = re.search(r"secret number of the rig is (\d+)", content)
        answer = code.group(1) if code and self.fake.recall else "OK"
        if body.get("stream"):
            self.fake.streams += 1
            words = [f"w{i} " for i in range(body["max_tokens"])]
            if self.fake.streams - 1 in self.fake.empty_streams:
                words = []  # the role chunk, an empty content and the finish: nothing to show
            lines = [json.dumps({"choices": [{"delta": {"role": "assistant"}}]})]
            lines += [json.dumps({"choices": [{"delta": {"content": w}}]}) for w in words or [""]]
            lines.append(json.dumps({"choices": [], "usage": {"prompt_tokens": prompt,
                                                               "completion_tokens": len(words)}}))
            text = "".join(f"data: {line}\n\n" for line in lines) + "data: [DONE]\n\n"
            return self._send(200, text, "text/event-stream")
        if not self.fake.shape_ok:
            return self._send(200, {"choices": [{"text": answer}]})
        self._send(200, {
            "object": "chat.completion", "model": self.fake.model,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": answer}}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": 1},
        })


@pytest.fixture
def server():
    class Local(Fake):
        tool_bodies, think_bodies, metrics, empty_streams = [], [], [], set()

    handler = type("H", (Handler,), {"fake": Local})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield Local, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def target(url: str, context: int = 512) -> Target:
    return Target(rig="rigA", recipe="tiny", engine="vllm", served_name="org/served",
                  max_model_len=context, url=url, key=KEY)


def test_whole_ladder_passes(server):
    fake, url = server
    run = run_ladder(target(url), SMALL, driver="580.95.05", caps_w=(290.0, 290.0))
    assert run.ok, failure_message(run)
    assert [s.name for s in run.steps] == LADDER
    # a step that does not apply to the recipe is stored as skipped, with the reason
    assert [s.name for s in run.steps if s.skipped] == ["tools", "tools-stream", "thinking",
                                                        "speculative"]
    assert step(run, "tools").detail == ("skipped: the recipe has no tool_parser: the engine "
                                         "parses no tool calls")
    assert step(run, "thinking").detail == ("skipped: the recipe has no reasoning_parser: its "
                                            "model does not think")
    prefill = step(run, "prefill").detail
    assert re.match(r"\d+ prompt tokens", prefill) and 90 <= int(prefill.split()[0]) <= 100
    needle = step(run, "needle").detail
    assert "0.1: " in needle and "recalled" in needle and "640 tok rejected (HTTP 400)" in needle
    assert {(b.prompt, b.concurrency) for b in run.bench} == {
        ("narrative", 1), ("narrative", 2), ("code", 1), ("code", 2)}
    assert all(b.tokens == 8 and b.runs == 2 for b in run.bench)
    # llama-cpp-python cuts a running stream short when another request comes: single only
    one = run_ladder(Target(**{**target(url).__dict__, "engine": "llama.cpp"}), SMALL)
    assert {b.concurrency for b in one.bench} == {1}
    assert "concurrent bench skipped (llama.cpp: one stream at a time)" in step(one, "bench").detail


def test_wrong_model_name_stops_at_health(server):
    fake, url = server
    fake.model = "org/other"
    run = run_ladder(target(url), SMALL)
    assert not run.ok and run.failed_step == "health" and len(run.steps) == 1
    message = failure_message(run)
    assert "rigA: verify of tiny" in message and "failed at step health" in message
    assert "expected /v1/models to list 'org/served'; got ['org/other']" in message


def test_bad_key_and_dead_engine(server):
    fake, url = server
    run = run_ladder(Target(**{**target(url).__dict__, "key": "wrong"}), SMALL)
    assert run.failed_step == "health" and "HTTP 401" in run.steps[0].got
    dead = run_ladder(target("http://127.0.0.1:1"), SMALL)
    assert dead.failed_step == "health" and "ConnectionError" in dead.steps[0].got


def test_bad_answer_shape_stops_at_chat(server):
    fake, url = server
    fake.shape_ok = False
    run = run_ladder(target(url), SMALL)
    assert run.failed_step == "chat"
    step = run.failure()
    assert step.expected == "an OpenAI chat completion (choices[0].message is not an assistant " \
                            "message)"
    assert step.got.startswith('HTTP 200: {"choices": [{"text": "OK"}]}')


def test_needle_recall_exact_or_plumbing_only(server):
    fake, url = server
    fake.recall = False
    run = run_ladder(target(url), SMALL)
    assert run.failed_step == "needle" and "answered with" in run.failure().expected
    assert run.failure().got == "'OK'"
    plumbing = run_ladder(target(url), Settings(**{**SMALL.__dict__, "needle_exact": False}))
    assert plumbing.ok and "accepted" in step(plumbing, "needle").detail


def test_context_beyond_the_engine_is_rejected_and_reported(server):
    fake, url = server
    # the ladder believes 1024 tokens; the engine holds 512: the needle probe is rejected
    run = run_ladder(target(url), Settings(**{**SMALL.__dict__, "context_len": 1024}))
    step = run.failure()
    assert run.failed_step == "needle"
    assert "to be accepted and answered (context 1024)" in step.expected
    assert "HTTP 400" in step.got and "maximum context length is 512 tokens" in step.got
    # an engine that accepts anything fails the beyond-context rejection check
    fake.reject = False
    run = run_ladder(target(url), SMALL)
    assert run.failed_step == "needle"
    assert "rejected with a context-length error" in run.failure().expected
    assert run.failure().got.startswith("HTTP 200")


def tool_target(url: str, engine: str = "sglang") -> Target:
    return Target(**{**target(url).__dict__, "engine": engine, "tool_parser": "qwen25"})


def test_tool_call_steps_pass_on_sglangs_own_answers(server):
    """SGLang's documented answers (tests/fixtures/toolcalls): the call in tool_calls, streamed
    as a name then argument fragments, finish_reason tool_calls."""
    fake, url = server
    run = run_ladder(tool_target(url), SMALL)
    assert run.ok, failure_message(run)
    assert [s.name for s in run.steps] == LADDER
    assert [s.name for s in run.steps if s.skipped] == ["thinking", "speculative"]
    tools, stream = step(run, "tools").detail, step(run, "tools-stream").detail
    assert tools.startswith('get_current_weather({"city": "Boston", "state": "MA", "unit": '
                            '"fahrenheit"}), 1 call(s), finish_reason tool_calls')
    assert '"unit": "celsius"' in stream and stream.endswith("finish_reason tool_calls, 8 delta(s)")
    # the engine's parser reads "auto" (vLLM and SGLang answer a named tool without it);
    # llama-cpp-python's chatml-function-calling is asked by name, the grammar makes the call
    plain, streamed = fake.tool_bodies
    assert plain["tool_choice"] == "auto" and "stream" not in plain and streamed["stream"] is True
    assert plain["tools"][0]["function"]["name"] == "get_current_weather"
    fake.tool_bodies.clear()
    run_ladder(tool_target(url, "llama.cpp"), SMALL)
    assert fake.tool_bodies[0]["tool_choice"] == {"type": "function",
                                                  "function": {"name": "get_current_weather"}}


def tools_failure(fake, url, *, answer=None, stream=None):
    """The first failed step of a ladder whose engine answers tools with these."""
    if answer is not None:
        fake.tool_answer = answer
    if stream is not None:
        fake.tool_stream = stream
    run = run_ladder(tool_target(url), SMALL)
    assert not run.ok and run.steps[-1] == run.failure()
    return run, run.failure()


def test_a_call_left_in_content_is_the_parser_off(server):
    fake, url = server
    run, step = tools_failure(fake, url, answer=(200, fixture("sglang-qwen25-parser-off.json")))
    assert run.failed_step == "tools"
    assert step.expected == "the call in choices[0].message.tool_calls, not in the text"
    assert "<tool_call>" in step.got and step.hint == toolcheck.LEAK_HINT
    message = failure_message(run)
    assert "failed at step tools: expected the call in" in message
    assert "\nfix: the engine put the call in content: the tool parser is off or wrong: set the " \
           "recipe's tool_parser" in message
    # the same text streamed: no delta.tool_calls, markup in the content deltas
    fake.tool_answer = Fake.tool_answer
    text = json.loads(fixture("sglang-qwen25-parser-off.json"))["choices"][0]["message"]["content"]
    chunk = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": "stop"}]}
    run, step = tools_failure(fake, url, stream=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n")
    assert run.failed_step == "tools-stream" and step.hint == toolcheck.LEAK_HINT
    assert step.expected == "the call in delta.tool_calls, not in the text"
    # a call in tool_calls that still leaves its markup in the text is a half-working parser
    both = json.loads(fixture("sglang-qwen25-tool-call.json"))
    both["choices"][0]["message"]["content"] += "\n<tool_call>\n"
    run, step = tools_failure(fake, url, answer=(200, json.dumps(both)))
    assert step.expected.startswith("no call markup left in the content") and "'<tool_call>'" \
        in step.got


def test_no_tool_call_names_the_model_and_template(server):
    fake, url = server
    run, step = tools_failure(fake, url, answer=(200, fixture("llamacpp-no-tool-call.json")))
    assert run.failed_step == "tools" and step.hint == toolcheck.NO_CALL_HINT
    assert step.expected == "a call of get_current_weather in choices[0].message.tool_calls"
    assert step.got.startswith("finish_reason 'stop', content 'The current weather in San")


def test_arguments_that_are_not_json(server):
    fake, url = server
    bad = json.loads(fixture("sglang-qwen25-tool-call.json"))
    function = bad["choices"][0]["message"]["tool_calls"][0]["function"]
    function["arguments"] = '{"city": "Boston", "state": "MA", "unit": '  # planted: cut short
    run, step = tools_failure(fake, url, answer=(200, json.dumps(bad)))
    assert step.expected == "choices[0].message.tool_calls[0].function.arguments to parse as JSON"
    assert step.hint == toolcheck.ARGS_HINT and "Expecting value" in step.got
    for arguments, expected in (('"Boston"', "to be a JSON object"), ("[1]", "a JSON object")):
        function["arguments"] = arguments
        assert expected in tools_failure(fake, url, answer=(200, json.dumps(bad)))[1].expected
    function.update(name="get_weather", arguments="{}")
    step = tools_failure(fake, url, answer=(200, json.dumps(bad)))[1]
    assert step.expected.endswith("to call get_current_weather") and step.got == "'get_weather'"


def test_a_stream_must_end_with_finish_reason_tool_calls(server):
    fake, url = server
    stopped = fixture("sglang-qwen25-stream.sse").replace('"finish_reason": "tool_calls"',
                                                          '"finish_reason": "stop"')  # planted
    run, step = tools_failure(fake, url, stream=stopped)
    assert run.failed_step == "tools-stream" and step.hint == toolcheck.FINISH_HINT
    assert step.got == "finish_reason 'stop' after 8 tool-call delta(s)"
    # fragments that do not add up to JSON
    cut = fixture("sglang-qwen25-stream.sse").replace('elsius\\"}', 'elsius')
    step = tools_failure(fake, url, stream=cut)[1]
    assert step.expected == "delta.tool_calls[0].function.arguments to parse as JSON"


def test_an_engine_without_auto_tool_choice_refuses_tools(server):
    fake, url = server
    run, step = tools_failure(fake, url,
                              answer=(400, fixture("vllm-auto-tool-choice-refused.json")))
    assert run.failed_step == "tools" and step.hint == toolcheck.HTTP_HINT
    assert step.got.startswith('HTTP 400: {"object":"error","message":"\\"auto\\" tool choice '
                               'requires --enable-auto-tool-choice')


@pytest.mark.parametrize("text", [
    "[TOOL_CALLS][{'name': 'get_current_weather'}]", "<|python_tag|>get_current_weather.call()",
    "<function=get_current_weather>{}</function>", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>",
    '{"name" : "get_current_weather", "parameters": {}}',
])
def test_each_familys_call_markup_in_the_text_is_a_leak(text):
    with pytest.raises(StepProblem) as problem:
        toolcheck.check_calls([], f"Sure. {text}", "stop", where="tool_calls")
    assert problem.value.hint == toolcheck.LEAK_HINT
    plain = "The weather in Boston is mild; I would call a weather service for you."
    with pytest.raises(StepProblem) as problem:
        toolcheck.check_calls([], plain, "stop", where="tool_calls")
    assert problem.value.hint == toolcheck.NO_CALL_HINT


def test_adversarial_tool_answers_fail_the_step_not_the_ladder():
    """Shapes no engine should send still give a step failure, never a crash."""
    for data in ({}, {"choices": []}, {"choices": ["x"]}, {"choices": [{"message": "x"}]},
                 {"choices": [{"message": {"tool_calls": ["x", {"function": 3}]}}]},
                 {"choices": [{"message": {"content": 5, "tool_calls": [
                     {"function": {"name": None, "arguments": None}}]}}]}):
        with pytest.raises(StepProblem) as problem:
            toolcheck.check_answer(data)
        assert problem.value.hint in (toolcheck.SHAPE_HINT, toolcheck.NO_CALL_HINT,
                                      toolcheck.NAME_HINT), data
    odd = ['data: {"choices":[{"delta":{"tool_calls":["x",{"index":[1],"function":'
           '{"name":"get_current_weather","arguments":7}}]}}]}', "data: [DONE]"]
    with pytest.raises(StepProblem, match="to parse as JSON"):
        toolcheck.check_stream(sse_chunks(odd))
    for line in ("data: [1]", 'data: {"choices":5}', 'data: {"choices":["x",{"delta":3}]}',
                 'data: {"choices":[{"delta":{"tool_calls":7},"finish_reason":9}]}'):
        with pytest.raises(StepProblem, match="a call of get_current_weather"):
            toolcheck.check_stream(sse_chunks([line, "data: [DONE]"]))
    with pytest.raises(StepProblem, match="a call of"):
        toolcheck.check_answer({"choices": [{"message": {"content": "hi", "tool_calls": 5}}]})
    with pytest.raises(ValueError, match="'{not json' "):
        list(sse_chunks(["data: {not json", "data: [DONE]"]))


def test_a_stream_that_is_not_json_fails_its_step_with_the_shape_hint(server):
    fake, url = server
    run, step = tools_failure(fake, url, stream="data: {not json\n\ndata: [DONE]\n\n")
    assert run.failed_step == "tools-stream" and step.hint == toolcheck.SHAPE_HINT
    assert step.expected == "a stream of JSON chunks" and "'{not json'" in step.got


def test_stream_arithmetic():
    events = [(10.5, "a"), (10.6, "b"), (10.7, "c"), (11.5, "d")]
    sample = sample_of(10.0, events, None)
    assert sample.ttft_s == pytest.approx(0.5) and sample.tokens == 4
    assert sample.decode_tps == pytest.approx(3 / 1.0)
    # the engine's usage count wins over chunks (several tokens in a chunk)
    assert sample_of(10.0, events, 7).decode_tps == pytest.approx(6.0)
    assert sample_of(10.0, [(10.2, "x")], None).decode_tps == 0.0
    with pytest.raises(ValueError):
        sample_of(10.0, [], 3)

    class Response:
        def iter_lines(self):
            yield from ['data: {"choices":[{"delta":{"role":"assistant"}}]}', "",
                        'data: {"choices":[{"delta":{"content":"Hi"}}]}', ": ping",
                        'data: {"choices":[{"delta":{"content":" there"}}]}',
                        'data: {"choices":[],"usage":{"completion_tokens":3}}', "data: [DONE]",
                        'data: {"choices":[{"delta":{"content":"late"}}]}']
    ticks = iter([1.0, 2.0])
    assert read_stream(Response(), clock=lambda: next(ticks)) == ([(1.0, "Hi"), (2.0, " there")],
                                                                 3)

    class Empty:
        def iter_lines(self):
            yield from [b'data: {"choices":[{"delta":{"role":"assistant"}}]}', b"data: [DONE]"]
    with pytest.raises(ValueError, match=r"no content chunks in the stream, which began: data: "):
        read_stream(Empty())


def test_results_json_and_compare(server, tmp_path: Path, monkeypatch, capsys):
    fake, url = server
    monkeypatch.setenv("RIGBOOK_VERIFY_DIR", str(tmp_path))
    first = run_ladder(target(url), SMALL, driver="580.95.05", caps_w=(290.0,))
    second = run_ladder(target(url), SMALL, driver="580.95.05", caps_w=(290.0,))
    fake.model = "org/other"
    other = run_ladder(Target(**{**target(url).__dict__, "rig": "rigB"}), SMALL, driver=None)
    paths = [save_run(r) for r in (first, second, other)]
    assert paths[0].relative_to(tmp_path).parts[:4] == ("rigA", "tiny", "driver-580.95.05",
                                                        "cap-290")
    assert VerifyRun.model_validate_json(paths[0].read_text()) == first
    runs = load_runs()
    assert len(runs) == 3
    assert [r.started for r in compare_rows(runs)] == [second.started, other.started]
    assert len(compare_rows(runs, "rigA")) == 2
    # the CLI: a table across rigs and a PNG
    png = tmp_path / "chart.png"
    assert cli.main(["bench", "compare", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "rigA" in out and "rigB" in out and "FAIL health" in out and "pass" in out
    assert "x2" in out and "580.95.05" in out
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and b"IEND" in data[-12:]
    assert cli.main(["bench", "compare", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [VerifyRun.model_validate(row) for row in listed] == compare_rows(runs)
    assert cli.main(["bench", "compare", "--rig", "nope"]) == 3
    assert compare_table(runs, "rigA").row_count == 2
    # a damaged file is named
    bad = paths[0].with_name("broken.json")
    bad.write_text('{"rig": 1}')
    with pytest.raises(RigbookError, match="broken.json: not a verify result"):
        load_runs()


def rig(**data):
    base = {"platform": "debian", "gpu_class": "rtx3090", "gpu_count": 1,
            "recipe": "tiny-cpu-a", "serving_recipe_dirs": [str(Path("tests/recipes").resolve())],
            "venvs": [{"name": "tiny-cpu", "engine": "llama-cpp-python", "packages": ["x==1.0"]}]}
    return parse_rig("rigA", {**base, **data})


def test_plan_from_host_data(tmp_path: Path):
    key = tmp_path / "key"
    key.write_text(KEY + "\n")
    key.chmod(0o600)
    wide = rig(serving_bind="0.0.0.0", serving_api_key_file=str(key), verify_prefill_tokens=300,
               verify_needle_exact=False)
    target_, settings = verify_plan(wide, "rigA", "10.231.1.2")
    assert target_.url == "http://10.231.1.2:8100" and target_.key == KEY
    assert target_.served_name == "local/tiny" and target_.max_model_len == 512
    assert target_.tool_parser is None  # no tool_parser: no tool steps
    tools = tmp_path / "recipes"
    tools.mkdir()
    text = (Path("tests/recipes/tiny-cpu-a.toml").read_text()
            .replace('name = "tiny-cpu-a"', 'name = "tiny-cpu-tools"')
            .replace("port = 8100", 'port = 8100\ntool_parser = "chatml-function-calling"'))
    (tools / "tiny-cpu-tools.toml").write_text(text)
    called = rig(recipe="tiny-cpu-tools", serving_recipe_dirs=[str(tools)],
                 serving_bind="0.0.0.0", serving_api_key_file=str(key), verify_prefill_tokens=300)
    assert verify_plan(called, "rigA", "10.231.1.2")[0].tool_parser == "chatml-function-calling"
    assert settings.prefill_tokens == 300 and settings.needle_exact is False
    with pytest.raises(RigbookError, match=r"verify_prefill_tokens: 15000 does not fit the "
                                           r"512-token context of tiny-cpu-a; allowed: 16\.\.496"):
        verify_plan(rig(serving_bind="0.0.0.0", serving_api_key_file=str(key)), "rigA", "x")
    with pytest.raises(RigbookError, match="listens on 127.0.0.1 only"):
        verify_plan(rig(verify_prefill_tokens=300), "rigA", "10.0.0.1")
    tunnel = rig(verify_prefill_tokens=300, verify_url="http://127.0.0.1:18100")
    assert verify_plan(tunnel, "rigA", "x")[0].url == "http://127.0.0.1:18100"
    assert api_url(wide, "rigA", "h", "192.168.1.5", 8000) == "http://192.168.1.5:8000"
    with pytest.raises(RigbookError, match=r"verify_needle_depths.0: Value error|depth 1.5"):
        rig(verify_needle_depths=[1.5])
