"""Slots: the placement groups that reserve a place for each worker, one group per slot.

The run's size in slots (scaling.num_workers) is placed together, all at once, with the
placement strategy (one group of that many bundles, which places all or none); that group is
then traded for one single-bundle group per slot on the same nodes, before any worker
starts. Where it finds no room within scaling.placement_timeout_s, min_workers slots are
placed the same way and the run starts with those. On a Ray of one node that cannot grow
(one started for the driver) the single groups are asked for at once.
The run asks for one more single-bundle group per slot it lacks or may grow by. Those stay
pending until the cluster has room, which is also what asks the autoscaler for it; a free
slot whose group is placed gets a worker started in it, which joins the group at the next
re-form once it is up.

One group per slot because of what Ray does with a group whose node is lost: it reschedules
the lost bundle, and while that bundle finds no room the GCS retries it without backoff,
taking a core for as long as it stays so (Ray 2.60: `SchedulePendingPlacementGroups` run 5
million times in two minutes, the GCS and the head's dashboard agent at 40 to 60% of a core
each, the workers twentyfold slower; ray-project/ray#65970). A multi-bundle group cannot
give one bundle back without its other workers. So a lost worker's slot gets a new group
(`renew`) unless a warm spare takes it over, before Ray knows whether its node is gone
(Ray holds a node dead only after its health checks fail, 13-15 s here): a pending group is
retried with backoff, and one on a node still alive is placed there again at once. A free
slot whose node is lost since (its group rescheduling) is renewed the same way
(`renew_lost`, at every look for room).
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
from .._internals import single_slot_on
from ..policy import keep_waiting_for_placement
from .actors import Roster, Slot, kept_for_a_new_driver, resources_text, start_worker
from .orphans import waiting

Joiner = tuple[Slot, Any, Any]
"""A worker started in a free slot: (its slot, its actor, its node() call)."""


class Slots:
    # A run starts with the slots beyond its size that the cluster places this quickly;
    # the others join later, at a resize.
    EXTRA_AT_START_S = 1.0
    # Where the run's size found no room in time: how long the fewer workers it starts with
    # may take to be placed (the room for them is there or not: a placement takes moments).
    SMALLER_WITHIN_S = 5.0

    def __init__(self, config: Config, bundle: dict[str, float], cluster_can_grow: bool):
        self.config, self.bundle, self.cluster_can_grow = config, bundle, cluster_can_grow
        self.pgs: list[Any] = []  # the core group first
        self.joining: list[Joiner] = []

    def reserve(self) -> list[Slot]:
        """Reserve the run's size (scaling.size) in slots at once, and ask for the rest up to
        max_workers; the slots placed. Where the cluster has no room for its size within
        scaling.placement_timeout_s, the run starts with the slots it has, at least
        min_workers, and the others join as they are placed (a resize)."""
        scaling = self.config.scaling
        size, fewest = scaling.size, scaling.min_workers
        self._check_fits(size)
        deadline = time.monotonic() + scaling.placement_timeout_s
        extra_within = self.EXTRA_AT_START_S
        if self.cluster_can_grow or scaling.placement == "STRICT_SPREAD":
            nodes = self._gang_nodes(size, deadline, last=size == fewest)
            if nodes is None:  # fewer, placed together the same way; the rest as they come
                nodes = self._gang_nodes(fewest, time.monotonic() + self.SMALLER_WITHIN_S, last=True)
                # The room there is for more than min_workers is the run's own: it starts
                # with it rather than growing into it a moment later.
                extra_within = self.SMALLER_WITHIN_S
        else:
            # One node (a Ray started for this driver, no autoscaler): the gang would place
            # every slot there, and a group asked for as it is removed waits out Ray's retry
            # (0.5 s on a 2-CPU Ray, where the gang held every CPU).
            nodes = [ray.get_runtime_context().get_node_id()] * size
        # The same nodes, one group each (a soft target: were the room taken meanwhile,
        # another node serves; _internals.single_slot_on).
        self.pgs = [single_slot_on(self.bundle, node, **kept_for_a_new_driver(self.config)) for node in nodes]
        placed = self._wait_ready(self.pgs, max(deadline, time.monotonic() + self.SMALLER_WITHIN_S), fewest)
        # Only now: single bundles asked for first could take the room the core needs.
        extras = [self._group() for _ in range(scaling.max_workers - len(nodes))]
        self.pgs += extras
        if extras:
            refs = [pg.ready() for pg in extras]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=extra_within)
            placed += [pg for pg, ref in zip(extras, refs) if ref in ready]
        return [(pg, 0) for pg in placed]

    def _gang_nodes(self, count: int, deadline: float, last: bool) -> list[str] | None:
        """The nodes of `count` slots placed together with the placement strategy (one group
        of that many bundles places all or none), the group given back; None where it was not
        placed by `deadline` (a PlacementError if it is the `last` try)."""
        gang = placement_group([self.bundle] * count, strategy=self.config.scaling.placement)
        self.pgs = [gang]
        try:
            if not self._wait_ready([gang], deadline, 1 if last else 0):
                return None
            nodes = placement_group_table(gang)["bundles_to_node_id"]
            return [nodes[i] for i in range(count)]
        finally:
            remove_placement_group(gang)
            self.pgs = []

    def _wait_ready(self, pgs: list[Any], deadline: float, need: int) -> list[Any]:
        """Those of `pgs` placed by `deadline` (all of them, if they are, at once); a
        PlacementError if fewer than `need`."""
        refs = [pg.ready() for pg in pgs]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
        if len(ready) < need:
            self._unplaced(need)
        return [pg for pg, ref in zip(pgs, refs) if ref in ready]

    def _unplaced(self, count: int) -> None:
        scaling = self.config.scaling
        timeout = scaling.placement_timeout_s
        held = waiting()
        raise PlacementError(
            f"could not place {count} workers of {self.bundle} each "
            f"({scaling.placement}) within scaling.placement_timeout_s={timeout:g}; "
            f"{resources_text()}. Lower scaling.num_workers (or min_workers) or "
            "scaling.resources_per_worker, or add nodes"
            + (f". The workers of {', '.join(held)}, whose driver was lost, hold resources for a new driver "
               "until failure.driver_grace_s ends: rerun that run's command to continue it, or `raytrainer "
               "release RUN_DIR` to free them now" if held else "")
        )

    def single(self) -> Slot:
        """A new slot in a group of its own (Ray places it off draining nodes)."""
        pg = self._group()
        self.pgs.append(pg)
        return pg, 0

    def _group(self) -> Any:
        """A placement group of one worker's bundle, pending until the cluster has room."""
        return placement_group([self.bundle], **kept_for_a_new_driver(self.config))

    def release(self, slot: Slot) -> None:
        """Give back a slot no worker uses (its placement group)."""
        if slot[0] in self.pgs:
            self.pgs.remove(slot[0])
            remove_placement_group(slot[0])

    def renew(self, slot: Slot) -> Slot:
        """A new group in place of `slot`'s (removed), pending until the cluster has room."""
        pg, new = slot[0], self._group()
        if pg in self.pgs:
            self.pgs[self.pgs.index(pg)] = new
            remove_placement_group(pg)
        else:
            self.pgs.append(new)
        return new, 0

    def renew_lost(self, slots: Iterable[Slot], tables: dict[Any, dict] | None = None) -> dict[Slot, Slot]:
        """Of `slots`, those whose node is lost (their group rescheduling), each renewed:
        old -> new. `tables`: their groups' placement_group_table entries, if already read."""
        renewed = {}
        for pg in {pg for pg, _ in slots if pg in self.pgs}:
            table = tables[pg] if tables and pg in tables else placement_group_table(pg)
            if table.get("state") == "RESCHEDULING":
                renewed[(pg, 0)] = self.renew((pg, 0))
        return renewed

    def starting(self) -> int:
        """How many workers started in free slots are not up yet."""
        return len(self.joining) - len(self.ready_joiners(take=False))

    def start_joiners(self, in_use: Iterable[Slot], draining: Callable[[], dict[str, Any]]) -> int:
        """Start a worker in every free slot the cluster has placed (not on a node being
        drained); return how many started workers are ready to join at the next re-form.
        A worker started in a slot whose node has been lost since goes, and its slot is
        renewed."""
        in_use = set(in_use)
        tables = {pg: placement_group_table(pg) for pg in self.pgs if (pg, 0) not in in_use}
        renewed = self.renew_lost([(pg, 0) for pg in tables], tables)
        for slot, actor, _ in [j for j in self.joining if j[0] in renewed]:
            ray.kill(actor, no_restart=True)
        self.joining = [j for j in self.joining if j[0] not in renewed]
        taken = {slot for slot, _, _ in self.joining}
        drained = None
        for pg, table in tables.items():
            if (pg, 0) in renewed or (pg, 0) in taken or table.get("state") != "CREATED":
                continue
            if drained is None:
                drained = draining()
            if table.get("bundles_to_node_id", {}).get(0) in drained:  # a slot on a node about to go: not now
                continue
            actor = start_worker(self.config, self.bundle, (pg, 0))
            self.joining.append(((pg, 0), actor, actor.warm_node.remote()))  # once its state is built
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
        calls in `asked`, else new ones); return their nodes by rank, each written into the
        roster at once: a recovery attempt that fails after this (another worker lost while
        the group forms) leaves the next attempt the node, and the pid, of the worker now in
        the rank, not of the one it replaced. How long: policy.keep_waiting_for_placement."""
        scaling = self.config.scaling
        asked = asked or {}
        refs = {asked[r] if r in asked else roster.actors[r].node.remote(): r for r in ranks}
        placed: dict[int, Node] = {}
        t0 = checked = time.monotonic()
        while refs:
            if time.monotonic() - checked > 1.0:  # a node lost meanwhile: ask for its slots anew
                checked = time.monotonic()
                self._restart_in_renewed(roster, refs)
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0.1)
            for ref in ready:
                rank = refs.pop(ref)
                try:
                    placed[rank] = ray.get(ref)
                    if rank < len(roster.nodes):
                        roster.nodes[rank] = placed[rank]
                except (RayActorError, RayTaskError):
                    # Lost before it started: sent to the node that was just lost, before Ray
                    # knew it dead. Its slot is placed again elsewhere once there is room.
                    ray.kill(roster.actors[rank], no_restart=True)
                    roster.actors[rank] = start_worker(self.config, self.bundle, roster.slots[rank])
                    refs[roster.actors[rank].node.remote()] = rank
            if not keep_waiting_for_placement(time.monotonic() - t0, len(placed), others,
                                              size=scaling.size,
                                              replace_timeout_s=scaling.replace_timeout_s,
                                              placement_timeout_s=scaling.placement_timeout_s):
                break
        return placed

    def _restart_in_renewed(self, roster: Roster, refs: dict[Any, int]) -> None:
        """The workers waited for (`refs`: node() call -> rank) whose slot's node is lost,
        started again in a new slot."""
        renewed = self.renew_lost([roster.slots[r] for r in refs.values()])
        for ref, rank in list(refs.items()):
            if roster.slots[rank] in renewed:
                ray.kill(roster.actors[rank], no_restart=True)
                roster.slots[rank] = renewed[roster.slots[rank]]
                roster.actors[rank] = start_worker(self.config, self.bundle, roster.slots[rank])
                del refs[ref]
                refs[roster.actors[rank].node.remote()] = rank

    FREED_WITHIN_S = 1.0

    def shutdown(self) -> None:
        """Kill the newcomers and remove every placement group; on a Ray of one node started
        for the driver, then wait (a little) until Ray counts their room free again: the
        next run of this driver then reserves its slots at once, where a group asked for
        before waits out Ray's retry, which is longer than the wait here."""
        for _, actor, _ in self.joining:
            ray.kill(actor, no_restart=True)
        self.joining = []
        placed = [] if self.cluster_can_grow else [pg for pg in self.pgs if _state(pg) == "CREATED"]
        before = ray.available_resources() if placed else {}
        for pg in self.pgs:
            remove_placement_group(pg)
        self.pgs = []
        freed = {k: before.get(k, 0) + v * len(placed) - 1e-6 for k, v in self.bundle.items()}
        deadline = time.monotonic() + self.FREED_WITHIN_S
        while placed and time.monotonic() < deadline:
            available = ray.available_resources()
            if all(available.get(k, 0) >= v for k, v in freed.items()):
                break
            time.sleep(0.01)

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


def _state(pg: Any) -> str | None:
    try:
        return placement_group_table(pg).get("state")
    except Exception:  # noqa: BLE001 (gone)
        return None
