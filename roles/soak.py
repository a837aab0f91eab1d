"""The soak level's bookkeeping: sessions of several turns whose context ramps, what each turn
gave back, and the verdict (empty replies, errors, VRAM growth, tok/s retention).

rigbook.roles.verify sends the turns; this module plans the ramp and judges. What it is for:
crashes after minutes of traffic (a speculative drafter's bug) and the multi-turn out-of-memory
that the hardware notes reach only by a ramp to ~22-25K tokens over turns (their Cliff 2b),
which no single request of the quick ladder shows. Retention compares like with like: the
same turn of the first and the last session (same prompt size), its noise judged by
rigbook.core.stats.
"""

from __future__ import annotations

from rigbook.core import stats
from rigbook.core.types import StrictModel
from rigbook.roles.stepproblem import StepProblem
from rigbook.roles.stress import MARGIN_MIB

QUESTION = ("Summarise what the notes so far say about the rig, in a numbered list of short "
            "points.")

ERROR_HINT = ("the engine stopped answering under sustained traffic: read the unit's journal "
              "for the crash (a speculative drafter's bug, an out-of-memory on a long "
              "conversation); turn speculation off or lower max_model_len, then soak again")
EMPTY_HINT = ("the engine answered 200 with no text: clients show nothing and retry. Read the "
              "journal around those turns (an aborted request, a full KV cache that preempted "
              "the sequence, a conversation beyond the context: llama-cpp-python ends such a "
              "stream with nothing, a template that ends the turn at once)")
VRAM_HINT = ("free VRAM fell during the soak: memory that grows with traffic (a leak, a "
             "cache without a bound) ends in an out-of-memory; compare nvidia-smi's processes "
             "before and after, and the engine's release notes")
RETENTION_HINT = ("decode tok/s fell from the first session to the last beyond the noise: "
                  "thermal or power throttling (nvidia-smi -q -d PERFORMANCE), a prefix cache "
                  "that thrashes, or memory pressure; look at clocks and the journal")


def chunk_tokens(target: int, turns: int, fixed: int) -> int:
    """Tokens of new notes each turn adds so the last turn's prompt is about `target`, when
    each turn also adds `fixed` (its question and the answer before it)."""
    return max((target - turns * fixed) // turns, 16)


class Turn(StrictModel):
    """One turn: its session and place, what it cost and gave back (error: it failed)."""

    session: int
    turn: int
    at_s: float  # since the soak began
    prompt_tokens: int | None = None
    tokens: int = 0
    decode_tps: float = 0.0
    empty: bool = False
    error: str | None = None


class Soak(StrictModel):
    """A soak's figures, as stored with the run."""

    seconds: float
    limit_s: int
    limit_requests: int
    turns_per_session: int
    target_tokens: int
    free_start_mib: tuple[int, ...] | None = None
    free_end_mib: tuple[int, ...] | None = None
    turns: tuple[Turn, ...] = ()

    @property
    def requests(self) -> int:
        return len(self.turns)

    @property
    def sessions(self) -> int:
        return len({t.session for t in self.turns})

    @property
    def empty(self) -> list[Turn]:
        return [t for t in self.turns if t.empty]

    @property
    def errors(self) -> list[Turn]:
        return [t for t in self.turns if t.error is not None]

    @property
    def vram_growth_mib(self) -> int | None:
        """The largest fall of free VRAM on any GPU from start to end (None: not read)."""
        start, end = self.free_start_mib, self.free_end_mib
        if not start or not end or len(start) != len(end):
            return None
        return max(a - b for a, b in zip(start, end, strict=True))

    def windows(self) -> tuple[list[float], list[float]]:
        """Decode tok/s of the first and the last session, turn by turn, at the turns both
        have answered (empty: fewer than two sessions)."""
        by = {}
        for t in self.turns:
            if t.error is None and not t.empty and t.decode_tps > 0:
                by.setdefault(t.session, {})[t.turn] = t.decode_tps
        if len(by) < 2:
            return [], []
        first, last = by[min(by)], by[max(by)]
        common = sorted(set(first) & set(last))
        return [first[i] for i in common], [last[i] for i in common]

    def retention(self) -> tuple[float, bool] | None:
        """(last / first mean decode tok/s, whether the difference is inside the noise)."""
        first, last = self.windows()
        if not first:
            return None
        a, b = stats.estimate(first, 1.0), stats.estimate(last, 1.0)
        return b.mean / a.mean, stats.indistinguishable(a, b)

    def summary(self) -> str:
        kept = self.retention()
        growth = self.vram_growth_mib
        return (f"{self.requests} turns in {self.sessions} session(s), {self.seconds:.0f} s; "
                f"{len(self.empty)} empty, {len(self.errors)} error(s); VRAM growth "
                + ("not read" if growth is None else f"{growth} MiB") + "; retention "
                + ("not measured (one session)" if kept is None else
                   f"{kept[0]:.2f}" + (" (inside the noise)" if kept[1] else "")))


def verdict(soak: Soak, min_retention: float) -> tuple[str, list[str]]:
    """(the detail, warnings) of a soak that passed; StepProblem for the first hard failure:
    an error, an empty reply, VRAM growth beyond MARGIN_MIB, retention under the floor beyond
    the noise."""
    if soak.errors:
        bad = soak.errors[0]
        raise StepProblem("every turn answered", f"turn {bad.turn + 1} of session "
                          f"{bad.session + 1} at {bad.at_s:.0f} s: {bad.error}; "
                          f"{soak.summary()}", ERROR_HINT)
    if soak.empty:
        where = ", ".join(f"s{t.session + 1}/t{t.turn + 1}" for t in soak.empty[:10])
        raise StepProblem("no empty reply", f"{len(soak.empty)} of {soak.requests} replies empty "
                          f"({where}); {soak.summary()}", EMPTY_HINT)
    growth = soak.vram_growth_mib
    if growth is not None and growth > MARGIN_MIB:
        raise StepProblem(f"free VRAM to fall by at most {MARGIN_MIB} MiB",
                          f"{soak.free_start_mib} -> {soak.free_end_mib} MiB free; "
                          f"{soak.summary()}", VRAM_HINT)
    kept = soak.retention()
    if kept is not None and kept[0] < min_retention and not kept[1]:
        first, last = soak.windows()
        raise StepProblem(f"decode tok/s retention of {min_retention:g} or more",
                          f"{kept[0]:.2f} (first session {sum(first) / len(first):.1f}, last "
                          f"{sum(last) / len(last):.1f} tok/s); {soak.summary()}",
                          RETENTION_HINT)
    warnings = []
    if kept is None:
        warnings.append("retention not measured: the bounds left one session; raise "
                        "verify_soak_seconds or verify_soak_requests")
    if growth is None:
        warnings.append("free VRAM not read on the rig (no nvidia-smi): growth not measured")
    return soak.summary(), warnings
