"""The controller's watch over its workers' liveness: which of them are hung (no progress
on their own clock for failure.step_timeout_s), and, once a failure has stopped a survivor,
which are gone (silent) or stuck in a collective that cannot be aborted (blocked).

It asks the group for statuses and kills the culprits; the controller decides what a
failure means for the run (controller.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from ..contract import Failure, WorkerGroup
from .policy import blame, progressed


class Watchdog:
    def __init__(self, group: WorkerGroup, step_timeout_s: float | None,
                 run_dir: Callable[[], str | None], node_ip: Callable[[int], str | None]):
        self.group, self.timeout_s = group, step_timeout_s
        self._run_dir, self._node_ip = run_dir, node_ip
        self._seen: dict[int, tuple[Any, float]] = {}  # rank -> (its progress, when it last moved)
        self._answered: dict[int, tuple[Any, float]] = {}  # rank -> (its last status, when)
        self.checked_at = self._reset_at = self._blocked_at = self._silent_at = 0.0
        self._quiet: set[int] = set()  # the ranks that did not answer the last ask (silent)

    def reset(self) -> None:
        """A group (re-)formed: every worker's clock starts now."""
        self._seen, self._answered = {}, {}
        self.checked_at = self._reset_at = time.monotonic()

    def furthest_step(self) -> int:
        """The furthest step a worker was seen at since the group formed (0 if none)."""
        return max([seen[0][0] for seen in self._seen.values() if seen[0]], default=0)

    def hung(self, step: int, recovering: bool, exclude: set[int] = frozenset()) -> list[Failure]:
        """Check, about once a second, for workers that made no progress within
        failure.step_timeout_s, on their own clock (policy.progressed: a worker that runs, or
        waits for a core on a loaded machine, is working, however slowly); kill those to
        blame (policy.blame: not the ones waiting for them in a collective), with their
        stacks and collectives dumped where they answer. Returns their failures. `step`:
        the run's, for a culprit never seen."""
        timeout = self.timeout_s
        now = time.monotonic()
        if timeout is None or now - self.checked_at < 1.0:
            return []
        self.checked_at = now
        statuses = self.group.status()
        for rank, status in enumerate(statuses):
            if status is None:
                continue
            last, at = self._answered.get(rank, (None, now))
            if rank not in self._seen or progressed(last, status, now - at):
                self._seen[rank] = ((status.step, status.progress, status.phase), now)
            self._answered[rank] = (status, now)
        stalled = {r: statuses[r] for r in range(len(statuses))
                   if r not in exclude and now - self._seen.get(r, (None, self._reset_at))[1] > timeout}
        if not stalled:
            return []
        moving = [r for r in range(len(statuses)) if r not in exclude and r not in stalled]
        culprits = blame(stalled, recovering=recovering, others_progress=bool(moving))
        for rank in range(len(statuses)) if culprits else ():
            if rank not in culprits:  # it may wait for a culprit: a fresh timeout to see it gone
                self._seen[rank] = (self._seen.get(rank, (None, now))[0], now)
        found = []
        for rank in culprits:
            status = stalled[rank]
            if status is None:
                where = ("it did not answer at all (frozen: stopped, paused, or holding the GIL), "
                         "so no stacks could be read")
                last = self._seen.get(rank, (None, 0.0))[0]
                at = last[0] if last else step
            else:
                where = self._dump(rank, status.step)
                at = status.step
            self.group.kill(rank)
            found.append(Failure(
                rank, "hung", f"no progress for {timeout:g} s (failure.step_timeout_s) "
                f"{'in ' + status.phase + ' code ' if status else ''}after step {at}; {where}", at,
                self._node_ip(rank)))
        return found

    def settling(self) -> None:
        """A failure stopped the group: `silent` counts unanswered asks from now."""
        self._quiet = set()

    def silent(self, exclude: set[int]) -> list[int]:
        """The workers (not in `exclude`) that answered neither of the last two asks of their
        control channel (half a second each, at most twice a second). Once a survivor has
        stopped, one that has not stopped and does not answer is gone: a worker whose node
        was lost with it is known dead to Ray only seconds later (2.6 s in the bench's node
        run) and its peers, which stopped at once, would wait for that. Two asks, not one:
        on a loaded machine one answer can take longer than half a second, and a worker
        taken for dead is killed."""
        now = time.monotonic()
        if now - self._silent_at < 0.5:
            return []
        self._silent_at = now
        quiet = {r for r, s in enumerate(self.group.status(timeout=0.5)) if r not in exclude and s is None}
        gone, self._quiet = sorted(quiet & self._quiet), quiet
        return gone

    def blocked(self, exclude: set[int]) -> list[int]:
        """The workers (not in `exclude`) in a collective now, asked at most once a second."""
        now = time.monotonic()
        if now - self._blocked_at < 1.0:
            return []
        self._blocked_at = now
        return [r for r, s in enumerate(self.group.status()) if r not in exclude and s is not None
                and s.phase == "collective"]

    def _dump(self, rank: int, step: int) -> str:
        """Write a hung worker's stacks and flight record of collectives into the run directory."""
        stacks = self.group.dump_stacks(rank)
        if stacks is None:
            return "its stacks could not be read (the process did not answer)"
        run_dir = self._run_dir()
        if run_dir is None:
            return "stacks:\n" + stacks
        path = Path(run_dir) / f"stacks-rank{rank}-step{step}.txt"
        path.write_text(stacks)
        record = self.group.flight_record(rank)
        if record:
            (Path(run_dir) / f"collectives-rank{rank}-step{step}.json").write_bytes(record)
        return f"stacks in {path}" + (" (its collectives beside them)" if record else "")
