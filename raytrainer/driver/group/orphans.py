"""The workers a lost driver of a run left (worker/process/orphan.py), found by a new driver of the run:
taken over where every rank holds the same paused step, else ended.

A driver that died without stopping its workers leaves them detached, named in
contract.NAMESPACE, pausing at a step boundary and waiting failure.driver_grace_s for a new
driver. The new driver (the same command run again, `raytrainer resume`) asks every worker
named there what it holds (`Worker.orphan`): where the workers of this run are all there,
all paused at one step with the whole state each (replicated), it takes them over (their
driver is this process from now on) with their placement groups; the controller re-forms
the group from their memory. Otherwise it ends them and removes the run's groups, and the
run continues from its newest checkpoint. Workers of the run whose driver is alive are
another process's run: an error, never ended.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray

from ...config import Config
from ...contract import NAMESPACE, Orphan, placement_group_prefix, run_key
from ...errors import ConfigError
from .._internals import placement_groups_named
from .actors import ask_refs, control

PAUSE_WAIT_S = 30.0
"""How long the orphans get to notice their driver's death and reach their pause (they look
every second; the step in flight ends first)."""
ASK_S = 5.0


@dataclass
class Takeover:
    """The workers of a run taken over, by rank, and the run's placement groups."""

    actors: list[Any]
    found: list[Orphan]
    groups: list[tuple[Any, dict[str, Any]]]
    slots: list[tuple[Any, int]] = field(default_factory=list)
    """Each rank's slot (`slots`)."""

    @property
    def step(self) -> int:
        return self.found[0].step


def of_run(storage: str, name: str) -> list[tuple[Any, Orphan]]:
    """The worker actors of run `name` in `storage`, with what each holds."""
    key = run_key(storage, name)
    return [(h, o) for h, o in _named() if o.run == key]


def waiting() -> list[str]:
    """The run directories whose workers wait for a new driver (their resources held until
    failure.driver_grace_s ends), for a message that says why the cluster lacks room."""
    return sorted({o.where for _, o in _named() if o.orphaned and o.where})


def _named() -> list[tuple[Any, Orphan]]:
    """Every raytrainer worker actor (named in NAMESPACE) that answers, with what it holds."""
    handles = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") != NAMESPACE:
            continue
        try:
            handles.append(ray.get_actor(entry["name"], namespace=NAMESPACE))
        except ValueError:  # ended meanwhile
            continue
    answers = ask_refs([control(h, "orphan").remote() for h in handles], ASK_S)
    return [(h, o) for h, o in zip(handles, answers) if o is not None]


def find(config: Config, shown: str) -> Takeover | None:
    """Take over the workers a lost driver of this run left, if they hold a state to continue
    from; else end them (and the run's placement groups). None where none is taken over."""
    run = config.run
    deadline = time.monotonic() + PAUSE_WAIT_S
    while True:
        mine = of_run(run.storage, run.name)
        if not mine:
            release(run.storage, run.name, [])
            return None
        settled = all(o.orphaned and (o.paused or o.rank is None or o.world_size is None) for _, o in mine)
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if not all(o.orphaned for _, o in mine):
        raise ConfigError(
            f"run directory {shown!r} has workers whose driver is alive elsewhere (another machine's "
            "process trains this run); let that run end, or choose another run.name (e.g. --set run.name=NEW)")
    holders = [(h, o) for h, o in mine if o.paused and o.rank is not None]
    world = holders[0][1].world_size if holders else 0
    by_rank = {o.rank: (h, o) for h, o in holders}
    whole = (world and sorted(by_rank) == list(range(world)) and len({o.step for _, o in holders}) == 1
             and all(o.replicated for _, o in holders))
    if not whole:
        release(run.storage, run.name, [h for h, _ in mine])
        return None
    takeover = Takeover([by_rank[r][0] for r in range(world)], [by_rank[r][1] for r in range(world)],
                        placement_groups_named(placement_group_prefix(run.storage, run.name)))
    try:
        takeover.slots = slots(takeover)
    except LookupError:
        release(run.storage, run.name, [h for h, _ in mine])
        return None
    job = ray.get_runtime_context().get_job_id()
    taken = ask_refs([control(by_rank[r][0], "adopt").remote(job) for r in range(world)], ASK_S)
    if not all(taken):  # one ended its grace meanwhile
        release(run.storage, run.name, [h for h, _ in mine])
        return None
    for handle, orphan in mine:  # spares, newcomers: the new driver starts its own
        if orphan.rank is None or not orphan.paused:
            ray.kill(handle, no_restart=True)
    return takeover


def release(storage: str, name: str, actors: list[Any] | None = None) -> int:
    """End the workers of run `name` in `storage` (all that are left, where `actors` is None)
    and remove its placement groups; how many workers."""
    from ray.util.placement_group import remove_placement_group

    if actors is None:
        actors = [h for h, _ in of_run(storage, name)]
    for actor in actors:
        ray.kill(actor, no_restart=True)
    for pg, _ in placement_groups_named(placement_group_prefix(storage, name)):
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - removed meanwhile
            pass
    return len(actors)


def slots(takeover: Takeover) -> list[tuple[Any, int]]:
    """Each taken worker's slot: the group it runs in, or (a CPU worker pinned beside its
    slot's group) a group of the run on its node that no other worker has: the single-bundle
    groups of one node hold the same bundle, so any serves."""
    groups = {pg.id.hex(): (pg, info) for pg, info in takeover.groups}
    taken = {o.placement_group for o in takeover.found if o.placement_group in groups}
    free = [(pg, info) for pg_id, (pg, info) in groups.items() if pg_id not in taken]
    out = []
    for orphan in takeover.found:
        if orphan.placement_group in groups:
            out.append((groups[orphan.placement_group][0], 0))
            continue
        node = orphan.node.node_id if orphan.node else None
        match = next((g for g in free if node in (g[1].get("bundles_to_node_id") or {}).values()), None)
        if match is None:
            raise LookupError(f"rank {orphan.rank}'s slot is not among the run's placement groups")
        free.remove(match)
        out.append((match[0], 0))
    return out
