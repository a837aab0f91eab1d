"""rigbook.core.managed: one read of every managed file, run against real files in a shell."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
from io import StringIO

import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all
from pyinfra.api.operations import run_ops
from pyinfra.context import ctx_host, ctx_state
from pyinfra.operations import server

from rigbook.core import managed, messages, render, runfacts
from tests.opkit import FakeHost, describe, execute, file_states


def read(paths: tuple[str, ...]) -> dict:
    """FileStates as the rig would answer it: its command run by a real shell."""
    fact = managed.FileStates()
    command = fact.command(paths).get_raw_value()
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True)
    return fact.process(out.stdout.splitlines())


def test_one_command_reads_files_folders_links_and_absent_paths(tmp_path):
    odd = tmp_path / "a file; $(touch pwned) 'quoted' back\\nslash"
    odd.write_text("x\n")
    os.chmod(odd, 0o640)
    (tmp_path / "dir").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(odd)
    paths = tuple(str(tmp_path / name) for name in (odd.name, "dir", "link", "missing"))
    states = read(paths)
    assert states[paths[0]] == managed.FileState(
        "file", 0o640, hashlib.sha256(b"x\n").hexdigest())
    assert states[paths[1]] == managed.FileState("directory", 0o700)
    assert states[paths[2]].kind == "link"
    assert states[paths[3]] is None
    assert not (tmp_path / "pwned").exists() and not os.path.exists("pwned")


def run(body, facts: dict, planned: tuple[str, ...] = ()):
    """Run generator `body` as an operation would on a fake rig with `planned` paths."""
    fake = FakeHost(facts)
    state = State(Inventory((["rig1"], {})), Config())
    state.is_executing = True
    with ctx_state.use(state), ctx_host.use(fake):
        managed.expect(*planned)
        commands = list(body())
    return commands, fake


def test_every_planned_path_is_read_in_one_command_and_only_once():
    text = "unit\n"
    facts = {"FileStates": file_states({"/etc/a.conf": text, "/etc/b.conf": "old"},
                                       dirs={"/etc": 0o755})}

    def body():
        yield from managed.text_commands(text, "/etc/a.conf")
        yield from managed.text_commands("new\n", "/etc/b.conf")
        yield from managed.absent_commands("/etc/c.conf")
        yield from managed.directory_commands("/etc", "755")

    commands, fake = run(body, facts, ("/etc/a.conf", "/etc/b.conf", "/etc/c.conf"))
    assert [name for name, _ in fake.asked] == ["FileStates"]
    assert set(fake.asked[0][1]["paths"]) >= {"/etc", "/etc/a.conf", "/etc/b.conf", "/etc/c.conf"}
    assert [describe(c) for c in commands] == ["upload /etc/b.conf", "chmod 644 /etc/b.conf"]
    assert fake.noops == ["file /etc/a.conf is already uploaded", "file /etc/c.conf does not exist",
                          "directory /etc already exists"]


def test_a_mode_that_differs_is_set_without_an_upload_and_none_leaves_it():
    facts = {"FileStates": file_states({"/x/f": "same"}, mode=0o600)}
    commands, _ = run(lambda: managed.put_commands(StringIO("same"), "/x/f", "644"), facts)
    assert [describe(c) for c in commands] == ["chmod 644 /x/f"]
    commands, fake = run(lambda: managed.put_commands(StringIO("same"), "/x/f"), facts)
    assert commands == [] and fake.noops == ["file /x/f is already uploaded"]


def test_a_missing_folder_is_made_before_the_upload():
    commands, _ = run(lambda: managed.text_commands("t", "/new/dir/f", "600"),
                      {"FileStates": file_states()})
    assert [describe(c) for c in commands] == [
        "mkdir -p /new/dir", "upload /new/dir/f", "chmod 600 /new/dir/f"]


@pytest.mark.parametrize("kind", ["directory", "link", "other"])
def test_something_else_at_a_file_path_is_refused_not_replaced(kind):
    def states(paths):
        return {path: managed.FileState(kind, 0o755) for path in paths}

    commands, fake = run(lambda: managed.text_commands("t", "/etc/x"), {"FileStates": states})
    assert [describe(c) for c in commands] == ["call _log_refusal"]
    assert execute(commands[0], fake) is False  # the step fails this rig when it executes
    assert fake.logged == [f"/etc/x is a {kind}, not a file: rigbook will not replace it"]


def test_another_operation_that_changed_the_rig_makes_the_next_comparison_read_again(
        monkeypatch):
    answers = [{"/etc/x": None, "/etc": managed.FileState("directory", 0o755)},
               {"/etc/x": managed.FileState("file", 0o644, "0" * 64)}]
    changes = [0]
    monkeypatch.setattr(runfacts, "_changes", lambda *_: (changes[0], changes[0]))

    def body():
        yield from managed.absent_commands("/etc/x")  # absent when first read
        changes[0] = 1  # an apt install completed, and put it there
        yield from managed.absent_commands("/etc/x")

    commands, fake = run(body, {"FileStates": lambda paths: answers.pop(0)}, ("/etc/x",))
    assert len(fake.asked) == 2
    assert [describe(c) for c in commands] == [
        "if [ -f /etc/x ] && [ ! -L /etc/x ]; then rm -f -- /etc/x ; else echo '/etc/x is not a "
        "regular file: rigbook will not remove it' >&2; false; fi"]


@pytest.mark.parametrize("kind", ["directory", "link", "other"])
def test_only_a_regular_file_is_removed(kind):
    def states(paths):
        return {path: managed.FileState(kind, 0o755) for path in paths}

    commands, fake = run(lambda: managed.absent_commands("/etc/x"), {"FileStates": states})
    assert [describe(c) for c in commands] == ["call _log_refusal"]
    assert execute(commands[0], fake) is False
    assert fake.logged == [f"/etc/x is a {kind}, not a regular file: rigbook will not remove it"]


def _removing(path: str) -> str:
    """The shell command that removes `path`, read while a regular file was there."""
    commands, _ = run(lambda: managed.absent_commands(path),
                      {"FileStates": lambda paths: {p: managed.FileState("file", 0o644, "0" * 64)
                                                    for p in paths}})
    return describe(commands[0])


@pytest.mark.parametrize("kind", ["directory", "link to a file", "link to nothing", "fifo",
                                  "device node"])
def test_what_is_there_when_the_command_runs_is_tested_in_the_same_command(tmp_path, kind):
    """Between the read and the removal something else may take the path: the command itself
    refuses anything but a regular file, and leaves it (and a link's target) as it was."""
    target, path = tmp_path / "target", tmp_path / "left over's"
    target.write_text("keep")
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "device node":
        if os.geteuid() != 0:
            pytest.skip("a device node needs root")
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    else:
        path.symlink_to(target if kind == "link to a file" else tmp_path / "none")
    done = subprocess.run(["sh", "-c", _removing(str(path))], capture_output=True, text=True)
    assert done.returncode == 1, done.stderr
    assert "is not a regular file: rigbook will not remove it" in done.stderr
    assert os.path.lexists(path) and target.read_text() == "keep"


def test_a_regular_file_is_removed_by_the_command(tmp_path):
    path = tmp_path / "99-vllm-swap.conf"
    path.write_text("vm.swappiness = 10\n")
    done = subprocess.run(["sh", "-c", _removing(str(path))], capture_output=True, text=True)
    assert done.returncode == 0 and not path.exists(), done.stderr


def test_a_fact_the_preflight_read_is_not_read_again_until_the_rig_changed(monkeypatch):
    """rigbook.core.runfacts: the preflight's batch seeds the run; a change by another operation
    sends the next read to the rig."""
    changes = [0]
    monkeypatch.setattr(runfacts, "_changes", lambda *_: (changes[0], changes[0]))
    fact = managed.FileStates

    def body():
        runfacts.seed(ctx_state.get(), ctx_host.get(), fact, {"paths": ("/a",)}, {"/a": None})
        yield runfacts.once(fact, paths=("/a",))  # seeded: no read
        yield runfacts.once(fact, paths=("/a",))
        changes[0] = 1  # another operation changed the rig: read again
        yield runfacts.once(fact, paths=("/a",))

    answers, fake = run(body, {"FileStates": lambda paths: {"/a": "read"}})
    assert answers == [{"/a": None}, {"/a": None}, {"/a": "read"}]
    assert [name for name, _ in fake.asked] == ["FileStates"]


def test_a_write_of_this_module_keeps_the_file_states_but_not_the_facts(monkeypatch):
    """A file rigbook.core.managed wrote is known as written; a fact may depend on it (an apt pin
    changes what apt-cache policy says), so facts are read again."""
    changes = [(0, 0)]
    monkeypatch.setattr(runfacts, "_changes", lambda *_: changes[0])
    fact = managed.FileStates

    def body():
        yield runfacts.once(fact, paths=("/a",))
        yield managed.state_of("/etc/x")
        changes[0] = (1, 0)  # one of this module's operations wrote a file
        yield runfacts.once(fact, paths=("/a",))
        yield managed.state_of("/etc/x")

    facts = {"FileStates": lambda paths: {path: None for path in paths}}
    answers, fake = run(body, facts, ("/etc/x",))
    assert [kwargs["paths"] for _, kwargs in fake.asked] == [("/a",), ("/etc/x", "/etc", "/"),
                                                             ("/a",)]


def test_a_body_run_while_planning_records_nothing():
    """Without -y pyinfra runs an operation's body while it plans, and the power unit's
    operation consumes its file commands whole: nothing is written then, so the execution must
    still upload (seen in the fleet-cap-change runbook)."""
    fake = FakeHost({"FileStates": file_states({"/etc/a": "old"})})
    state = State(Inventory((["rig1"], {})), Config())
    with ctx_state.use(state), ctx_host.use(fake):
        planned = list(managed.text_commands("new", "/etc/a"))
        state.is_executing = True
        executed = list(managed.text_commands("new", "/etc/a"))
    assert [describe(c) for c in planned] == [describe(c) for c in executed] == [
        "upload /etc/a", "chmod 644 /etc/a"]


def converge_here(tmp_path, monkeypatch, deploy) -> list[tuple[str, ...]]:
    """A real pyinfra run over @local (its commands run here, on what the test made in
    tmp_path): the paths of each file-state read while it executed."""
    reads: list[tuple[str, ...]] = []
    command = managed.FileStates.command
    monkeypatch.setattr(managed.FileStates, "command",
                        lambda self, paths: reads.append(paths) or command(self, paths))
    inventory = Inventory((["@local"], {}))
    state = State(inventory, Config())
    connect_all(state)
    with ctx_state.use(state), ctx_host.use(inventory.get_host("@local")):
        deploy()
    reads.clear()  # what planning read (the bodies run while pyinfra diffs)
    run_ops(state)
    assert all(meta.is_complete() and meta.did_succeed()
               for ops in state.ops.values() for meta in
               (data.operation_meta for data in ops.values()))
    return reads


def test_a_changed_template_keeps_the_other_file_states(tmp_path, monkeypatch):
    """A template is written by managed's own write: like a put, the file states it leaves are
    known, so the files after it are compared without another read (before, a changed template
    made the next file read every state again)."""
    (tmp_path / "same").write_text("same\n")
    (tmp_path / "unit").write_text("old\n")
    source = tmp_path / "unit.j2"
    source.write_text("{{ word }}\n")

    def deploy():
        managed.put(str(tmp_path / "same"), str(tmp_path / "copy"))
        render.template(str(source), str(tmp_path / "unit"), word="new", name="Write the unit")
        managed.put(str(tmp_path / "same"), str(tmp_path / "later"))

    assert converge_here(tmp_path, monkeypatch, deploy) == []
    assert (tmp_path / "unit").read_text() == "new\n" and (tmp_path / "later").exists()


def test_another_operation_that_changed_the_rig_sends_the_next_file_to_the_rig(
        tmp_path, monkeypatch):
    """The same run with a shell step instead of the template: what it changed is unknown, so
    the next file is read again (what the template test would see if its write were not
    managed's)."""
    (tmp_path / "same").write_text("same\n")

    def deploy():
        managed.put(str(tmp_path / "same"), str(tmp_path / "copy"))
        server.shell(name="Something else", commands=[f"touch {tmp_path}/elsewhere"])
        managed.put(str(tmp_path / "same"), str(tmp_path / "later"))

    reads = converge_here(tmp_path, monkeypatch, deploy)
    assert len(reads) == 1 and str(tmp_path / "later") in reads[0]


def test_a_path_refused_while_planning_fails_that_rig_alone_and_the_other_converges(tmp_path):
    """A folder where rigbook's file goes, found while the deploy is planned (without -y, and
    --dry): that rig is refused then, nothing planned for it runs, and the other rig's run goes
    on (raising there, as before, aborted the whole run). rig1 is never connected: it answers
    from a stand-in read; @local runs its commands here, in tmp_path."""
    (tmp_path / "source").write_text("x\n")
    dest = str(tmp_path / "dest")
    inventory = Inventory((["rig1", "@local"], {}))
    state = State(inventory, Config())
    refused, here = inventory.get_host("rig1"), inventory.get_host("@local")
    here.connect()
    for host in (refused, here):
        state.activate_host(host)
    refused.get_fact = lambda fact, paths: {path: managed.FileState("directory", 0o755)
                                            for path in paths}
    for host in (refused, here):
        with ctx_state.use(state), ctx_host.use(host):
            managed.put(str(tmp_path / "source"), dest, mode="644", name="Install dest")
    assert state.failed_hosts == {refused} and set(state.active_hosts) == {here}
    assert messages.REASONS[state] == {
        "rig1": f"refused: {dest} is a directory, not a file: rigbook will not replace it"}
    run_ops(state)
    assert (tmp_path / "dest").read_text() == "x\n"
