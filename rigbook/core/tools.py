"""rigbook's own tools venv on a rig: pinned uv (builds the serving venvs), huggingface_hub and
nvidia-ml-py.

Roles that need a Python tool on the rig run it from /opt/rigbook/tools, never from the system
Python or a serving venv: the venvs role builds with `UV`, the models role pulls with
huggingface_hub, status reads GPU health through NVML (roles/health.py). The pins are exact so
that every rig builds with the same uv; uv comes from its wheel, which carries the standalone
binary (no `curl | sh`). huggingface_hub brings hf_xet by its own dependency marker wherever a
wheel of it exists (x86_64 and arm64).

Packages come from the rig's package source (python_find_links / python_no_index), the same one
the serving venvs use. The venv is made once (`python3 -m venv`, Debian's python3-venv) and
changed only where an installed version differs from its pin.
"""

from __future__ import annotations

import json

from packaging.utils import canonicalize_name
from pyinfra import host
from pyinfra.api import FactBase, QuoteString, StringCommand, deploy, operation
from pyinfra.api.exceptions import FactProcessError
from pyinfra.operations import apt

from rigbook.core.spec import Rig

TOOLS_VENV = "/opt/rigbook/tools"
TOOLS_PYTHON = f"{TOOLS_VENV}/bin/python"
UV = f"{TOOLS_VENV}/bin/uv"

#: Exact versions in the tools venv (distribution name as pip spells it -> version).
TOOLS_PINS = {"uv": "0.13.9", "huggingface_hub": "2.4.0", "nvidia-ml-py": "13.610.43"}


def package_source_args(rig: Rig) -> list[str]:
    """pip/uv options that point an install at the rig's package source."""
    args: list[str] = []
    if rig.python_no_index:
        args.append("--no-index")
    if rig.python_find_links:
        args += ["--find-links", rig.python_find_links]
    return args


def differing_pins(installed: dict[str, str] | None) -> dict[str, str]:
    """The pins whose installed version differs (all of them when there is no venv)."""
    have = {canonicalize_name(name): version for name, version in (installed or {}).items()}
    return {
        name: version
        for name, version in TOOLS_PINS.items()
        if have.get(canonicalize_name(name)) != version
    }


class ToolsVersions(FactBase[dict[str, str] | None]):
    """
    Distributions installed in the tools venv and their versions; None when there is no venv.

    Reads importlib.metadata with the venv's own Python (what ``pip list`` reports)::

        {"uv": "0.13.9", "huggingface_hub": "2.4.0", "hf-xet": "1.8.0", "pip": "23.0.1", ...}
    """

    def command(self) -> str:
        script = (
            "import json, importlib.metadata as m; "
            "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
        )
        return f'! test -x {TOOLS_PYTHON} || {TOOLS_PYTHON} -c "{script}"'

    def process(self, output: list[str]) -> dict[str, str]:
        try:
            return json.loads("\n".join(output))
        except json.JSONDecodeError as e:
            raise FactProcessError(
                f"tools venv package list is not JSON ({e}): {output!r}"
            ) from None


@operation()
def tools_packages(rig: Rig):
    """
    Make the tools venv and install the pinned tools where the installed version differs.

    + rig: the rig's validated host data (``rigbook.core.spec.Rig``)

    ``python3 -m venv /opt/rigbook/tools`` when it does not exist, then one
    ``pip install uv==X huggingface_hub==Y`` (with ``--no-index`` / ``--find-links`` from
    python_no_index / python_find_links) for the pins that differ; nothing when all match.
    """
    installed = host.get_fact(ToolsVersions)
    if installed is None:
        yield StringCommand("python3", "-m", "venv", QuoteString(TOOLS_VENV))
    todo = differing_pins(installed)
    if not todo:
        host.noop(
            f"{TOOLS_VENV} already holds "
            + ", ".join(f"{name} {version}" for name, version in TOOLS_PINS.items())
        )
        return
    yield StringCommand(
        QuoteString(TOOLS_PYTHON), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
        "--no-input", *(QuoteString(arg) for arg in package_source_args(rig)),
        *(QuoteString(f"{name}=={version}") for name, version in todo.items()),
    )


@deploy("rigbook tools venv")
def tools_venv(rig: Rig) -> None:
    """/opt/rigbook/tools with the pinned tools (python3-venv first on apt hosts)."""
    apt.packages(name="python3-venv (for the tools venv)", packages=["python3-venv"])
    tools_packages(rig, name=f"Pinned tools in {TOOLS_VENV}")
