"""Engine environment variables a recipe or a rig may set: the names rigbook owns, and those
the dynamic loader reads, are refused (one rule for a recipe's `env` and a rig's `serving_env`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

#: Environment rigbook itself owns: a recipe may not set these.
OWN_ENV = (
    "HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_HOME", "CUDA_HOME", "VLLM_API_KEY", "API_KEY",
    "LLAMA_API_KEY", "HOST", "PORT", "MODEL", "CONFIG_FILE", "CUDA_VISIBLE_DEVICES",
)
#: What the dynamic loader and libc read from the environment, which glibc removes for a
#: privileged program (glibc's sysdeps/generic/unsecvars.h; and every LD_*): a recipe's
#: environment reaches every program its unit starts, also the pre-start checks that run as root
#: (before their `env -i`): LD_PRELOAD of a file the engine wrote would run in root's process.
LOADER_ENV = (
    "GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES", "LD_AUDIT", "LD_DEBUG",
    "LD_DEBUG_OUTPUT", "LD_DYNAMIC_WEAK", "LD_HWCAP_MASK", "LD_LIBRARY_PATH", "LD_ORIGIN_PATH",
    "LD_PRELOAD", "LD_PROFILE", "LD_SHOW_AUXV", "LD_USE_LOAD_BIAS", "LOCALDOMAIN", "LOCPATH",
    "MALLOC_TRACE", "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TMPDIR", "TZDIR",
)

ENV_KEY = re.compile(r"[A-Z_][A-Z0-9_]*")


def env_problems(env: Mapping[str, str], key: str = "") -> list[str]:
    """Why each name of an engine environment may not be set (`key`: the field that holds it,
    named first when given)."""
    problems = []
    for name in env:
        if not ENV_KEY.fullmatch(name):
            problems.append(f"{name!r} is not an environment variable name")
        elif name in OWN_ENV:
            problems.append(f"{name} is set by rigbook")
        elif name in LOADER_ENV or name.startswith("LD_"):
            problems.append(f"{name} is read by the dynamic loader or libc of every program "
                            "the unit starts, the root pre-start checks too (docs/serving.md)")
    return [f"{key}: {p}" for p in problems] if key else problems
