"""Sandbox stand-ins for what a real rig gets from the internet: wheels and model weights.

Rigs in the sandbox have no route out. The runbooks' `sh sandbox` blocks and the end-to-end
tests use these instead of an index or the hub:

    python -m tests.standins wheels six==1.16.0     # into the wheelhouse the rigs install from
    python -m tests.standins serving RIG            # the CPU llama.cpp engine's wheels, and the
                                                    # tiny model in RIG's Hugging Face cache

Debian packages a test installs on a rig (unattended-upgrades: tests/test_unattended_e2e.py)
come from Debian's archive through this machine's apt (`debian_subset`), as a flat repository
that the rig's own apt installs from.

llama-cpp-python is an sdist only: `wheelhouse_for_llama` builds it once into the wheelhouse
(a small CPU-only build; about 4.5 minutes on 2 cores) and downloads its server's dependencies
for the rigs' Python 3.11. The tiny model is placed in the rig's cache exactly as a completed
rigbook pull leaves it (tests/tinymodel.py makes the same bytes every time).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rigbook.core.tools import TOOLS_PINS
from rigbook.rigside.hfcache import snapshot_dir
from rigbook.roles.recipes import gguf_patterns
from rigbook.sandbox import rigs, wheelhouse
from tests.tinymodel import FILE, REPO, cache_layout, pull_manifest, revision_of, write_tiny_gguf

LLAMA = "llama-cpp-python==0.3.36"
LLAMA_SERVER = "llama-cpp-python[server]==0.3.36"
#: A small CPU-only build: no native tuning (the wheel runs on any x86_64), no OpenMP runtime
#: to carry, no multimodal library, tools, examples, tests, server binary or TLS.
CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF "
    "-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF "
    "-DLLAMA_OPENSSL=OFF"
)
CACHE = "/var/lib/rigbook/hf/hub"
#: Where the tiny model is written on this machine (the same bytes every time).
TINY_GGUF = wheelhouse().parent / "tiny-model" / FILE


@contextmanager
def filling(house: Path | None = None) -> Iterator[Path]:
    """The wheelhouse (or `house`), filled by one process at a time: the unit tier's xdist
    workers, and other test runs on this machine, fill it at once, and pip writes a download
    in place (another pip would read half a wheel)."""
    house = wheelhouse() if house is None else house
    house.mkdir(parents=True, exist_ok=True)
    with open(house / ".filling.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield house


def pip(*args: str, timeout: int = 600, env: dict | None = None) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def fill_wheelhouse(*extra: str) -> None:
    """Wheels the rigs install from: the tools, two versions of a light package, and `extra`."""
    download = [
        sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
        "--only-binary=:all:", "--python-version", "3.11", "--platform", "manylinux2014_x86_64",
        "--platform", "manylinux_2_17_x86_64", "--dest", str(wheelhouse()),
    ]
    with filling():
        for requirements in (
            [f"{name}=={version}" for name, version in TOOLS_PINS.items()],
            ["six==1.16.0"],
            ["six==1.17.0"],
            *([list(extra)] if extra else []),
        ):
            subprocess.run([*download, *requirements], check=True, timeout=600,
                           capture_output=True, text=True)


def wheelhouse_for_llama() -> float:
    """Fill the wheelhouse for the engine venv; returns the seconds spent building the wheel."""
    with filling() as house:
        built = 0.0
        if not list(house.glob("llama_cpp_python-0.3.36-*.whl")):
            with tempfile.TemporaryDirectory() as tmp:
                pip("download", "--no-deps", "--no-binary=:all:", LLAMA, "-d", tmp)
                sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
                env = {**os.environ, "CMAKE_ARGS": CMAKE_ARGS,
                       "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
                start = time.monotonic()
                pip("wheel", "--no-deps", "-w", str(house), str(sdist), timeout=3600, env=env)
                built = time.monotonic() - start
        platforms = (
            "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
            "linux_x86_64",
        )
        pip(
            "download", "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
            "--abi", "cp311", *(f"--platform={p}" for p in platforms), "--find-links", str(house),
            "-d", str(house), LLAMA_SERVER,
            *(f"{name}=={version}" for name, version in TOOLS_PINS.items()),
        )
        return built


#: Debian packages for the rigs, downloaded once with this machine's apt (Debian 12, as the rigs).
DEBIAN_DEBS = wheelhouse().parent / "debian-debs"


def debian_subset(package: str, installed: set[str]) -> bytes:
    """A flat apt repository (a tar of the .debs and their Packages index) of `package` and what
    a rig lacks of its dependencies, from Debian's archive through this machine's apt; apt on
    the rig then resolves the install itself. Downloaded once into DEBIAN_DEBS."""
    tree = subprocess.run(
        ["apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests",
         "--no-conflicts", "--no-breaks", "--no-replaces", "--no-enhances", package],
        capture_output=True, text=True, check=True).stdout
    names = sorted({line for line in tree.splitlines()
                    if line and not line.startswith((" ", "<"))} - installed)
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        DEBIAN_DEBS.mkdir(parents=True, exist_ok=True)
        for name in names:
            if not list(DEBIAN_DEBS.glob(f"{name}_*.deb")):
                subprocess.run(["apt-get", "download", "-q", name], cwd=DEBIAN_DEBS, check=True,
                               capture_output=True, timeout=600)
            for deb in DEBIAN_DEBS.glob(f"{name}_*.deb"):
                (repo / deb.name).write_bytes(deb.read_bytes())
        index = subprocess.run(["dpkg-scanpackages", "--multiversion", "."], cwd=repo,
                               capture_output=True, text=True, check=True).stdout
        (repo / "Packages").write_text(index)
        return subprocess.run(["tar", "-c", "-C", tmp, "."], capture_output=True,
                              check=True).stdout


def ssh_with_input(rig: dict, command: str, data: bytes) -> None:
    done = subprocess.run(
        ["ssh", "-i", rig["ssh_key"], "-o", "StrictHostKeyChecking=no",
         "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "BatchMode=yes",
         f"root@{rig['address']}", command],
        input=data, capture_output=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode()


def place_model(rig: dict, gguf: Path, revision: str) -> None:
    """The tiny model in the rig's HF cache exactly as a completed rigbook pull leaves it."""
    layout = cache_layout(gguf, revision)
    data = gguf.read_bytes()
    top = f"{CACHE}/{layout['blob'].split('/')[0]}"
    ssh_with_input(rig, f"mkdir -p {top}/blobs && cat > {CACHE}/{layout['blob']}", data)
    snapshot = snapshot_dir(CACHE, REPO, revision)
    ssh_with_input(
        rig,
        f"mkdir -p {snapshot} {top}/refs {top}/rigbook && "
        f"ln -sfn {layout['target']} {CACHE}/{layout['link']} && "
        f"echo {revision} > {CACHE}/{layout['ref']} && cat > {top}/rigbook/{revision}.json",
        pull_manifest(gguf, revision, list(gguf_patterns(FILE))),  # a GGUF: its file
    )


def tiny_model() -> tuple[Path, str]:
    """The tiny GGUF on this machine and its revision, written once."""
    with filling():
        if not TINY_GGUF.exists():
            TINY_GGUF.parent.mkdir(parents=True, exist_ok=True)
            write_tiny_gguf(TINY_GGUF)
    return TINY_GGUF, revision_of(TINY_GGUF)


def main(argv: list[str]) -> int:
    if argv[:1] == ["wheels"]:
        fill_wheelhouse(*argv[1:])
    elif argv[:1] == ["serving"] and len(argv) == 2:
        rig = next(entry for entry in rigs() if entry["name"] == argv[1])
        wheelhouse_for_llama()
        gguf, revision = tiny_model()
        place_model(rig, gguf, revision)
        print(f"{REPO}@{revision} placed in {rig['name']}'s Hugging Face cache")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
