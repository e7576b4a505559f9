"""Slow workers: a rank whose own compute per step (its data, forward and backward; not its
waits in the collectives) stays well above the other ranks' holds every step of the group
back, since data parallelism runs at the pace of its slowest rank.

The times come with the training rows, at no collective of their own (contract.COMPUTE_KEY,
measured in worker/loop/window.py). At every step, the last 2 x failure.straggler_window steps
are judged as two blocks: a rank is slow in a block when its total is at least
failure.straggler_margin times the median of the other ranks' totals (the others', so that
of two ranks the slower one is compared with the faster one, not with their mean); it is
reported once slow in both, since one block may hold a hiccup (a garbage collection, a
page fault storm) that says nothing about the worker. A rank twice as slow from some step
on is found about straggler_window + 6 steps later. `slow_ranks` decides; `StragglerWatch`
keeps the steps.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from ..contract import COMPUTE_KEY
from ..errors import warn
from .metrics import EventLog

BLOCKS = 2
"""The blocks of straggler_window steps, one after the other, a rank must be slow in (the
watch keeps two: an older and a newer)."""


def block_ratios(totals: list[float]) -> list[float]:
    """Each rank's compute time over a block against the median of the other ranks' (1.0:
    as fast; 2.0: twice as slow). A rank is measured against others only: one rank, [1.0]."""
    if len(totals) < 2:
        return [1.0] * len(totals)
    ratios = []
    for rank, mine in enumerate(totals):
        others = statistics.median(totals[:rank] + totals[rank + 1:])
        ratios.append(mine / others if others > 0 else 1.0)
    return ratios


def slow_ranks(blocks: list[list[float]], margin: float) -> dict[int, float]:
    """The ranks slow in each of `blocks` (each rank's total compute time over one block of
    steps, the newest last), with their smallest ratio over them: rank -> ratio."""
    if not blocks:
        return {}
    ratios = [block_ratios(totals) for totals in blocks]
    world = len(blocks[0])
    return {rank: min(r[rank] for r in ratios) for rank in range(world)
            if all(len(r) == world and r[rank] >= margin for r in ratios)}


@dataclass
class Slow:
    """A rank found slow: its ratio to the others, the step it was found at, since when."""
    rank: int
    ratio: float
    step: int
    since_step: int


class StragglerWatch:
    """Reads the ranks' compute times out of the training rows and judges the last two
    blocks of steps at each (their totals kept as running sums: a row costs one pass over
    the ranks, not over the steps, however large the world); says which rank is slow (`slow`), with a `slow_worker` event and a line on the console, once per
    rank and group: a re-formed group (another world size, or a rank replaced) starts anew."""

    def __init__(self, events: EventLog, mode: str, margin: float, window: int,
                 node_ip: Callable[[int], str | None]):
        self.events, self.mode, self.margin, self.window = events, mode, margin, window
        self._node_ip = node_ip
        self.slow: dict[int, Slow] = {}  # the slow ranks of this group, reported
        self.formed()

    def formed(self) -> None:
        """A new group: its ranks are other processes, or numbered anew; judge them afresh."""
        self._steps: deque[tuple[int, list[float]]] = deque(maxlen=BLOCKS * self.window)  # (step, times)
        self._older: list[float] = []  # each rank's total over the older block's steps (the first window)
        self._newer: list[float] = []  # ... and over the newer block's
        self.slow = {}

    def rows(self, rows: list[dict[str, Any]]) -> None:
        """Take the compute times out of fresh training rows (they are not metrics), judging
        the last steps at each."""
        for row in rows:
            times = row.pop(COMPUTE_KEY, None)
            if times is None or self.mode == "off":
                continue
            if self._steps and len(times) != len(self._steps[-1][1]):
                self.formed()  # a row from before a resize, or after one the controller saw late
            self._push(row["step"], times)
            if len(self._steps) == self._steps.maxlen:
                self._judge(row["step"])

    def _push(self, step: int, times: list[float]) -> None:
        """One step more: once both blocks are full, the oldest step leaves the older block
        and the newer block's first step moves into it."""
        if not self._steps:
            self._older, self._newer = [0.0] * len(times), [0.0] * len(times)
        if len(self._steps) == self._steps.maxlen:
            oldest, crossing = self._steps[0][1], self._steps[self.window][1]
            self._older = [a - o + c for a, o, c in zip(self._older, oldest, crossing)]
            self._newer = [a - c + t for a, c, t in zip(self._newer, crossing, times)]
        elif len(self._steps) < self.window:
            self._older = [a + t for a, t in zip(self._older, times)]
        else:
            self._newer = [a + t for a, t in zip(self._newer, times)]
        self._steps.append((step, times))

    def _judge(self, step: int) -> None:
        for rank, ratio in slow_ranks([self._older, self._newer], self.margin).items():
            if rank not in self.slow:
                self._report(Slow(rank, ratio, step, self._steps[0][0]))

    def _report(self, slow: Slow) -> None:
        self.slow[slow.rank] = slow
        node = self._node_ip(slow.rank)
        steps = slow.step - slow.since_step + 1
        self.events.log("slow_worker", step=slow.step, rank=slow.rank, node=node, ratio=round(slow.ratio, 3),
                        steps=steps, since_step=slow.since_step, margin=self.margin, action=self.mode)
        then = ("it is moved to a new worker at the next step boundary" if self.mode == "replace" else
                "set failure.stragglers=replace to move it to a new worker")
        warn(f"rank {slow.rank} (node {node}) is {slow.ratio:.2f}x slower than the other workers' median over "
             f"the last {steps} steps, holding every step back; {then}")

    def to_replace(self) -> list[int]:
        """The slow ranks to move to new workers (failure.stragglers: replace)."""
        return sorted(self.slow) if self.mode == "replace" else []
