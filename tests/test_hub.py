"""`rigbook models resolve`: the commit, files, sizes and gating of a pin, from the hub's API
(against tests/hubstub.py on loopback: the routes huggingface_hub calls)."""

from __future__ import annotations

import json
import threading

import pytest

from rigbook.cli import main
from rigbook.core.errors import EXIT_USAGE
from tests.hubstub import Hub, big_repo, serve, tiny_repo


@pytest.fixture
def hub(tmp_path):
    """A stub hub whose tiny repo is public, and a 'rigbook-test/big' that wants a token."""
    made = []

    def start(token=None, gated=None):
        log = tmp_path / f"log{len(made)}.jsonl"
        stub = Hub((tiny_repo(), big_repo()), token=token, log_path=log, gated=gated)
        server = serve(stub)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        made.append(server)
        url = f"http://127.0.0.1:{server.server_address[1]}"
        return url, lambda: [json.loads(line) for line in log.read_text().splitlines()]

    yield start
    for server in made:
        server.shutdown()
        server.server_close()


def test_resolve_prints_the_commit_files_and_sizes_and_the_entry(hub, capsys, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    url, requests = hub()
    repo = tiny_repo()
    assert main(["models", "resolve", repo.repo_id, "--endpoint", url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"rigbook-test/tiny@main is commit {repo.commit}"
    assert out[1] == "gated: no"
    assert out[2] == "files the pin pulls: 4 of 4, 0.25 MiB"
    assert "      0.25 MiB  model.safetensors" in out
    assert out[-1] == f'  {{"repo": "rigbook-test/tiny", "revision": "{repo.commit}"}}'
    (asked,) = requests()
    assert asked["route"] == "revision" and asked["path"] == (
        "/api/models/rigbook-test/tiny/revision/main")


def test_resolve_with_allow_patterns_lists_only_what_the_pin_pulls(hub, capsys):
    url, _ = hub()
    repo = tiny_repo()
    assert main(["models", "resolve", f"{repo.repo_id}@{repo.commit}", "--endpoint", url,
                 "--allow", "*.json"]) == 0
    out = capsys.readouterr().out
    assert "files the pin pulls: 2 of 4" in out and "model.safetensors" not in out
    assert f'"revision": "{repo.commit}", "allow_patterns": ["*.json"]}}' in out


def test_the_token_goes_only_where_the_hub_wants_one(hub, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    url, requests = hub(token="s3cret-token", gated={"rigbook-test/big": "manual"})
    assert main(["models", "resolve", "rigbook-test/big", "--endpoint", url]) == EXIT_USAGE
    assert "the hub wants a token (a private or gated repo): set HF_TOKEN" in (
        capsys.readouterr().err)
    monkeypatch.setenv("HF_TOKEN", "s3cret-token")
    assert main(["models", "resolve", "rigbook-test/big", "--endpoint", url]) == 0
    out = capsys.readouterr().out
    assert "gated: yes (manual): accept its terms on the hub" in out
    assert "s3cret-token" not in out
    assert [r["auth"] for r in requests()] == ["missing", "missing", "ok"]
    wrong = tmp_path / "token"
    wrong.write_text("not-it\n")
    assert main(["models", "resolve", "rigbook-test/big", "--endpoint", url,
                 "--token-file", str(wrong)]) == EXIT_USAGE
    assert "the hub refused the token" in capsys.readouterr().err


def test_a_public_repo_is_never_asked_with_the_token(hub, capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "s3cret-token")
    url, requests = hub()
    assert main(["models", "resolve", "rigbook-test/tiny", "--endpoint", url]) == 0
    assert [r["auth"] for r in requests()] == ["none-needed"]


@pytest.mark.parametrize(("target", "message"), [
    ("rigbook-test/nope", "rigbook-test/nope@main: no such repo or revision"),
    ("rigbook-test/tiny@v9", "rigbook-test/tiny@v9: no such repo or revision"),
    ("not-a-repo", "'not-a-repo' is not a repo id; allowed: ORG/NAME"),
    ("o/n@../../etc", "'../../etc' is not a branch, tag or commit"),
    ("o/n@main\n", "is not a branch, tag or commit"),
])
def test_bad_targets_are_refused_plainly(hub, capsys, target, message):
    url, _ = hub()
    assert main(["models", "resolve", target, "--endpoint", url]) == EXIT_USAGE
    assert message in capsys.readouterr().err


def test_no_endpoint_and_a_bad_one_are_refused(capsys, monkeypatch):
    from rigbook.hub import endpoint_of

    assert endpoint_of(None, {"HF_ENDPOINT": "http://10.0.0.5:8090/"}) == "http://10.0.0.5:8090"
    assert main(["models", "resolve", "o/n", "--endpoint", "file:///etc"]) == EXIT_USAGE
    assert "is not an http(s) URL" in capsys.readouterr().err
