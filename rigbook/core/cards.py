"""What a card is (compute capability, VRAM) and the serving rules the sources key on it.

The sources' limits are about silicon and memory, not about product names: FlashInfer's GDN
kernels "require SM90+", kernels shipped for SM90 "fail to select or select and then assert" on
SM120, Cliff 2 is "the chunked-prefill code path that 24 GB single-card configs are forced to
take", and the SM86 decode slowdown at depth is "architectural, not model-specific"
(docs/sources.md, Rules keyed on the card). So each rule reads a `Card`: from the rig's
nvidia-smi (`compute_cap`, `memory.total`) once facts are read, and from its `gpu_class` before
connecting, where the class alone decides (`other` has no class card: its rules wait for the
facts). Refusals are `card_problems`, advice is `card_warnings`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rigbook.rigside.gpus import Gpu


@dataclass(frozen=True)
class Card:
    """A card's compute capability (major, minor) and VRAM in GiB; `seen` says where from."""

    compute_cap: tuple[int, int]
    vram_gib: float
    seen: str

    @property
    def sm(self) -> str:
        return f"SM{self.compute_cap[0]}{self.compute_cap[1]}"


#: The classes rigbook knows, as the hardware notes' card table lists them (docs/sources.md).
CLASS_CARDS = {
    "rtx3090": Card((8, 6), 24, "gpu_class rtx3090"),
    "rtx3090ti": Card((8, 6), 24, "gpu_class rtx3090ti"),
    "rtx4090": Card((8, 9), 24, "gpu_class rtx4090"),
    "rtx5090": Card((12, 0), 32, "gpu_class rtx5090"),
    "a5000": Card((8, 6), 24, "gpu_class a5000"),
    "a6000": Card((8, 6), 48, "gpu_class a6000"),
}
#: The compute capability of the SM86 rules, and the first one FlashInfer's GDN kernels run on.
SM86, SM90 = (8, 6), (9, 0)
#: Cards of at most this much VRAM take Cliff 2's chunked-prefill path on one card: "24 GB
#: single-card configs" (a 3090 reports 24576 MiB, a 4090 24564 MiB, a 5090 32607 MiB).
CLIFF2_VRAM_GIB = 24.5
#: Longest context for a GDN model on one such card ("may OOM at >50K single-prompt context").
CLIFF2_MAX_CONTEXT = 50_000
#: Past this context an SM86 card pays the decode tax: "switch to llama.cpp at >60K context".
SM86_LONG_CONTEXT = 60_000
#: Kernels built for SM90 (Hopper) that a recipe can name, by the words that select them.
SM90_KERNELS = {"FLASHMLA": "FlashMLA", "VLLM_FLASH_ATTN_VERSION=3": "FlashAttention 3"}


def class_card(gpu_class: str) -> Card | None:
    """The card of a class (None: `other`, which only the rig's facts describe)."""
    return CLASS_CARDS.get(gpu_class)


def parse_compute_cap(text: str | None) -> tuple[int, int] | None:
    """nvidia-smi's `compute_cap` ("8.6", "12.0") as (major, minor); None when it said none."""
    major, dot, minor = (text or "").strip().partition(".")
    return (int(major), int(minor)) if dot and major.isdigit() and minor.isdigit() else None


def facts_card(gpus: Iterable[Gpu]) -> Card | None:
    """The card the rig's nvidia-smi shows: the lowest compute capability and the smallest VRAM
    of its GPUs (a rule holds for the weakest card); None when a GPU does not report either."""
    seen = [(parse_compute_cap(g.compute_cap), g.memory_total_mib, g) for g in gpus]
    if not seen or any(cap is None or mib is None for cap, mib, _ in seen):
        return None
    cap, mib, gpu = min(seen, key=lambda s: (s[0], s[1]))
    low = min(m for _, m, _ in seen)
    return Card(cap, round(low / 1024, 1),
                f"nvidia-smi: GPU {gpu.index} {gpu.name}, compute_cap {gpu.compute_cap}, "
                f"{low} MiB")
