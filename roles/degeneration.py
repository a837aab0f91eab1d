"""The verify ladder's `long-generation` step: a ~2K-token essay without a repetition loop
(docs/verify.md, long-generation).

A model that degenerates (greedy decoding where the card asks for sampling, no repetition
penalty, a quantisation that broke a layer, a drafter bug) falls into a loop that only shows
after hundreds of tokens: the same line again and again, or a phrase repeated until max_tokens.
Two measures catch it, each tested on loops people published and on normal text
(tests/fixtures/degeneration/SOURCES.md):

- a repeated-line cascade: one line of at least LINE_CHARS characters LINE_REPEATS times or
  more (prose repeats no such line; a loop repeats its line until the budget runs out);
- lexical variety in every window of WINDOW tokens: the share of distinct tokens (distinct-1)
  at least MIN_DISTINCT, and the share of 4-grams seen before in the window at most
  MAX_REPEATED_4GRAMS. A window, not the whole text, so that a loop that starts late is not
  averaged away, and so that the figures do not drift with the length of the answer.

Tokens are words, and single characters of the scripts written without spaces (Chinese,
Japanese, Korean), so a loop in those scripts counts as one too; punctuation is not a token
(markdown tables and rules would read as loops).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

ESSAY_PROMPT = (
    "Write a long essay, about 1500 words, on the history of lighthouses: how they were built, "
    "lit and kept, from the ancient world to automation. Write in paragraphs of prose, without "
    "headings or lists."
)
#: The essay's budget (tokens); a shorter context gets what fits.
ESSAY_TOKENS = 2048

LINE_CHARS = 20
LINE_REPEATS = 3
WINDOW = 200
#: Normal text (the fixtures' model answers, rigbook's own docs) keeps 0.36 distinct-1 or more
#: in its least varied window; a loop that fills a window falls far below (one that repeats
#: "I think." has 2 distinct words in 200).
MIN_DISTINCT = 0.2
#: The published loops repeat 0.45-0.76 of their 4-grams even in excerpts that begin with
#: normal text; normal text at most 0.21 (a short arithmetic answer that restates its question).
MAX_REPEATED_4GRAMS = 0.33
#: Fewer tokens than this say nothing about variety.
MIN_TOKENS = 20

TOKEN = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]|\w+")

HINT = ("the model fell into a repetition loop: use the model card's sampling (temperature, "
        "top_p; greedy decoding loops) and a repetition or presence penalty; a quantised "
        "checkpoint that loops where its BF16 original does not is the quantisation: another "
        "quant or the original weights")


class Degenerate(Exception):
    """What a normal text shows, what this one showed, and the evidence."""

    def __init__(self, expected: str, got: str) -> None:
        super().__init__(expected)
        self.expected, self.got, self.hint = expected, got, HINT


@dataclass(frozen=True)
class Variety:
    """The least varied window of a text."""

    tokens: int
    distinct: float
    repeated_4grams: float
    start: int

    def text(self) -> str:
        return (f"distinct-1 {self.distinct:.2f}, repeated 4-grams {self.repeated_4grams:.2f} "
                f"in the least varied {min(WINDOW, self.tokens)}-token window")


def tokens_of(text: str) -> list[str]:
    return TOKEN.findall(text.lower())


def repeated_line(text: str) -> tuple[str, int] | None:
    """The most repeated line of LINE_CHARS or more, when it repeats LINE_REPEATS times."""
    lines = Counter(" ".join(line.split()) for line in text.splitlines())
    counted = [(count, line) for line, count in lines.items() if len(line) >= LINE_CHARS]
    if not counted:
        return None
    count, line = max(counted)
    return (line, count) if count >= LINE_REPEATS else None


def _grams(tokens: list[str]) -> list[tuple[str, ...]]:
    return list(zip(tokens, tokens[1:], tokens[2:], tokens[3:], strict=False))


def _window(tokens: list[str]) -> tuple[float, float]:
    grams = _grams(tokens)
    repeated = 1 - len(set(grams)) / len(grams) if grams else 0.0
    return len(set(tokens)) / len(tokens), repeated


def variety(tokens: list[str]) -> Variety:
    """The window (WINDOW tokens, every WINDOW // 4) with the least variety: the lowest
    distinct-1, or on a tie the most repeated 4-grams. A shorter text is one window."""
    starts = range(0, max(len(tokens) - WINDOW, 0) + 1, WINDOW // 4)
    worst = None
    for start in [*starts, max(len(tokens) - WINDOW, 0)]:
        distinct, repeated = _window(tokens[start:start + WINDOW])
        if worst is None or (distinct, -repeated) < (worst.distinct, -worst.repeated_4grams):
            worst = Variety(len(tokens), distinct, repeated, start)
    return worst


def check(text: str, where: str = "the essay") -> str:
    """Degenerate (with the evidence) when `text` loops; else the figures, for the detail."""
    line = repeated_line(text)
    if line is not None:
        raise Degenerate(f"no line of {where} repeated {LINE_REPEATS} times or more",
                         f"{line[0][:120]!r} {line[1]} times")
    tokens = tokens_of(text)
    if len(tokens) < MIN_TOKENS:
        return f"{where}: {len(tokens)} tokens, too short to measure variety"
    worst = variety(tokens)
    if worst.distinct < MIN_DISTINCT or worst.repeated_4grams > MAX_REPEATED_4GRAMS:
        window = tokens[worst.start:worst.start + WINDOW]
        gram, count = Counter(_grams(window)).most_common(1)[0] if len(window) > 3 else \
            (tuple(window), 1)
        raise Degenerate(
            f"lexical variety in every window of {where} (distinct-1 >= {MIN_DISTINCT}, "
            f"repeated 4-grams <= {MAX_REPEATED_4GRAMS})",
            f"{worst.text()} at token {worst.start}; {' '.join(gram)!r} {count} times in it")
    return f"{where}: {len(tokens)} words, {worst.text()}"
