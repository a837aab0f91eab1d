"""The verify ladder's `speculative` step: the draft's acceptance, read from the engine's
/metrics (docs/verify.md, speculative).

vLLM counts every verification pass of a speculating engine in three Prometheus counters
(vllm/v1/spec_decode/metrics.py, docs/sources.md "Speculative decoding metrics"): drafts,
draft tokens and accepted tokens, one series per engine (data parallel ranks). A pass yields
its accepted tokens and one token of its own, so the mean acceptance length is 1 + accepted /
drafts, the figure the failure log quotes (3.7-4.2 for a working draft model, 1.07-1.27 for the
quantised MTP head). The counters are totals since the engine started: the step reads them
before and after its own generation and takes the difference.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from rigbook.roles.stepproblem import StepProblem

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
COUNTERS = (DRAFTS, DRAFT_TOKENS, ACCEPTED)
#: One sample of the exposition format: name, labels (any characters; the last `}`), value,
#: an optional timestamp. prometheus_client also writes `<name>_created` gauges (when the
#: series began, ~1.7e9): they are other names and never read as the counters.
SAMPLE = re.compile(r"(?P<name>[A-Za-z_:][\w:]*)(?:\{.*\})?\s+(?P<value>\S+)(?:\s+-?\d+)?")

NO_METRICS_HINT = ("the engine's /metrics has no speculative counters: speculation is not "
                   "running (read --speculative-config in the serving unit's journal) or the "
                   "engine does not export them (vLLM V1 does)")
NO_DRAFTS_HINT = ("no drafts were counted during the step's generation: the engine does not "
                  "speculate (the draft model or MTP head did not load: read the journal)")
FLOOR_HINT = ("the draft does not pay: a quantised MTP head accepted 1.07-1.27 in the failure "
              "log where a working draft model reached 3.7-4.2; use an unquantised (BF16) head "
              "or a separate draft model, or fewer num_speculative_tokens (docs/verify.md)")


def counters(text: str) -> dict[str, float]:
    """The speculative counters of a /metrics text, each summed over its series (engines)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = SAMPLE.fullmatch(line.strip())
        if match is None or match["name"] not in COUNTERS:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        if math.isfinite(value):
            found[match["name"]] = found.get(match["name"], 0.0) + value
    return found


@dataclass(frozen=True)
class Acceptance:
    """The counters' growth over one window."""

    drafts: float
    draft_tokens: float
    accepted: float

    @property
    def length(self) -> float:
        return 1 + self.accepted / self.drafts

    def text(self) -> str:
        return (f"acceptance length {self.length:.2f}: {self.accepted:g} of {self.draft_tokens:g} "
                f"drafted tokens accepted in {self.drafts:g} drafts")


def acceptance(before: str, after: str) -> Acceptance:
    """The acceptance between two /metrics texts; StepProblem when it cannot be read."""
    start, end = counters(before), counters(after)
    missing = [name for name in COUNTERS if name not in start or name not in end]
    if missing:
        raise StepProblem(f"the engine's /metrics to carry {', '.join(COUNTERS)}",
                          f"no {', '.join(missing)}", NO_METRICS_HINT)
    grown = Acceptance(*(end[name] - start[name] for name in COUNTERS))
    if grown.drafts <= 0:
        raise StepProblem(f"{DRAFTS} to grow during the step's generation",
                          f"{start[DRAFTS]:g} before, {end[DRAFTS]:g} after", NO_DRAFTS_HINT)
    return grown
