"""The controller's watch over nodes being drained (a preemption notice, an autoscaler's
scale-down): which workers must leave, when the group should pause to re-form without them
(policy.leave_draining_nodes), and their replacements started elsewhere meanwhile."""

from __future__ import annotations

import math
import time
from typing import Any, Callable

from ..contract import Node, WorkerGroup
from .metrics import EventLog
from .policy import draining_ranks, leave_draining_nodes


class DrainWatch:
    def __init__(self, group: WorkerGroup, events: EventLog, check_s: float, replace_timeout_s: float | None,
                 node_ip: Callable[[int], str | None]):
        self.group, self.events, self.check_s = group, events, check_s
        self.replace_timeout_s, self._node_ip = replace_timeout_s, node_ip
        self.checked_at = -math.inf  # due at once
        self._noticed: dict[str, float] = {}  # draining node id -> when we first saw it
        self.leaving: list[int] = []  # the ranks on draining nodes at the last check

    def check(self, nodes: list[Node], world: int, min_workers: int, step: int,
              pause_s: float, keep: list[int] = ()) -> dict[int, dict[str, Any]] | None:
        """About once every check_s: find the workers on nodes being drained; start their
        replacements elsewhere; return, once policy.leave_draining_nodes says so, the ranks
        to leave (rank -> its node's id, deadline and the reason), for the workers to pause
        and the group to re-form without them. `pause_s`: how long a pause takes to agree;
        `keep`: ranks moving for another reason (slow workers), whose replacements stay."""
        now = time.monotonic()
        if now - self.checked_at < self.check_s:
            return None
        self.checked_at = now
        draining = self.group.draining()
        on = draining_ranks(draining, [n.node_id for n in nodes])
        self._noticed = {node: at for node, at in self._noticed.items() if node in draining}
        if not on:
            self.leaving = []
            self.group.replacements(sorted(keep))  # give up any started for a drain that is over, or left
            return None
        for node, ranks in on.items():
            if node not in self._noticed:
                self._noticed[node] = now
                deadline = draining[node]
                self.events.log("node_draining", step=step, node=self._node_ip(ranks[0]), node_id=node,
                                deadline=deadline, ranks=ranks,
                                seconds_to_deadline=round(deadline - time.time(), 3) if deadline else None)
        leaving = self.leaving = sorted(r for ranks in on.values() for r in ranks)
        ready = [r for r in self.group.replacements(sorted(set(leaving) | set(keep))) if r in leaving]
        deadlines = [draining[node] for node in on if draining[node]]
        leave = leave_draining_nodes(
            leaving=len(leaving), ready=len(ready), world=world, min_workers=min_workers,
            seconds_left=min(deadlines) - time.time() if deadlines else None,
            waited_s=now - min(self._noticed[node] for node in on),
            replace_timeout_s=self.replace_timeout_s, pause_s=pause_s)
        if not leave.now:
            return None
        return {r: {"node_id": node, "deadline": draining[node], "reason": leave.reason}
                for node, ranks in on.items() for r in ranks}
