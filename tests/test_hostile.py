"""Hostile host data: every value is refused before any connection, or rendered inert.

One table of values a careful attacker (or a bad paste) would try, across every free-text,
path, URL, address, number and flag field of host data and recipes: control characters,
quotes, `$()`, backticks, `%`, newlines, scope ids, leading dashes, path traversal, look-alike
Unicode, huge and negative numbers, wrong types. Each refused value is a host of one inventory
that the real pyinfra CLI is run on, every host pointing at a counting loopback listener: the
run must exit 1 naming every host, and the listener must count no connection. Each value that
is accepted must come out of the renderer inert: read back by the format's own rules as the
value itself, with no extra line, directive or variable.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest

from rigbook.core.render import env_line, one_line, systemd_word, unit_text
from rigbook.core.spec import parse_rig
from tests.conftest import PYINFRA, ROOT
from tests.test_spec import GOOD, listener  # noqa: F401  (the counting loopback listener)

NL = "\n"
#: (key, value) -> refused before connecting. Each becomes one host of the inventory.
REFUSED = [
    # control characters and newlines in every kind of text
    ("driver_version", "580.95.05\n"), ("driver_version", "580.95.05\nTrusted: yes"),
    ("driver_repo_uri", "http://mirror/\nTrusted: yes"), ("driver_repo_uri", "http://mir ror/"),
    ("driver_repo_uri", "http://user:pw@mirror/"), ("driver_repo_uri", "ftp://mirror/"),
    ("driver_repo_uri", "file:/srv/../etc"), ("driver_repo_uri", "http://mirror/\"x\""),
    ("driver_repo_uri", "http://mirror/`id`"),
    ("driver_repo_uri", "javascript:alert(1)"),
    ("driver_modprobe_options", {"NVreg_X": "1\noptions evil x=1"}),
    ("driver_modprobe_options", {"NVreg X": "1"}),
    ("driver_modprobe_options", {"NVreg_X": "$(id)"}),
    ("driver_modprobe_options", {"NVreg_X": "a#b"}), ("driver_modprobe_options", {"-X": "1"}),
    ("shm_size", "2G\n"), ("shm_size", "2G; rm -rf /"), ("shm_size", "-2G"), ("shm_size", "2T"),
    ("shm_size", "１G"),  # a full-width digit: looks like 1G
    ("sysctl_extra", {"vm.x\n": 1}), ("sysctl_extra", {"vm.x": "1\nkernel.y = 2"}),
    ("sysctl_extra", {"vm.x": "1 # 2"}), ("sysctl_extra", {"vm.x": "$(id)"}),
    ("sysctl_extra", {"../../etc/passwd": 1}), ("sysctl_extra", {"vm.x": "'1'"}),
    ("stale_files", ["/etc/x\n/etc/y"]), ("stale_files", ["/etc/../root/.ssh/id_rsa"]),
    ("stale_files", ["etc/x"]), ("stale_files", ["/tmp/$(id)"]), ("stale_files", ["/tmp/a b"]),
    ("stale_files", ["/tmp/`id`"]), ("stale_files", ["/tmp/'x'"]), ("stale_files", ["/"]),
    ("stale_files", ["/etc/ｓhadow"]),  # look-alike: a full-width s
    # leftovers only in the folders leftovers live in, never rigbook's own
    ("stale_files", ["/etc/passwd"]), ("stale_files", ["/etc/shadow"]),
    ("stale_files", ["/boot/vmlinuz"]), ("stale_files", ["/dev/sda"]),
    ("stale_files", ["/etc/sysctl.d/../passwd"]), ("stale_files", ["/etc/sysctl.d"]),
    ("stale_files", ["/etc/sysctl.d/"]), ("stale_files", ["/etc/sysctl.d//x.conf"]),
    ("stale_files", ["/etc/systemd/system/multi-user.target.wants/ssh.service"]),
    ("stale_files", ["/etc/systemd/system/x.service.d"]), ("stale_files", ["/root/.ssh/x"]),
    ("stale_files", ["/etc/sysctl.d/90-rigbook.conf"]), ("stale_files", ["/etc/sysctl.d/.x"]),
    ("models_cache", "/var/lib/hf\nLD_PRELOAD=/tmp/x.so"), ("models_cache", "relative/hub"),
    ("models_cache", "/var/lib/../../etc"), ("models_cache", "/var/lib/hf%h"),
    ("models_cache", "/var/lib/hf$HOME"), ("models_cache", "-/var/lib/hf"),
    # a cache the engine's user (or a login) can write: root's pulls and the engines trust it
    ("models_cache", "/var/lib/rigbook-serve/hub"), ("models_cache", "/var/lib/rigbook-serve"),
    ("models_cache", "/home/alice/.cache/huggingface/hub"), ("models_cache", "/run/user/1000"),
    ("models_endpoint", "http://mirror:8080/\n"), ("models_endpoint", "https://u:p@mirror/"),
    ("models_endpoint", "file:///etc"), ("models_endpoint", "http://"),
    ("models_token_file", "hf_abcdefghijklmnopqrstuvwxyz012345"),
    ("models_token_file", "/tmp/token\n"),
    ("models", [{"repo": "org/name\n", "revision": "a" * 40}]),
    ("models", [{"repo": "../etc", "revision": "a" * 40}]),
    ("models", [{"repo": "org/name", "revision": "A" * 40}]),
    ("models", [{"repo": "org/name", "revision": "a" * 40, "allow_patterns": ["-x"]}]),
    ("models", [{"repo": "org/name", "revision": "a" * 40, "allow_patterns": ["*\n*"]}]),
    ("models_only", "org/name\n"),
    ("python_find_links", "/srv/wheels\n--index-url http://evil/"),
    ("python_find_links", "--index-url=http://evil/"), ("python_find_links", "ftp://x/"),
    ("venvs", [{"name": "v", "engine": "none", "packages": ["six=="]}]),
    ("venvs", [{"name": "v", "engine": "none", "packages": ["==1.16.0"]}]),
    ("venvs", [{"name": "v", "engine": "none", "packages": ["--index-url=http://evil/"]}]),
    ("venvs", [{"name": "v", "engine": "none", "packages": ["-e ."]}]),
    ("venvs", [{"name": "v", "engine": "none", "packages": ["six>=1.0"]}]),
    ("venvs", [{"name": "v", "engine": "none", "packages": ["six @ http://evil/six.whl"]}]),
    ("venvs", [{"name": "v", "engine": "none", "packages": ["six==1.16.0\nevil==1"]}]),
    ("venvs", [{"name": "../v", "engine": "none", "packages": ["six==1.16.0"]}]),
    ("venvs", [{"name": "v", "engine": "none", "packages": ["six==1.16.0"],
                "services": ["x.service\nExecStartPre=+/bin/sh"]}]),
    ("venvs", [{"name": "v", "engine": "none", "packages": ["six==1.16.0"],
                "services": ["-x.service"]}]),
    ("venvs", [{"name": "v", "engine": "none", "packages": ["six==1.16.0"],
                "extra_index_urls": ["http://u:p@index/"]}]),
    ("guards_shm_patterns", ["vllm_*\n"]), ("guards_shm_patterns", ["../x*"]),
    ("guards_shm_patterns", ["-rf"]), ("guards_shm_patterns", ["*"]),
    ("guards_shm_patterns", ["s*"]), ("guards_shm_patterns", ["[v]llm*"]),
    ("guards_shm_patterns", ["vllm_offload_*.mmap", "*.mmap"]),
    ("guards_shm_patterns", ["vllm$(id)*"]), ("guards_shm_patterns", "vllm_offload_*.mmap"),
    ("guards_shm_patterns", [5]),
    # addresses
    ("serving_bind", "::1%eth0"), ("serving_bind", "fe80::1%25lo"), ("serving_bind", "lan"),
    ("serving_bind", "127.0.0.1\n"), ("serving_bind", "0.0.0.0"),  # wide without a key
    ("models_mirror_bind", "fe80::1%eth0"), ("models_mirror_bind", "rig-a.lan"),
    ("models_mirror_bind", "$(id)"), ("models_mirror_bind", "-10.0.0.5"),
    ("models_mirror_bind", "10.0.0.5\n"), ("models_mirror_bind", "１0.0.0.5"),
    ("models_mirror_bind", 167772165), ("models_mirror_bind", ["10.0.0.5"]),
    ("models_mirror_bind", "0.0.0.0"), ("models_mirror_bind", "::"),  # every network at once
    ("models_mirror_bind", "224.0.0.1"), ("models_mirror_bind", "10.0.0.5"),  # no port
    # the mirror and its pulls without the fleet's token, and bad token files
    ("models_mirror_port", 8090), ("models_endpoint", "http://10.0.0.5:8090"),
    ("models_mirror_token_file", "/tmp/fleet-token\n"), ("models_mirror_token_file", "-/t"),
    ("models_mirror_token_file", "/no/such/fleet-token"),
    ("verify_url", "http://rig:8000\n"), ("verify_url", "http://user:pw@rig:8000"),
    # names and files on this machine
    ("recipe", "no-such-recipe"), ("recipe", "dual-3090-tp2\n"), ("recipe", "../x"),
    ("serving_api_key_file", "/tmp/key\n"), ("serving_api_key_file", "-/tmp/key"),
    ("serving_recipe_dirs", ["/no/such/folder"]), ("serving_recipe_dirs", ["/tmp/a\nb"]),
    # power and GPU keys
    ("power_caps", {"01": 300}), ("power_caps", {"GPU-nope": 300}), ("power_caps", {"-1": 300}),
    ("power_caps", {"0": -5}), ("power_caps", {"0": True}), ("power_caps", {"5": 300}),
    ("power_cap_watts", -5), ("power_cap_watts", 0), ("power_cap_watts", "300"),
    ("power_cap_watts", 3.5), ("power_cap_watts", True),
    ("nvlink", 1), ("nvlink", "yes"),
    # wrong types and out-of-range numbers
    ("gpu_count", True), ("gpu_count", 0), ("gpu_count", 10**12), ("gpu_count", -1),
    ("gpu_count", "2"), ("allow_reboot", "yes"), ("allow_reboot", 1), ("driver_branch", 590),
    ("wsl_tdr_delay", 10**9), ("serving_port", 22), ("serving_port", 70000),
    ("sysctl_inotify_max_user_watches", -1), ("models_mirror_port", "8080"),
    # numbers no rig can take, and keys that contradict the rest of the host data
    ("power_cap_watts", 10**6), ("power_caps", {"0": 1}), ("serving_max_model_len", 10**12),
    ("sysctl_inotify_max_user_watches", 2**40), ("verify_needle_fill", True),
    ("serving_gpu_memory_utilization", "0.9"), ("wsl_tdr_delay", 30),
    ("driver_version", "595.45.04"), ("driver_repo_trusted", True),
    ("driver_foreign", "Adopt"), ("driver_foreign", "adopt\n"), ("driver_foreign", True),
]
#: Values that are accepted and must render inert (as the formats read them back).
ACCEPTED_ARGS = ["--flag=$(id)", "100%", "a b", 'say "hi"', "back\\slash", "`id`", "$HOME",
                 "-x", ";rm -rf /", "%h%n", "'single'", "ünïcode"]


def _host(number: int, port: int, key: str, value) -> str:
    data = {**GOOD, "ssh_hostname": "127.0.0.1", "ssh_port": port, key: value}
    if key == "nvlink":
        data["gpu_class"] = "a6000"
        data["power_profile"] = "stock"
    return f"    ('h{number:03d}', {data!r}),"


def test_every_hostile_value_is_refused_before_any_connection(tmp_path, listener):  # noqa: F811
    assert len(REFUSED) >= 80
    inventory = tmp_path / "hostile.py"
    inventory.write_text("rigs = [\n" + "\n".join(
        _host(i, listener.port, key, value) for i, (key, value) in enumerate(REFUSED)
    ) + "\n]\n")
    proc = subprocess.run([PYINFRA, "-y", str(inventory), "deploys/rig.py"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert listener.connections == 0
    named = {line.split(":")[0] for line in proc.stderr.splitlines() if line.startswith("h")}
    missed = [(i, key, value) for i, (key, value) in enumerate(REFUSED) if f"h{i:03d}" not in named]
    assert not missed, missed
    # messages say where and what is allowed; they never echo a secret nor dump host data
    assert "hf_abcdefghijklmnop" not in proc.stderr and "u:p@" not in proc.stderr
    assert "ssh_port" not in proc.stderr and "Traceback" not in proc.stderr
    assert "pyinfra error in" not in proc.stderr  # no internal file and line before a refusal


@pytest.mark.parametrize("arg", ACCEPTED_ARGS)
def test_an_accepted_engine_argument_reads_back_unchanged_from_the_unit(arg):
    """systemd.syntax(7): ExecStart= words unquote like a shell's, and %% / $$ are literal."""
    line = "ExecStart=/bin/engine " + systemd_word(arg)
    assert NL not in line
    words = shlex.split(line.removeprefix("ExecStart="))
    assert [word.replace("%%", "%").replace("$$", "$") for word in words] == ["/bin/engine", arg]


@pytest.mark.parametrize("value", ACCEPTED_ARGS)
def test_an_accepted_env_value_reads_back_unchanged_from_the_env_file(value):
    """KEY="value" as sh reads it (systemd's EnvironmentFile= unquotes the same way)."""
    text = env_line("ENGINE_FLAG", value)
    out = subprocess.run(["sh", "-c", f"{text}\nprintf %s \"$ENGINE_FLAG\""],
                         capture_output=True, text=True, check=True, env={})
    assert out.stdout == value and NL not in text


@pytest.mark.parametrize("value", ["a\nb", "x\rExecStartPre=+/bin/sh", "tab\there", "\x1b[31m"])
def test_a_control_character_never_reaches_a_file(value):
    for render in (one_line, unit_text, systemd_word, lambda v: env_line("K", v)):
        with pytest.raises(ValueError):
            render(value)


def test_the_refused_table_is_refused_by_the_models_themselves():
    """The same values, one by one, through parse_rig and the checks that need no rig."""
    from rigbook.core.errors import RigbookError
    from rigbook.inventory import rig_problems

    for key, value in REFUSED:
        data = {**GOOD, key: value}
        if key == "nvlink":
            data.update(gpu_class="a6000", power_profile="stock")
        try:
            rig = parse_rig("h", json.loads(json.dumps(data)) if key != "nvlink" else data)
        except RigbookError:
            continue
        assert rig_problems(rig, "h"), (key, value)


def test_a_hostile_recipe_file_is_refused_with_its_file_and_field(tmp_path):
    from rigbook.core.errors import RigbookError
    from rigbook.roles.recipes import load_recipe

    good = (ROOT / "tests" / "recipes" / "tiny-cpu-a.toml").read_text()
    hostile = {
        "served_name": good.replace(
            'file = "tiny.gguf"', 'file = "tiny.gguf"\nserved_name = "x\\nExecStartPre=+/bin/sh"'),
        "bind": good.replace("[model]", 'bind = "::1%eth0"\n[model]', 1),
        "extra_args": good.replace("[model]", 'extra_args = ["--x\\nExecStartPre=+/bin/sh"]\n'
                                              "[model]", 1),
        "env": good.replace("[model]", 'env = {"A" = "1\\nB=2"}\n[model]', 1),
        "api_key_file": good.replace("[model]", 'api_key_file = "/tmp/k\\n"\n[model]', 1),
    }
    for field, text in hostile.items():
        path = tmp_path / "tiny-cpu-a.toml"
        path.write_text(text)
        with pytest.raises(RigbookError, match=field):
            load_recipe(path)


#: Owned flags in other spellings (issue 29, finding 1): (engine, extra_args, the flag rigbook
#: owns that the engine's parser takes it for). argparse takes any unambiguous prefix of a long
#: flag (allow_abbrev), a single-dash prefix of a single-dash one, and vLLM's parser turns `_`
#: into `-` and `--x.key` into `--x` (docs/sources.md, "Engine flags").
OWNED_SPELLINGS = [
    ("vllm", ["--hos=0.0.0.0"], "--host"),
    ("vllm", ["--hos", "0.0.0.0"], "--host"),
    ("vllm", ["--max_model_len=1048576"], "--max-model-len"),
    ("vllm", ["--gpu_memory_utilization=0.99"], "--gpu-memory-utilization"),
    ("vllm", ["--api-k=x"], "--api-key"),
    ("vllm", ["-tp", "8"], "-tp"),
    ("vllm", ["-t", "8"], "-tp"),
    ("vllm", ["-tp=8"], "-tp"),
    ("vllm", ["--speculative_config.model=/tmp/evil"], "--speculative-config"),
    ("vllm", ["--config", "/tmp/flags.yaml"], "--config"),  # a YAML file of any flags
    ("vllm", ["--enforce-eager", "--host=0.0.0.0"], "--host"),  # the second item is a flag
    ("vllm", ["--", "--port=80"], "--port"),  # "--" is a prefix of every long flag
    ("sglang", ["--hos=0.0.0.0"], "--host"),
    ("sglang", ["--context-len", "1048576"], "--context-length"),
    ("sglang", ["--mem-frac=0.99"], "--mem-fraction-static"),
    ("sglang", ["--tensor-para", "8"], "--tensor-parallel-size"),
    ("sglang", ["--conf", "/tmp/flags.yaml"], "--config"),
    ("llama.cpp", ["--n_gpu_l=-1"], "--n_gpu_layers"),  # on a cpu_only recipe
    ("llama.cpp", ["--n_gpu_l", "-1"], "--n_gpu_layers"),
    ("llama.cpp", ["--hos=0.0.0.0"], "--host"),
    ("llama.cpp", ["--api_k=x"], "--api_key"),
    ("llama.cpp", ["--config_f=/tmp/settings.json"], "--config_file"),
]
#: Spellings the engine's own parser does not take for an owned flag (it exits with a usage
#: error instead): argparse is case-sensitive, and only vLLM maps `_` to `-`.
NOT_OWNED_SPELLINGS = [
    ("vllm", ["--HOST=0.0.0.0"]), ("llama.cpp", ["--Host", "0.0.0.0"]),
    ("llama.cpp", ["--n-gpu-layers=-1"]), ("sglang", ["--context_length=1048576"]),
    ("llama.cpp", ["--n_threads", "-1"]),  # a negative number is a value, not a flag
]


def recipe_text(engine: str, extra_args: list[str]) -> str:
    """A recipe file of the engine with these extra_args (llama.cpp: the cpu_only tiny one)."""
    if engine == "llama.cpp":
        text = (ROOT / "tests" / "recipes" / "tiny-cpu-a.toml").read_text()
    else:
        text = (ROOT / "files" / "recipes" / "dual-3090-tp2.toml").read_text()
        text = text.replace('name = "dual-3090-tp2"', 'name = "tiny-cpu-a"')
    if engine == "sglang":
        text = text.replace('engine = "vllm"', 'engine = "sglang"').replace(
            "max_num_seqs = 8\n", "")
    return text.replace("[model]", f"extra_args = {json.dumps(extra_args)}\n[model]", 1)


@pytest.mark.parametrize(("engine", "extra_args", "owned"), OWNED_SPELLINGS)
def test_an_owned_flag_in_another_spelling_is_refused(tmp_path, engine, extra_args, owned):
    from rigbook.core.errors import RigbookError
    from rigbook.roles.recipes import load_recipe

    path = tmp_path / "tiny-cpu-a.toml"
    path.write_text(recipe_text(engine, extra_args))
    with pytest.raises(RigbookError) as error:
        load_recipe(path)
    assert "extra_args" in str(error.value) and owned in str(error.value), str(error.value)


@pytest.mark.parametrize(("engine", "extra_args"), NOT_OWNED_SPELLINGS)
def test_a_spelling_the_engine_does_not_take_for_an_owned_flag_is_not_refused_as_one(
        tmp_path, engine, extra_args):
    from rigbook.roles.recipes import load_recipe

    path = tmp_path / "tiny-cpu-a.toml"
    path.write_text(recipe_text(engine, extra_args))
    assert load_recipe(path).extra_args == tuple(extra_args)


def test_argparse_itself_takes_each_refused_spelling_for_the_owned_flag():
    """The refused llama.cpp and SGLang spellings, parsed by the standard library's argparse
    with the owned flags as the engines declare them: each lands on the owned flag (the engines
    add no normalisation of their own); the not-owned ones land on none."""
    import argparse

    from rigbook.roles.recipes import OWN_FLAGS

    for engine in ("llama.cpp", "sglang"):
        parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
        for flag in OWN_FLAGS[engine]:
            parser.add_argument(flag, dest=flag)
        for spelled, args, owned in OWNED_SPELLINGS:
            if spelled == engine:
                seen, rest = parser.parse_known_args(args)
                assert getattr(seen, owned) is not None and not rest, (args, seen, rest)
        for spelled, args in NOT_OWNED_SPELLINGS:
            if spelled == engine:
                seen, rest = parser.parse_known_args(args)
                assert not any(vars(seen).values()) and rest, (args, seen)


def hostile_cpu_rig(recipe_dir):
    """A rig serving the recipe `hostile-cpu` from recipe_dir (the tiny CPU engine's venv)."""
    from rigbook.core.spec import Rig

    return Rig.model_validate({
        "platform": "debian", "gpu_class": "rtx3090", "gpu_count": 2, "recipe": "hostile-cpu",
        "serving_recipe_dirs": [str(recipe_dir)],
        "venvs": [{"name": "tiny-cpu", "engine": "llama-cpp-python", "python": "3.11",
                   "packages": ["llama-cpp-python[server]==0.3.36"]}],
        "models": [{"repo": "local/tiny", "revision": "1" * 40}],
    })


def test_a_wide_bind_through_a_prefix_is_refused_before_the_plan(tmp_path):
    """The issue's case: `--hos=0.0.0.0` in a serving_recipe_dirs recipe; the plan reported bind
    127.0.0.1 and asked for no key while the engine listened everywhere."""
    from rigbook.core.errors import RigbookError
    from rigbook.roles.serving import serve_plan

    (tmp_path / "hostile-cpu.toml").write_text(
        recipe_text("llama.cpp", ["--hos=0.0.0.0"]).replace('"tiny-cpu-a"', '"hostile-cpu"'))
    with pytest.raises(RigbookError, match="extra_args: --hos .*--host"):
        serve_plan(hostile_cpu_rig(tmp_path), "rig1")
# --- the cwd cases: the check before connecting holds wherever pyinfra runs from ------------

#: Bad data a run from another folder must refuse before connecting (finding 6).
CWD_BAD = [("gpu_count", "0", "gpu_count: Input should be greater than or equal to 1"),
           ("coolng", "air", "coolng: unknown key (did you mean cooling?")]


def _elsewhere(tmp_path, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """pyinfra run from a folder without rigbook's config.py (a fresh one under tmp_path)."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir(exist_ok=True)
    return subprocess.run([PYINFRA, "-y", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize(("key", "value", "message"), CWD_BAD)
@pytest.mark.parametrize("how", ["absolute paths", "--chdir to the repository",
                                 "--chdir to another folder"])
def test_bad_data_from_another_folder_connects_to_nothing(tmp_path, listener, how, key, value,  # noqa: F811
                                                          message):
    """`pyinfra /abs/inventory/rigs.py /abs/deploys/rig.py` from anywhere: the inventory
    module runs the check itself (config.py is loaded only from the working folder)."""
    paths = ([str(ROOT / "inventory/rigs.py"), str(ROOT / "deploys/rig.py")]
             if how != "--chdir to the repository" else ["inventory/rigs.py", "deploys/rig.py"])
    chdir = {"absolute paths": [], "--chdir to the repository": ["--chdir", str(ROOT)],
             "--chdir to another folder": ["--chdir", str(tmp_path)]}[how]
    proc = _elsewhere(tmp_path, *chdir, *paths, "--limit", "rig-5090",
                      "--data", "ssh_hostname=127.0.0.1", "--data", f"ssh_port={listener.port}",
                      "--data", f"{key}={value}")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"rig-5090: {message}" in proc.stderr, proc.stderr[-3000:]
    assert listener.connections == 0
    assert "Traceback" not in proc.stderr


def test_an_inventory_of_ones_own_that_calls_the_check_connects_to_nothing(tmp_path, listener):  # noqa: F811
    inventory = tmp_path / "mine.py"
    inventory.write_text(
        f"rigs = [('box-a', {{**{GOOD!r}, 'gpu_count': 0, 'ssh_hostname': '127.0.0.1', "
        f"'ssh_port': {listener.port}}})]\n\n"
        "from rigbook.inventory import check_before_connecting\n\ncheck_before_connecting()\n")
    proc = _elsewhere(tmp_path, str(inventory), str(ROOT / "deploys/rig.py"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "box-a: gpu_count: Input should be greater than or equal to 1" in proc.stderr
    assert listener.connections == 0


@pytest.mark.parametrize("deploy", ["rig.py", "a deploy of one's own that includes rig.py"])
def test_a_deploy_whose_hosts_were_not_checked_refuses_at_its_first_line(tmp_path, deploy):
    """Where the check could not run (an inline host, pyinfra run from elsewhere), every rigbook
    deploy refuses the host before it reads or plans anything, and says how to run it."""
    path = str(ROOT / "deploys/rig.py")
    if deploy != "rig.py":
        path = str(tmp_path / "mine.py")
        Path(path).write_text("from pyinfra import local\n\n"
                              f"local.include({str(ROOT / 'deploys/rig.py')!r})\n")
    data = [arg for key, value in GOOD.items() for arg in ("--data", f"{key}={value}")]
    proc = _elsewhere(tmp_path, "--dry", "@local", path, *data)
    assert proc.returncode != 0, proc.stdout[-3000:]
    said = proc.stdout + proc.stderr
    assert "@local: host data not checked before connecting" in said, said[-3000:]
    assert "check_before_connecting()" in said and "docs/preflight.md" in said
    assert "Traceback" not in said and "refused before any change" not in said  # nothing read
