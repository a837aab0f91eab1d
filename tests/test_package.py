"""A real install: the wheel built from this checkout, in a fresh venv outside it.

The release files are what `python -m build` makes (an sdist and a wheel, checked by twine).
The venv gets rigbook from the wheel alone (pip --no-deps --no-index); its dependencies are the
ones this test run already has, reached through a .pth file, so nothing is downloaded. The
commands then run from a folder outside the checkout, where neither roles/ nor files/ can be
found by accident: everything rigbook reads must be package data.
"""

from __future__ import annotations

import json
import runpy
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from rigbook.docs import generated_docs
from tests.conftest import ROOT, SANDBOX_INVENTORY, made_once, run_pyinfra
from tests.test_spec import listener  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The sdist and the wheel `python -m build` makes of this checkout, as a release has them
    (built once for the run, which its xdist workers share)."""

    def make(base: Path) -> None:
        # Built from a copy of the tracked files (what a fresh clone has): a build in the
        # checkout leaves build/ there, whose stale modules would slip into the next wheel.
        tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                                 check=True).stdout.decode().split("\0")
        for name in filter(None, tracked):
            (base / "src" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, base / "src" / name)
        built = subprocess.run(
            [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(base / "dist"),
             str(base / "src")], capture_output=True, text=True, timeout=300,
        )
        assert built.returncode == 0, built.stdout + built.stderr

    return made_once(tmp_path_factory, "package", make) / "dist"


def fresh_venv(where: Path, package: Path) -> Path:
    """A venv with rigbook from the wheel `package` alone (no index, no dependencies): its bin
    folder."""
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    site = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True).stdout.strip()
    # this run's dependencies; .pth files inside that folder (our editable install) are not run
    (Path(site) / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
         str(package)], capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return venv / "bin"


@pytest.fixture(scope="module")
def installed(dist, tmp_path_factory) -> Path:
    """The fresh venv's bin folder, with rigbook installed from its wheel."""
    (wheel,) = dist.glob("rigbook-*.whl")
    return fresh_venv(tmp_path_factory.mktemp("wheel"), wheel)


def run(bin_dir: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(bin_dir / "rigbook"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def from_sdist(dist, tmp_path_factory) -> Path:
    """A fresh venv's bin folder with rigbook from the sdist (its wheel built by this run's
    setuptools, as pip would build it)."""
    (sdist,) = dist.glob("rigbook-*.tar.gz")
    base = tmp_path_factory.mktemp("sdist")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index",
                            "--no-build-isolation", "-w", str(base / "wheel"), str(sdist)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    return fresh_venv(base, next((base / "wheel").glob("*.whl")))


def test_the_release_files_pass_twine_check_and_the_sdist_installs_too(dist, from_sdist,
                                                                       tmp_path):
    checked = subprocess.run([sys.executable, "-m", "twine", "check", "--strict",
                              *map(str, sorted(dist.iterdir()))], capture_output=True, text=True)
    assert checked.returncode == 0 and checked.stdout.count("PASSED") == 2, checked.stdout
    version = run(from_sdist, "--version", cwd=tmp_path)
    assert version.stdout.strip() == f"rigbook {_project_version()}", version
    assert _fleet(from_sdist, tmp_path).joinpath("docs", "recipes.md").is_file()


def _project_version() -> str:
    """The one version: pyproject.toml's, which the installed package reports."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_the_wheel_holds_one_import_name_and_its_data(installed, tmp_path):
    where = subprocess.run(
        [str(installed / "python"), "-c",
         "import rigbook, rigbook.files; from rigbook import FILES; "
         "from rigbook.sandbox import SIM_DIR; print(rigbook.__file__); print(FILES); "
         "print(SIM_DIR); import importlib.util as u; print(u.find_spec('roles'))"],
        cwd=tmp_path, capture_output=True, text=True, check=True).stdout.splitlines()
    venv = str(installed.parent)
    assert all(line.startswith(venv) for line in where[:3]), where
    assert where[3] == "None"  # no `roles` package to shadow a user's own
    files = Path(where[1])
    for data in ("serving/rigbook-serve.service.j2", "venvs/pins.toml", "models/pull.py",
                 "recipes/dual-3090-tp2.toml", "guards/rigbook-xid-watch"):
        assert (files / data).is_file(), data
    assert (Path(where[2]) / "nvidia-smi").is_file()


def test_help_version_and_docs_check_run_outside_the_checkout(installed, tmp_path):
    assert "status" in run(installed, "--help", cwd=tmp_path).stdout
    version = run(installed, "--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.strip() == f"rigbook {_project_version()}"
    checked = run(installed, "docs", "--check", "--dir", str(ROOT / "docs"), cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    nowhere = run(installed, "docs", "--check", cwd=tmp_path)  # no docs/ here: a usage error
    assert nowhere.returncode == 3 and "no docs folder docs" in nowhere.stderr


@pytest.mark.sandbox
def test_status_of_sandbox_rigs_from_the_installed_package(installed, sandbox, tmp_path):
    done = run(installed, "status", str(ROOT / SANDBOX_INVENTORY), "--json", "--limit", "rig2",
               cwd=tmp_path)
    assert done.returncode in (0, 1, 2), done.stderr  # a verdict on the rig, not an error
    (rig,) = json.loads(done.stdout)["rigs"]
    assert rig["name"] == "rig2" and rig["state"] != "unreachable", rig
    assert rig["error"] is None and rig["driver"] is not None, rig  # its facts were read


def _fleet(installed: Path, where: Path) -> Path:
    """`rigbook init fleet` in `where`, as a user who installed the wheel runs it."""
    made = run(installed, "init", "fleet", cwd=where)
    assert made.returncode == 0, made.stderr
    return where / "fleet"


def test_init_writes_a_fleet_folder_and_never_overwrites_it(installed, tmp_path):
    fleet = _fleet(installed, tmp_path)
    names = {str(path.relative_to(fleet)) for path in fleet.rglob("*") if path.is_file()}
    (tmp_path / "bare").mkdir()  # no role pages: the docs generated whole, as init writes them
    generated = {f"docs/{path.name}" for path in generated_docs(tmp_path / "bare")}
    assert names == {"config.py", "inventory.py", "group_data/all.py", "README.md", ".gitignore",
                     *generated} and "docs/host-data.md" in generated
    assert "secrets/" in (fleet / ".gitignore").read_text()
    assert (fleet / "secrets").stat().st_mode & 0o077 == 0
    assert run(installed, "docs", "--check", cwd=fleet).returncode == 0  # docs of this install
    validated = subprocess.run(
        [str(installed / "python"), "-c", "from rigbook.inventory import load_rigs; "
         "print(sorted(load_rigs('inventory.py')))"], cwd=fleet, capture_output=True, text=True)
    assert validated.stdout.strip() == "['rig-dual3090']", validated.stderr
    (fleet / "inventory.py").write_text("mine\n")
    again = run(installed, "init", "fleet", cwd=tmp_path)
    assert again.returncode == 3 and "nothing was written" in again.stderr, again
    assert (fleet / "inventory.py").read_text() == "mine\n"


@pytest.mark.parametrize("where", ["the fleet folder", "another folder"])
@pytest.mark.parametrize("bad", [True, False], ids=["a bad value", "good data (the control)"])
def test_a_bad_value_in_an_init_folder_is_refused_before_any_connection(
        installed, tmp_path, listener, where, bad):  # noqa: F811
    """The folder's inventory ends with rigbook's check: from the folder (config.py too) and
    from anywhere else, bad data connects to nothing; good data does reach the listener."""
    fleet = _fleet(installed, tmp_path)
    inventory = fleet / "inventory.py"
    text = inventory.read_text().replace(
        '"ssh_hostname": "192.0.2.21",',
        f'"ssh_hostname": "127.0.0.1", "ssh_port": {listener.port}, "ssh_connect_retries": 0,')
    if bad:
        text = text.replace('"gpu_count": 2,', '"gpu_count": 99,')
    inventory.write_text(text)
    cwd = fleet if where == "the fleet folder" else tmp_path
    proc = subprocess.run(
        [str(installed / "python"), "-m", "pyinfra", "-y", str(inventory),
         "rigbook.jobs.converge"], cwd=cwd, capture_output=True, text=True, timeout=120)
    if bad:
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "rig-dual3090: gpu_count: Input should be less than or equal to 8" in proc.stderr
        assert listener.connections == 0
    else:
        assert listener.connections > 0, proc.stderr[-3000:]


@pytest.mark.sandbox
@pytest.mark.parametrize("release", ["wheel", "sdist"])
def test_a_fleet_folder_converges_a_sandbox_rig_with_the_packaged_job(request, release, sandbox,
                                                                       tmp_path):
    """pip install (of the wheel, of the sdist), `rigbook init`, the rig's data pasted in,
    `pyinfra inventory.py rigbook.jobs.converge` twice: the second run changes nothing."""
    installed = request.getfixturevalue({"wheel": "installed", "sdist": "from_sdist"}[release])
    fleet = _fleet(installed, tmp_path)
    name, data = next(rig for rig in runpy.run_path(str(ROOT / SANDBOX_INVENTORY))["sandbox_rigs"]
                      if rig[0] == "rig2")
    inventory = fleet / "inventory.py"
    head, _, tail = inventory.read_text().partition("rigs = [")
    inventory.write_text(f"{head}rigs = [({name!r}, {data!r})]\n\ncheck_before_connecting()\n")
    python = (str(installed / "python"), "-m", "pyinfra")
    first = run_pyinfra("inventory.py", "rigbook.jobs.converge", cwd=fleet, pyinfra=python)
    assert first.returncode == 0 and first.results, first.explain()
    second = run_pyinfra("inventory.py", "rigbook.jobs.converge", cwd=fleet, pyinfra=python)
    assert second.returncode == 0 and second.results, second.explain()
    assert second.changed() == {}, second.changed()
    status = run(installed, "status", "--json", cwd=fleet)  # no path: the folder's inventory
    (rig,) = json.loads(status.stdout)["rigs"]
    assert rig["name"] == "rig2" and rig["state"] == "as-declared", rig
