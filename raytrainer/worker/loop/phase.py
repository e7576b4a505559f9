"""Where a rank is, for the driver's hang check (contract.Status.phase): "framework" (in
raytrainer's code), "user" (in the task's code, or the data), "collective" (waiting for its
peers). A Task's Loop and your own loop's UserLoop each hold it as their `phase`, and
enter one for a while with InPhase."""

from __future__ import annotations

from typing import Any


class InPhase:
    """`with InPhase(holder, p)`: `holder.phase` is `p` inside, the outer one again after.
    A class, not a generator: two of them run in every step."""

    __slots__ = ("holder", "phase", "outer")

    def __init__(self, holder: Any, phase: str):
        self.holder, self.phase = holder, phase

    def __enter__(self) -> None:
        self.outer, self.holder.phase = self.holder.phase, self.phase

    def __exit__(self, *exc: Any) -> None:
        self.holder.phase = self.outer
