"""What a failed start's journal says: the signatures the sources name, recognised in the last
lines the serving role shows, each with what to do (docs/serving.md, Health).

- WSL2's TDR reset (hardware notes, "Note for WSL2 / Windows users"): "RuntimeError: CUDA driver
  error: device not ready" then "!handles_.at(i) INTERNAL ASSERT FAILED at
  CUDACachingAllocator.cpp": "This is not OOM — the engine is being externally reset by the
  Windows display driver mid-kernel".
- vLLM's speculative-decoding metrics line ("SpecDecoding metrics: ... Mean acceptance length:
  3.39"): the failure log's quantised MTP head accepted 1.07-1.27 tokens and bought nothing,
  its draft model 3.7-4.2 (`SpecAcceptance`, read by `rigbook status` for a recipe that
  speculates).
- The boot crash at weight repack, "distinct from TDR, ... with the same device not ready text"
  in gptq_marlin_repack: "Setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False resolves
  the crash".
"""

from __future__ import annotations

import re

from pyinfra.api import FactBase, StringCommand
from pyinfra.api.command import QuoteString

from rigbook.core.spec import Rig

DEVICE_NOT_READY = "CUDA driver error: device not ready"
STALE_HANDLES = "!handles_.at(i) INTERNAL ASSERT FAILED"
REPACK = "gptq_marlin_repack"


def journal_hints(lines: str, rig: Rig) -> list[str]:
    """What the journal's lines show, in words, with the fix (empty: no known signature)."""
    hints = []
    if REPACK in lines and DEVICE_NOT_READY in lines:
        hints.append(
            "the engine died at weight repack with \"device not ready\": the hardware notes fix "
            "it with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False; set it in serving_env "
            "(rigbook sets it itself on WSL2 and NVLink rigs) (docs/sources.md, "
            "expandable_segments)")
    elif rig.platform == "wsl2" and STALE_HANDLES in lines:
        hints.append(
            "Windows reset the GPU mid-kernel (TDR: \"device not ready\", then "
            f"\"{STALE_HANDLES}\"): this is not OOM. The wsl role sets TdrDelay "
            f"{rig.wsl_tdr_delay} s; a kernel longer than that (a long prompt) still trips "
            "it: raise wsl_tdr_delay (or set wsl_tdr_disable), run deploys/rig.py and reboot "
            "Windows, which applies it (docs/wsl2.md, The GPU timeout (TDR))")
    return hints


#: vLLM's periodic speculative-decoding line carries this (vllm/v1/spec_decode/metrics.py).
_ACCEPTANCE = re.compile(r"Mean acceptance length: (\d+(?:\.\d+)?)")
#: Below this mean acceptance length speculation is the failure log's quantised head (1.07-1.27
#: tokens per pass, 56 vs 58 tok/s), not its draft model (3.7-4.2).
LOW_ACCEPTANCE = 1.5


def last_acceptance(text: str) -> float | None:
    """The last mean acceptance length the engine logged (None: it logged none)."""
    found = _ACCEPTANCE.findall(text)
    return float(found[-1]) if found else None


class SpecAcceptance(FactBase[float | None]):
    """
    The last ``Mean acceptance length`` the serving engine logged, from its unit's journal (or
    the supervisor's log without systemd)::

        SpecDecoding metrics: Draft acceptance rate: 88.8%, Mean acceptance length: 5.44, ...
    """

    def command(self, unit: str, log: str) -> StringCommand:
        return StringCommand(
            "{ journalctl -u", QuoteString(unit), "-n 5000 --no-pager -o cat 2>/dev/null;",
            "tail -n 5000", QuoteString(log), "2>/dev/null; } | grep -a 'Mean acceptance length'",
            "| tail -n 1; true",
        )

    def process(self, output: list[str]) -> float | None:
        return last_acceptance("\n".join(output))


def acceptance_warning(length: float | None) -> str | None:
    """What a low acceptance length means (None: none logged, or speculation pays)."""
    if length is None or length >= LOW_ACCEPTANCE:
        return None
    return (f"the engine's mean acceptance length is {length:g} tokens per pass: the failure "
            "log's quantised MTP head accepted 1.07-1.27 and bought nothing (56 vs 58 tok/s), "
            "its draft model 3.7-4.2; speculation does not pay here: use an unquantised head "
            "or a draft model, or drop it (docs/sources.md, MTP)")
