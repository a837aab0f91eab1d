"""The one failure the verify ladder's checks raise: what the step expected, what came back and
what to do about it (roles/verify.py stores the three apart, with the step's name)."""

from __future__ import annotations


class StepProblem(Exception):
    """What the step expected, what came back, and what to do about it."""

    def __init__(self, expected: str, got: str, hint: str) -> None:
        super().__init__(f"expected {expected}; got {got}")
        self.expected, self.got, self.hint = expected, got, hint
