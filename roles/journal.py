"""What a failed start's journal says: the signatures the sources name, recognised in the last
lines the serving role shows, each with what to do (docs/serving.md, Health).

- WSL2's TDR reset (hardware notes, "Note for WSL2 / Windows users"): "RuntimeError: CUDA driver
  error: device not ready" then "!handles_.at(i) INTERNAL ASSERT FAILED at
  CUDACachingAllocator.cpp": "This is not OOM — the engine is being externally reset by the
  Windows display driver mid-kernel".
- The boot crash at weight repack, "distinct from TDR, ... with the same device not ready text"
  in gptq_marlin_repack: "Setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False resolves
  the crash".
"""

from __future__ import annotations

from rigbook.spec import Rig

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
