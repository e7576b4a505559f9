"""Worker actors: making one in a slot, calling it, reading how a call ended, killing it.

The group's workers by rank are a `Roster`: three lists kept in step (actor, node, slot),
shared by the group's parts; a re-form renumbers all three at once.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group_table
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from ...config import Config
from ...contract import NAMESPACE, WORKER_ACTOR, Failure, Node, placement_group_prefix
from ...errors import PeerFailure, RaytrainerError, WorkerError
from ...task import import_object
from .._internals import is_placement_group_resource, mute_death_notice
from . import kept

# Calls the driver makes while run() trains or is blocked: a concurrency group of their
# own, so that a worker stuck in a collective still answers them.
CONTROL = "control"

Slot = tuple[Any, int]
"""A reserved place for one worker: (placement group, bundle index)."""


@dataclass
class Roster:
    """The group's workers, by rank."""

    actors: list[Any] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    slots: list[Slot] = field(default_factory=list)
    asking: dict[tuple[int, str], tuple[Any, Any]] = field(default_factory=dict)
    """(id of an actor, a control call) -> (the actor, the call not answered yet): see ask_once."""

    def ip(self, rank: int) -> str | None:
        return self.nodes[rank].ip if rank < len(self.nodes) else None


def worker_bundle(config: Config, use_gpu: bool) -> dict[str, float]:
    bundle = dict(config.scaling.resources_per_worker or {"CPU": 1})
    if use_gpu:
        bundle.setdefault("GPU", 1)
    return {k: float(v) for k, v in bundle.items() if v}


def start_worker(config: Config, bundle: dict[str, float], slot: Slot, joining: bool = True) -> Any:
    """A worker for `slot`, holding its resources. `joining`: it will join a running group
    (a replacement, a newcomer), taking a survivor's state; it builds the task's training
    state as it starts (worker/process/warm.py), not in the pause of the join.

    A CPU worker of a Task trained with DDP runs on the slot's node beside the slot's
    placement group (which holds the resources), not in it: a finished run can then keep
    its process for the next run of this driver (kept.py), which takes it here."""
    args, kwargs = (config.to_dict(), config.task.payload), {"warm": joining, "cwd": config.run.cwd}
    node = placed_on(slot) if keepable(config, bundle) else None
    if node is not None:
        return kept.take(node, *args, **kwargs) or _pinned(node, config).remote(*args, **kwargs)
    extra = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    pg, index = slot
    return _remote_worker().options(
        num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), resources=extra or None,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
        **outliving_the_driver(config),
    ).remote(*args, **kwargs)  # the payload: its object-store ref


def start_spare(config: Config, node_id: str, cold: bool = True) -> Any | None:
    """A spare on `node_id`: it takes no resources, and waits, torch imported, until it
    replaces a lost worker of that node in its slot. Pinned to the node, not to a slot's
    placement group: a group removed (a lost or drained node's) would take it along.
    A kept process serves where there is one; else a new one starts if `cold`, or None."""
    args, kwargs = (config.to_dict(), config.task.payload), {"spare": True, "cwd": config.run.cwd}
    return ((kept.take(node_id, *args, **kwargs) if keepable(config, {}) else None)
            or (_pinned(node_id, config).remote(*args, **kwargs) if cold else None))


def keepable(config: Config, bundle: dict[str, float]) -> bool:
    """Whether the process of a worker with `bundle` may be kept for the next run
    (kept.py): a worker of one CPU (or less) training a Task (DDP or FSDP). A GPU worker
    needs its GPU assigned at creation, in its slot; Ray sets OMP_NUM_THREADS to an actor's
    CPUs at its start, which a process kept for runs of any size cannot follow (1 for one
    that holds none, as for a 1-CPU worker); your own loop may leave state in the process
    that keeping.py cannot see (a framework's singletons). FSDP's meshes stay in torch's
    registry of the process, but a run's meshes are named by a generation every rank agrees
    on (sharded.default_mesh), so a later run never meets an earlier run's."""
    return not bundle.get("GPU") and bundle.get("CPU", 0) <= 1 and not config.task.is_loop


def placed_on(slot: Slot) -> str | None:
    """The node `slot`'s placement group holds its bundle on; None while it is not placed."""
    pg, index = slot
    try:
        table = placement_group_table(pg)
    except Exception:  # noqa: BLE001 (removed meanwhile)
        return None
    if table.get("state") != "CREATED":
        return None
    return table.get("bundles_to_node_id", {}).get(index)


def _pinned(node_id: str, config: Config) -> Any:
    """The worker actor class, placed on `node_id` and holding no resources."""
    return _remote_worker().options(
        num_cpus=0, num_gpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        **outliving_the_driver(config))


def outliving_the_driver(config: Config) -> dict[str, Any]:
    """A worker actor's options: detached and named (in contract.NAMESPACE), so that a
    driver's death leaves it to wait for a new driver of its run (failure.driver_grace_s,
    worker/process/orphan.py), which finds it by its name; with no grace, Ray's default: it ends
    with its driver."""
    if config.failure.driver_grace_s <= 0:
        return {}
    return {"lifetime": "detached", "name": f"raytrainer-{uuid.uuid4().hex}", "namespace": NAMESPACE}


def kept_for_a_new_driver(config: Config) -> dict[str, Any]:
    """A slot's placement group options: detached with its worker (outliving_the_driver), and
    named with the run's prefix, by which the workers remove the run's groups when no new
    driver came (worker/process/orphan.py) and a new driver finds them."""
    if config.failure.driver_grace_s <= 0:
        return {}
    prefix = placement_group_prefix(config.run.storage, config.run.name)
    return {"lifetime": "detached", "name": f"{prefix}{uuid.uuid4().hex[:12]}"}


def alive_nodes() -> set[str]:
    """The ids of the nodes Ray holds alive (a node lost a moment ago may still be among
    them: Ray marks it dead after its health checks fail)."""
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def control(actor: Any, method: str) -> Any:
    return getattr(actor, method).options(concurrency_group=CONTROL)


def ask(roster: Roster, ranks: Iterable[int], method: str, timeout: float) -> list[Any]:
    """A control call on each of `ranks`; None for those that did not answer in time."""
    return ask_refs([control(roster.actors[r], method).remote() for r in ranks], timeout)


def ask_refs(refs: list[Any], timeout: float) -> list[Any]:
    """The answers of calls made; None for those that did not answer within `timeout`."""
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=timeout)
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=0))
        except (GetTimeoutError, RayActorError, RayTaskError):
            out.append(None)
    return out


def ask_once(roster: Roster, ranks: Iterable[int], method: str, timeout: float) -> list[Any]:
    """`ask`, but a call still unanswered from an earlier ask is waited for again rather than
    made anew: a worker that a loaded machine lets answer only after `timeout` (its process
    waits for a core, its call in a queue) answers the next time, while one that never
    answers (frozen) stays silent."""
    refs = []
    for rank in ranks:
        actor = roster.actors[rank]
        key = (id(actor), method)
        if key not in roster.asking:
            roster.asking[key] = (actor, control(actor, method).remote())
        refs.append(roster.asking[key][1])
    ray.wait(refs, num_returns=len(refs), timeout=timeout)
    out = []
    for rank, ref in zip(ranks, refs):
        try:
            out.append(ray.get(ref, timeout=0))
        except GetTimeoutError:
            out.append(None)
            continue
        except (RayActorError, RayTaskError):
            out.append(None)
        roster.asking.pop((id(roster.actors[rank]), method), None)
    for key in [k for k, (actor, _) in roster.asking.items() if not any(a is actor for a in roster.actors)]:
        del roster.asking[key]  # gone from the roster: nobody asks it again
    return out


def outcome(roster: Roster, rank: int, ref: Any) -> Any:
    """What a call on `rank` returned, or the Failure it ended in."""
    ip = roster.ip(rank)
    try:
        return ray.get(ref)
    except RayTaskError as exc:
        cause = exc.cause if isinstance(exc.cause, BaseException) else exc
        if isinstance(cause, PeerFailure):
            return Failure(rank, "interrupted", str(cause), None, ip)
        step = cause.step - 1 if isinstance(cause, WorkerError) and cause.step else None
        message = cause.message if isinstance(cause, WorkerError) else f"{type(cause).__name__}: {cause}"
        if not isinstance(cause, RaytrainerError):
            cause = WorkerError(rank, message)
        return Failure(rank, "error", message, step, ip, cause)
    except RayActorError as exc:
        return Failure(rank, "died", f"the worker process died ({type(exc).__name__}): "
                       f"{str(exc).splitlines()[0] if str(exc) else ''}", None, ip)


def kill(roster: Roster, rank: int, answering: Iterable[int] = ()) -> list[Any]:
    """Kill a worker now. ray.kill alone waits for a frozen (SIGSTOPed) process to exit
    gracefully for RAY_kill_worker_timeout_milliseconds (5 s) before Ray kills it, and its
    peers wait with it: a SIGKILL from another of our processes on its node (a peer's
    control channel answers at once; else a task there, which may first have to start a
    process) ends it in milliseconds. Returns the calls made through the ranks of
    `answering` on its node (peers known to answer), each answering whether its process was
    still running as it killed it."""
    node = roster.nodes[rank] if rank < len(roster.nodes) else None
    calls = []
    if node is not None and node.pid:
        mute_death_notice(node.pid)  # Ray's "unexpected system error": raytrainer says why itself
        helpers = [r for r in range(len(roster.nodes)) if r != rank and r < len(roster.actors)
                   and roster.nodes[r].node_id == node.node_id]
        answering = set(answering)
        calls = [control(roster.actors[r], "kill_process").remote(node.pid) for r in helpers if r in answering]
        if not calls and helpers:
            control(roster.actors[helpers[0]], "kill_process").remote(node.pid)
        elif not calls and node.node_id:
            ray.remote(_sigkill).options(
                num_cpus=0, max_retries=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)).remote(node.pid)
    ray.kill(roster.actors[rank], no_restart=True)
    return calls


def gather(refs: list[Any]) -> list[Any]:
    """ray.get of all refs, but raise the first failure as soon as it happens (the other
    workers may be blocked waiting for the failed one in a collective)."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        _get(ready[0], refs.index(ready[0]))
    return [ray.get(r) for r in refs]


def resources_text(free: bool = True) -> str:
    """The cluster's schedulable resources, for error messages (placement groups' own
    bundle resources and node labels left out)."""
    total = ray.cluster_resources()
    keys = sorted(k for k in total if not k.startswith(("node:", "accelerator_type:"))
                  and not is_placement_group_resource(k) and k not in ("memory", "object_store_memory"))
    if not free:
        return "the cluster has " + ", ".join(f"{k} {total[k]:g}" for k in keys) + " in total"
    available = ray.available_resources()
    return "the cluster has " + ", ".join(f"{k} {available.get(k, 0):g} free of {total[k]:g}" for k in keys)


_REMOTE_WORKER: Any = None


def _remote_worker() -> Any:
    global _REMOTE_WORKER
    if _REMOTE_WORKER is None:
        actor = import_object(WORKER_ACTOR, "contract.WORKER_ACTOR")
        _REMOTE_WORKER = ray.remote(concurrency_groups={CONTROL: 4})(actor)
    return _REMOTE_WORKER


def _sigkill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def _get(ref: Any, rank: int) -> Any:
    try:
        return ray.get(ref)
    except RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, RaytrainerError):
            raise cause from None
        raise WorkerError(rank, str(cause or exc)) from None
    except RayActorError as exc:
        raise WorkerError(rank, f"the worker process died ({exc.__class__.__name__}): {exc}") from None
