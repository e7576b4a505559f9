"""failure.chaos on a worker: the faults a rank injects into itself, for tests and for
checking a setup. Which faults act at a step, and on which rank, is drawn the same way
on every rank from (seed, fault, step), so no rank needs to tell another."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any, Callable

from ...config import ChaosFault


class ChaosError(RuntimeError):
    """Raised in a worker by failure.chaos `raise`."""


class Chaos:
    def __init__(self, faults: list[ChaosFault], seed: int, notify: Callable[[dict[str, Any]], None],
                 claim: Callable[[int, int], bool] | None = None):
        self.faults, self.seed, self.notify = list(faults), seed, notify
        # claim(fault index, step) is True once per run: after a recovery, the step that
        # fired a fault may run again, in a new process, and must not fire it again.
        claimed: set[tuple[int, int]] = set()
        self._claim = claim or (lambda i, step: (i, step) not in claimed and not claimed.add((i, step)))
        self._due: list[tuple[int, ChaosFault, int]] = []  # faults acting at the end of this step
        self._timers: list[threading.Timer] = []  # faults at a random moment of it

    def arm(self, step: int, rank: int, world_size: int, step_seconds: float) -> None:
        """Decide which faults act in or after `step`, and on which rank; start the timers
        of this rank's faults that act at a random moment of it (up to `step_seconds`,
        the previous step's duration, after it begins)."""
        for i, fault in enumerate(self.faults):
            rng = random.Random(hash((self.seed, 0xC4A05, i, step)))  # ints: hash() is stable
            due = fault.step == step if fault.step is not None else rng.random() < fault.probability
            if not due:
                continue
            target = fault.rank if fault.rank is not None else rng.randrange(world_size)
            if fault.at == "end":
                self._due.append((i, fault, target))
            elif target == rank:
                timer = threading.Timer(rng.uniform(0.0, step_seconds), self._fire, (i, fault, step, rank))
                timer.daemon = True
                timer.start()
                self._timers.append(timer)

    @property
    def due(self) -> bool:
        return bool(self._due)

    def act(self, step: int, rank: int) -> None:
        """Fire this rank's faults due at the end of `step` (its update applied)."""
        due, self._due = self._due, []
        for i, fault, target in due:
            if target == rank:
                self._fire(i, fault, step, rank)

    def cancel(self) -> None:
        """Forget the faults of a step abandoned half-way."""
        self._due = []
        for timer in self._timers:
            timer.cancel()
        self._timers = []

    def _fire(self, i: int, fault: ChaosFault, step: int, rank: int) -> None:
        if not self._claim(i, step):
            return
        self.notify({"event": "chaos", "step": step, "action": fault.action, "at": fault.at})
        if fault.action in ("kill", "freeze"):
            os.kill(os.getpid(), signal.SIGKILL if fault.action == "kill" else signal.SIGSTOP)
        elif fault.action == "delay":
            time.sleep(fault.seconds)
        elif fault.action == "hang":
            while True:
                time.sleep(1.0)
        else:
            raise ChaosError(f"chaos: raise after step {step} on rank {rank}")
