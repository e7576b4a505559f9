"""Slots: the placement groups that reserve a place for each worker.

One placement group of scaling.min_workers bundles (with the placement strategy), reserved
all at once before anything starts, and for an elastic run one single-bundle group per
worker it may grow by, created after it. Those stay pending until the cluster has room,
which is also what asks the autoscaler for it; a free slot whose group is placed gets a
worker started in it, which joins the group at the next re-form once it is up. A slot whose
node is lost is rescheduled by Ray when room appears, and used again the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from ...config import Config
from ...contract import Node
from ...errors import PlacementError
from ..policy import keep_waiting_for_placement
from .actors import Roster, Slot, resources_text, start_worker

Joiner = tuple[Slot, Any, Any]
"""A worker started in a free slot: (its slot, its actor, its node() call)."""


class Slots:
    # An elastic run starts with the slots beyond min_workers that the cluster places this
    # quickly; the others join later, at a resize.
    EXTRA_AT_START_S = 1.0

    def __init__(self, config: Config, bundle: dict[str, float], cluster_can_grow: bool):
        self.config, self.bundle, self.cluster_can_grow = config, bundle, cluster_can_grow
        self.pgs: list[Any] = []  # the core group first
        self.joining: list[Joiner] = []

    def reserve(self) -> list[Slot]:
        """Reserve min_workers slots at once and ask for the rest; the slots placed."""
        scaling = self.config.scaling
        self._check_fits(scaling.min_workers)
        core = placement_group([self.bundle] * scaling.min_workers, strategy=scaling.placement)
        self.pgs = [core]
        timeout = scaling.placement_timeout_s
        ready, _ = ray.wait([core.ready()], timeout=timeout)
        if not ready:
            raise PlacementError(
                f"could not place {scaling.min_workers} workers of {self.bundle} each "
                f"({scaling.placement}) within scaling.placement_timeout_s={timeout:g}; "
                f"{resources_text()}. Lower scaling.num_workers (or min_workers) or "
                "scaling.resources_per_worker, or add nodes"
            )
        slots = [(core, i) for i in range(scaling.min_workers)]
        # Only now: single bundles asked for first could take the room the core needs.
        extras = [placement_group([self.bundle]) for _ in range(scaling.max_workers - scaling.min_workers)]
        self.pgs += extras
        if extras:
            refs = [pg.ready() for pg in extras]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.EXTRA_AT_START_S)
            slots += [(pg, 0) for pg, ref in zip(extras, refs) if ref in ready]
        return slots

    def single(self) -> Slot:
        """A new slot in a group of its own (Ray places it off draining nodes)."""
        pg = placement_group([self.bundle])
        self.pgs.append(pg)
        return pg, 0

    def release(self, slot: Slot) -> None:
        """Give back a slot no worker uses, where Ray allows it: a group of its own is
        removed; a bundle of the core group stays reserved (a slot to grow into)."""
        pg = slot[0]
        if pg is not self.pgs[0] and len(pg.bundle_specs) == 1 and pg in self.pgs:
            self.pgs.remove(pg)
            remove_placement_group(pg)

    def start_joiners(self, in_use: Iterable[Slot], draining: Callable[[], dict[str, Any]]) -> int:
        """Start a worker in every free slot the cluster has placed (not on a node being
        drained); return how many started workers are ready to join at the next re-form."""
        taken = set(in_use) | {slot for slot, _, _ in self.joining}
        placed: dict[Any, dict[int, str] | None] = {}  # pg -> its bundles' nodes, once placed
        drained = None
        for slot in [(pg, i) for pg in self.pgs for i in range(len(pg.bundle_specs)) if (pg, i) not in taken]:
            pg = slot[0]
            if pg not in placed:
                table = placement_group_table(pg)
                placed[pg] = table.get("bundles_to_node_id", {}) if table.get("state") == "CREATED" else None
            if placed[pg] is not None:
                if drained is None:
                    drained = draining()
                if placed[pg].get(slot[1]) in drained:  # a slot on a node about to go: not now
                    continue
                actor = start_worker(self.config, self.bundle, slot)
                self.joining.append((slot, actor, actor.node.remote()))
        return len(self.ready_joiners(take=False))

    def ready_joiners(self, take: bool) -> list[tuple[Slot, Any, Node]]:
        """The started workers that are up, as (slot, actor, node); `take` removes them
        from those joining. Workers that failed to start are dropped."""
        ready, still = [], []
        for slot, actor, ref in self.joining:
            try:
                node = ray.get(ref, timeout=0)
            except GetTimeoutError:
                still.append((slot, actor, ref))
                continue
            except (RayActorError, RayTaskError):
                ray.kill(actor, no_restart=True)
                continue
            ready.append((slot, actor, node))
            if not take:
                still.append((slot, actor, ref))
        self.joining = still
        return ready

    def wait_placed(self, roster: Roster, ranks: list[int], others: int,
                    asked: dict[int, Any] | None = None) -> dict[int, Node]:
        """Wait for the new workers of `ranks` to be placed and up (through their node()
        calls in `asked`, else new ones); return their nodes by rank. How long:
        policy.keep_waiting_for_placement."""
        scaling = self.config.scaling
        asked = asked or {}
        refs = {asked[r] if r in asked else roster.actors[r].node.remote(): r for r in ranks}
        placed: dict[int, Node] = {}
        t0 = time.monotonic()
        while refs:
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0.1)
            for ref in ready:
                rank = refs.pop(ref)
                try:
                    placed[rank] = ray.get(ref)
                except (RayActorError, RayTaskError):
                    # Lost before it started: sent to the node that was just lost, before Ray
                    # knew it dead. Its slot is placed again elsewhere once there is room.
                    ray.kill(roster.actors[rank], no_restart=True)
                    roster.actors[rank] = start_worker(self.config, self.bundle, roster.slots[rank])
                    refs[roster.actors[rank].node.remote()] = rank
            if not keep_waiting_for_placement(time.monotonic() - t0, len(placed), others,
                                              min_workers=scaling.min_workers,
                                              replace_timeout_s=scaling.replace_timeout_s,
                                              placement_timeout_s=scaling.placement_timeout_s):
                break
        return placed

    def shutdown(self) -> None:
        for _, actor, _ in self.joining:
            ray.kill(actor, no_restart=True)
        self.joining = []
        for pg in self.pgs:
            remove_placement_group(pg)
        self.pgs = []

    def _check_fits(self, num_workers: int) -> None:
        """Fail at once when no placement can ever succeed: the cluster cannot grow and
        lacks the resources in total."""
        if self.cluster_can_grow:
            return
        total = ray.cluster_resources()
        short = {k: v * num_workers for k, v in self.bundle.items() if v * num_workers > total.get(k, 0)}
        if short:
            raise PlacementError(
                f"{num_workers} workers of {self.bundle} each need {short} in total but "
                f"{resources_text(free=False)}. Lower scaling.num_workers or "
                "scaling.resources_per_worker, or connect to a larger cluster (--address)"
            )
