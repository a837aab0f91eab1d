"""The stress level's arithmetic: which needle sizes fit the context, the rungs of the context
ceiling ladder, the free VRAM margin of each rung, and what the first failing rung says.

rigbook.roles.verify sends the requests; this module decides. The hardware notes' stress
ladder is the model: salted needles at 10K, 30K, 60K and 90K prompt tokens (their Cliff 2, a
single long prompt that runs the card out of memory), then prompts from ~95K up to 0.92 of
the context in steps, free VRAM read after each, a warning under a 1 GiB margin, and the first
failure taken as the real ceiling.
"""

from __future__ import annotations

from rigbook.core.types import StrictModel
from rigbook.roles.stepproblem import StepProblem

#: Prompt sizes (tokens) of the salted needles; those that do not fit the context are skipped.
NEEDLE_TOKENS = (10_000, 30_000, 60_000, 90_000)
#: The ceiling ladder's first rung (tokens), lower when the context is smaller (`rungs`).
CEILING_START = 95_000
#: The ceiling ladder's last rung as a share of the context.
CEILING_FILL = 0.92
#: Free VRAM (MiB) a rung must leave on every GPU; less is a warning (also the soak's growth).
MARGIN_MIB = 1024

CONTEXT_HINT = ("the engine serves a shorter context than the recipe says (its context error "
                "names its limit): set the recipe's max_model_len (or serving_max_model_len) to "
                "what the engine holds, or find why the engine shortened it in the unit's journal")
OOM_HINT = ("the engine could not serve a prompt its context allows: the KV cache and the "
            "prefill's activations do not fit the VRAM left (a newer driver's reserve, a "
            "display, another process: nvidia-smi lists them). Lower max_model_len to the "
            "ceiling, lower the memory share or chunked-prefill size, or free the GPU; read the "
            "unit's journal for the out-of-memory error")
NEEDLE_HINT = ("the model lost the needle at this length: a context extension (rope scaling) "
               "the engine does not apply, a KV cache dtype that is too lossy, or a model that "
               "does not hold this length; serve a shorter max_model_len")


def needle_sizes(context: int, sizes: tuple[int, ...], room: int) -> tuple[list[int], list[int]]:
    """(the sizes whose prompt and `room` for the answer fit the context, those that do not)."""
    fits = [size for size in sizes if size + room < context]
    return fits, [size for size in sizes if size not in fits]


def rungs(context: int, start: int = CEILING_START, count: int = 5,
          fill: float = CEILING_FILL) -> list[int]:
    """`count` prompt sizes from `start` to fill x context, evenly spaced, both ends included;
    a context whose top rung is not above `start` starts at half the top."""
    top = int(fill * context)
    low = start if start < top else top // 2
    if count == 1:
        return [top]
    step = (top - low) / (count - 1)
    return [round(low + i * step) for i in range(count)]


class Rung(StrictModel):
    """One rung: the prompt size asked, what the engine counted, how long it took, the free
    VRAM (MiB per GPU) read on the rig after it, and why it failed (None: it passed)."""

    tokens: int
    prompt_tokens: int | None = None
    seconds: float
    free_mib: tuple[int, ...] | None = None
    error: str | None = None
    oom: bool = False  # failed without the engine's context error: memory or a crash


class Ceiling(StrictModel):
    """The ceiling ladder of one run: the context it expected, each rung in order, and the
    largest prompt that passed."""

    context: int
    free_before_mib: tuple[int, ...] | None = None
    rungs: tuple[Rung, ...]

    @property
    def ceiling(self) -> int | None:
        passed = [r.prompt_tokens or r.tokens for r in self.rungs if r.error is None]
        return max(passed) if passed else None

    @property
    def failed(self) -> Rung | None:
        return next((r for r in self.rungs if r.error is not None), None)

    def summary(self) -> str:
        failed = self.failed
        top = f"ceiling {self.ceiling or 0} tok of {self.context}"
        return top + (f" (failed at {failed.tokens})" if failed else " (every rung passed)")


def _free(free: tuple[int, ...] | None) -> str:
    return "free VRAM not read" if free is None else "free " + "/".join(map(str, free)) + " MiB"


def margin_warnings(ceiling: Ceiling) -> list[str]:
    """A warning for each rung that left a GPU under MARGIN_MIB free."""
    return [f"the {r.tokens}-token rung left GPU {i} {free} MiB free, under the {MARGIN_MIB} "
            "MiB margin: a longer prompt, a second request or a display may not fit"
            for r in ceiling.rungs if r.error is None and r.free_mib
            for i, free in enumerate(r.free_mib) if free < MARGIN_MIB]


def verdict(ceiling: Ceiling) -> str:
    """The detail of a ladder whose every rung passed; StepProblem naming the real ceiling
    at the first failing rung."""
    failed = ceiling.failed
    if failed is None:
        return "; ".join(f"{r.prompt_tokens or r.tokens} tok {r.seconds:.1f} s {_free(r.free_mib)}"
                         for r in ceiling.rungs) + f"; {ceiling.summary()}"
    real = ceiling.ceiling
    below = f"the real ceiling is {real} tokens" if real else "no rung passed"
    raise StepProblem(
        f"a {failed.tokens}-token prompt to be served (the ladder climbs to "
        f"{CEILING_FILL:g} of the {ceiling.context}-token context)",
        f"{below} ({_free(failed.free_mib)} after the failure); the rung: {failed.error}",
        OOM_HINT if failed.oom else CONTEXT_HINT)
