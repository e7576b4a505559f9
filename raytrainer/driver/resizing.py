"""The run's world size, for the controller: when an elastic run grows (the cluster has room:
newcomers are started, and once they are up the workers are to pause, policy.grow_now), how
long a run may go on below min_workers (a fast recovery's lost workers, whose replacements
are coming), and the events that say the size changed (`resized`; `left_node` for the
workers that left a draining node).

The controller pauses the workers and re-forms the group (controller.py); this says when to
grow, and writes down what a re-form changed."""

from __future__ import annotations

import math
import time
from typing import Any

from ..contract import Node, Reformed, WorkerGroup
from ..errors import PlacementError
from .metrics import EventLog
from .policy import grow_now


class Resizing:
    def __init__(self, group: WorkerGroup, events: EventLog, *, min_workers: int, size: int, max_workers: int,
                 check_s: float, patience_s: float, placement_timeout_s: float):
        """The run's bounds (scaling.min_workers, its size, max_workers); `check_s`: how often
        to look for room (grow_check_s); `patience_s`: how long newcomers that are up wait for
        those started with them (scaling.replace_timeout_s); `placement_timeout_s`: how long
        the run may stay below min_workers (scaling.placement_timeout_s)."""
        self.group, self.events = group, events
        self.min_workers, self.size, self.max_workers = min_workers, size, max_workers
        self.check_s = check_s
        self.patience_s = patience_s
        self.placement_timeout_s = placement_timeout_s
        self.checked_at = -math.inf  # due at once
        self._up_at: float | None = None  # since when newcomers are up, waiting for the rest
        self._short_since: float | None = None  # since when the run trains below min_workers
        self.regrowing = 0  # ranks left behind by a fast recovery, whose replacements are coming
        self._unplaced_since: float | None = None  # since when the run lacks room for its size
        self.capacity_wait: dict[str, Any] | None = None  # the waiting_for_capacity event, while it waits

    def room(self, world: int, step: int) -> bool:
        """About once every check_s, while below max_workers: start workers where the cluster
        has room; whether some are up to join now (the workers are to pause for a resize)."""
        now = time.monotonic()
        if world >= self.max_workers or now - self.checked_at < self.check_s:
            return False
        self.checked_at = now
        ready = self.group.joinable()
        starting = self.group.joiners_starting()
        self._note_room(world, ready + starting, now, step)
        if not ready:
            self._up_at = None
            return False
        self._up_at = self._up_at or now
        if not grow_now(ready, starting, now - self._up_at, self.patience_s):
            return False
        self._up_at = None
        return True

    # How long the cluster may lack room for the run's size before the run says it waits:
    # a replacement's group is placed in moments where there is room.
    UNPLACED_AFTER_S = 3.0

    def _note_room(self, world: int, placed: int, now: float, step: int) -> None:
        """Say once (`waiting_for_capacity`) when the run has been below its size for want
        of room for UNPLACED_AFTER_S: it trains on meanwhile, and grows back once there is."""
        missing = self.size - world - placed
        if missing <= 0:
            self._unplaced_since = None
            return
        self._unplaced_since = self._unplaced_since or now
        if self.capacity_wait is None and now - self._unplaced_since >= self.UNPLACED_AFTER_S:
            self.capacity_wait = {"since": time.time() - (now - self._unplaced_since), "step": step}
            self.events.log("waiting_for_capacity", step=step, world_size=world, size=self.size, missing=missing,
                            min_workers=self.min_workers)

    def formed(self, world: int) -> None:
        """A group formed from scratch: no rank left behind is coming."""
        self.regrowing = 0
        self.note_size(world)

    def note_size(self, world: int) -> None:
        """Start (or stop) the clock of a run below min_workers; a wait for capacity ends
        where the run has its size again."""
        if world >= self.size:
            self._unplaced_since = self.capacity_wait = None
        if world >= self.min_workers:
            self._short_since = None
        elif self._short_since is None:
            self._short_since = time.monotonic()

    def check_short(self, world: int) -> None:
        """A run that went on below min_workers after a failure (failure.recovery: fast) waits
        for its replacements up to scaling.placement_timeout_s, as a recovery that waits for
        them does, then fails: a fixed-size run keeps its world size."""
        if self._short_since is None or time.monotonic() - self._short_since < self.placement_timeout_s:
            return
        raise PlacementError(
            f"only {world} workers for {time.monotonic() - self._short_since:.0f} s, fewer than "
            f"scaling.min_workers={self.min_workers}: the lost workers' replacements were not placed and "
            f"up within scaling.placement_timeout_s={self.placement_timeout_s:g}. Add nodes, or lower "
            "scaling.min_workers (or num_workers)")

    def resized(self, old_world: int, world: int, old_nodes: list[Node], leaving: dict[int, dict[str, Any]],
                reformed: Reformed, seconds: float) -> None:
        """The group re-formed after a pause, from `old_world` ranks on `old_nodes` to `world`,
        without the `leaving` ones (rank -> its node's drain, or a slow worker's move);
        `seconds`: the pause."""
        for rank in sorted(r for r, d in leaving.items() if d.get("slow")):
            self.events.log("slow_worker_replaced", step=reformed.step, rank=rank, node=old_nodes[rank].ip,
                            old_pid=old_nodes[rank].pid, moved=rank in reformed.moved, seconds=seconds, steps_lost=0,
                            pids=[n.pid for n in reformed.nodes])
        drains = {r: d for r, d in leaving.items() if not d.get("slow")}
        for node_id in sorted({d["node_id"] for d in drains.values()}):
            ranks = sorted(r for r, d in drains.items() if d["node_id"] == node_id)
            drain = drains[ranks[0]]
            self.events.log("left_node", step=reformed.step, node=old_nodes[ranks[0]].ip, node_id=node_id,
                            deadline=drain["deadline"], ranks=ranks,
                            moved=[r for r in ranks if r in reformed.moved],
                            dropped=[r for r in ranks if r in reformed.dropped], seconds=seconds,
                            seconds_to_deadline=(round(drain["deadline"] - time.time(), 3)
                                                 if drain["deadline"] else None),
                            steps_lost=0, reason=drain["reason"], pids=[n.pid for n in reformed.nodes])
        if world != old_world or not leaving:  # replacements in the leavers' places: no resize
            cause = ("preemption" if drains else "slow worker" if leaving
                     else "lost workers replaced" if self.regrowing and reformed.added else "room to grow")
            waited = {}
            if self.capacity_wait is not None and world >= self.size:
                waited = {"capacity_waited_s": round(time.time() - self.capacity_wait["since"], 3)}
                self.capacity_wait = None
            self.log_resize(old_world, world, reformed, seconds, cause, **waited)
        self.regrowing = max(0, self.regrowing - reformed.added)

    def log_resize(self, old_world: int, world: int, reformed: Reformed, seconds: float, cause: str,
                   **more: Any) -> None:
        """`seconds`: the pause of training, from the workers stopping to them going on."""
        self.events.log("resized", step=reformed.step, old_world_size=old_world, new_world_size=world,
                        seconds=seconds, cause=cause, added=reformed.added, dropped=reformed.dropped,
                        pids=[n.pid for n in reformed.nodes], **more)
