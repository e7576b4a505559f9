"""Drains: nodes being drained for preemption, and replacements for the workers on them.

A worker on a node being drained gets a replacement in a new single-bundle group, which Ray
places on another node (it never places on a draining node); once the workers have paused,
the replacement takes the worker's rank and the state, and the worker leaves, its old slot
given back. A worker that leaves without a replacement (an elastic run without room) leaves
its slot free: once the node is gone, the slot gets a new placement group (slots.renew_lost)
and the run grows into it when the cluster has room.
"""

from __future__ import annotations

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from ...config import Config
from ...contract import Node
from .._internals import draining_nodes  # noqa: F401 (the group asks for it here)
from .actors import Roster, Slot, start_worker
from .slots import Joiner, Slots


class Moves:
    """The replacements started for workers on draining nodes, by rank."""

    def __init__(self, config: Config, bundle: dict[str, float], slots: Slots):
        self.config, self.bundle, self.slots = config, bundle, slots
        self.by_rank: dict[int, Joiner] = {}

    def __contains__(self, rank: int) -> bool:
        return rank in self.by_rank

    def slots_in_use(self) -> list[Slot]:
        return [slot for slot, _, _ in self.by_rank.values()]

    def replacements(self, ranks: list[int]) -> list[int]:
        """Start a worker on another node for each of `ranks` (in a new single-bundle group,
        pending until the cluster has room, which asks the autoscaler for it); give up those
        started for ranks not asked now; return the ranks whose replacement is up."""
        for rank in [r for r in self.by_rank if r not in ranks]:
            self.cancel(rank)
        for rank in ranks:
            if rank not in self.by_rank:
                self.by_rank[rank] = self._start(self.slots.single())
        ready = []
        for rank, (slot, actor, ref) in list(self.by_rank.items()):
            try:
                ray.get(ref, timeout=0)
                ready.append(rank)
            except GetTimeoutError:
                pass
            except (RayActorError, RayTaskError):  # it died (its node with it?): start another
                ray.kill(actor, no_restart=True)
                self.by_rank[rank] = self._start(slot)
        return sorted(ready)

    def cancel(self, rank: int) -> None:
        slot, actor, _ = self.by_rank.pop(rank)
        ray.kill(actor, no_restart=True)
        self.slots.release(slot)

    def cancel_all(self) -> None:
        for rank in list(self.by_rank):
            self.cancel(rank)

    def take(self, roster: Roster, rank: int, wait: bool = False) -> Node | None:
        """Put the replacement started for `rank` in its place if it is up (or, with `wait`,
        whether or not: the caller waits for it to be placed); its node if up."""
        slot, actor, ref = self.by_rank[rank]
        try:
            node = ray.get(ref, timeout=0)
        except (GetTimeoutError, RayActorError, RayTaskError):
            node = None
            if not wait:
                return None
        del self.by_rank[rank]
        old = roster.slots[rank]
        roster.actors[rank], roster.slots[rank] = actor, slot
        self.slots.release(old)
        return node

    def shutdown(self) -> None:
        for _, actor, _ in self.by_rank.values():
            ray.kill(actor, no_restart=True)
        self.by_rank = {}

    def _start(self, slot: Slot) -> Joiner:
        actor = start_worker(self.config, self.bundle, slot)
        return slot, actor, actor.node.remote()
