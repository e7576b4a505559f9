"""The Ray edge: placement groups and one Worker actor per reserved slot.

The controller drives any object with this interface (start, check_storage, setup, launch,
poll, status, dump_stacks, kill, reform, joinable, pause, shutdown); tests give it a fake
one without a cluster.

Slots: one placement group of scaling.min_workers bundles (with the placement strategy),
reserved all at once before anything starts, and for an elastic run one single-bundle
group per worker it may grow by, created after it. Those stay pending until the cluster
has room, which is also what asks the autoscaler for it; a slot whose group is placed
and whose worker is up is `joinable`. A slot whose node is lost is rescheduled by Ray
when room appears, and used again the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .config import Config
from .errors import NoSurvivors, PlacementError, RaytrainerError, WorkerError
from .policy import Failure
from .storage_check import check_shared_storage
from .worker import Worker


@dataclass
class Poll:
    rows: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # from workers, e.g. checkpoints
    done: bool = False
    result: Any = None  # rank 0's return value once done
    failures: list[Failure] = field(default_factory=list)  # workers whose run() ended otherwise
    finished: dict[int, Any] = field(default_factory=dict)  # rank -> result, newly finished
    paused: dict[int, Any] = field(default_factory=dict)  # rank -> result, newly paused (a resize)


def worker_bundle(config: Config, use_gpu: bool) -> dict[str, float]:
    bundle = dict(config.scaling.resources_per_worker or {"CPU": 1})
    if use_gpu:
        bundle.setdefault("GPU", 1)
    return {k: float(v) for k, v in bundle.items() if v}


class RayWorkerGroup:
    def __init__(self, config: Config, use_gpu: bool, *, cluster_can_grow: bool = True,
                 run_dir: Path | None = None):
        self.config = config
        self.run_dir = run_dir
        self.use_gpu = use_gpu
        self.cluster_can_grow = cluster_can_grow
        self.bundle = worker_bundle(config, use_gpu)
        self.actors: list[Any] = []  # by rank
        self.nodes: list[dict[str, Any]] = []  # by rank
        self.slots: list[tuple[Any, int]] = []  # by rank: (placement group, bundle index)
        self.pgs: list[Any] = []  # the core group first
        self._joining: list[tuple[tuple[Any, int], Any, Any]] = []  # (slot, actor, its node() ref)
        self._runs: list[Any] = []
        self._pending: list[Any] = []
        self._finished: dict[int, Any] = {}
        # A warm spare: an idle actor with torch imported, on a bundle's node but holding no
        # resources, takes a lost worker's place in a fraction of a cold start (CPU workers
        # only: a GPU worker needs its GPU assigned by Ray at creation).
        self._spare: Any = None
        self._spare_node: Any = None

    # ------------------------------------------------------------------ lifecycle

    # An elastic run starts with the slots beyond min_workers that the cluster places
    # this quickly; the others join later, at a resize.
    EXTRA_AT_START_S = 1.0

    def start(self) -> list[dict[str, Any]]:
        """Reserve min_workers slots at once (and ask for the rest), start a worker in each
        placed slot; return the workers' nodes."""
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
                f"{_resources_text()}. Lower scaling.num_workers (or min_workers) or "
                "scaling.resources_per_worker, or add nodes"
            )
        self.slots = [(core, i) for i in range(scaling.min_workers)]
        # Only now: single bundles asked for first could take the room the core needs.
        extras = [placement_group([self.bundle]) for _ in range(scaling.max_workers - scaling.min_workers)]
        self.pgs += extras
        if extras:
            refs = [pg.ready() for pg in extras]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.EXTRA_AT_START_S)
            self.slots += [(pg, 0) for pg, ref in zip(extras, refs) if ref in ready]
        self.actors = [self._actor(slot) for slot in self.slots]
        self.nodes = _gather([a.node.remote() for a in self.actors])
        self._start_spare()
        return self.nodes

    def _actor(self, slot: tuple[Any, int], spare: bool = False) -> Any:
        extra = {k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")}
        pg, bundle = slot
        return ray.remote(Worker).options(
            num_cpus=0 if spare else self.bundle.get("CPU", 0),
            num_gpus=0 if spare else self.bundle.get("GPU", 0),
            resources=None if spare else extra or None,
            max_concurrency=2,  # run() trains while drain(), status() answer the driver
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
        ).remote(self.config.to_dict())

    def check_storage(self, nodes: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Fail now if workers on other nodes cannot see the run directory."""
        if self.run_dir is None:
            return None
        return check_shared_storage(
            self.run_dir, self.config.run.storage, nodes, ray.get_runtime_context().get_node_id(),
            lambda path: _gather([a.sees_file.remote(path) for a in self.actors]),
        )

    def setup(self, resume: bytes | None = None) -> dict[str, int]:
        """Form the process group and build the task on every worker, loading `resume`
        (checkpoint bytes, put in the object store once for all workers)."""
        addr, port = ray.get(self.actors[0].rendezvous.remote())
        world = len(self.actors)
        state = ray.put(resume) if resume is not None else None
        infos = _gather([a.setup.remote(r, world, addr, port, self.use_gpu, state)
                         for r, a in enumerate(self.actors)])
        return infos[0]

    def launch(self) -> None:
        self._runs = [a.run.remote() for a in self.actors]
        self._pending = list(self._runs)
        self._finished = {}

    def poll(self, timeout: float) -> Poll:
        """Wait up to `timeout` for any worker's run() to end; collect new metric rows, and
        how each run() that ended did, if not by finishing."""
        ready, self._pending = ray.wait(self._pending, num_returns=1, timeout=timeout)
        if ready and self._pending:  # whatever else has ended too, without waiting
            more, self._pending = ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
            ready += more
        poll = Poll(*self._drain())
        for ref in ready:
            rank = self._runs.index(ref)
            outcome = self._outcome(rank, ref)
            if isinstance(outcome, Failure):
                poll.failures.append(outcome)
            elif outcome.get("status") == "interrupted":
                poll.failures.append(Failure(rank, "interrupted", outcome["cause"], outcome["step"],
                                             self.nodes[rank].get("ip")))
            elif outcome.get("status") == "paused":
                poll.paused[rank] = outcome
            else:
                self._finished[rank] = poll.finished[rank] = outcome
        if len(self._finished) == len(self._runs) and not poll.failures:
            poll.done = True
            poll.result = self._finished[0]
            rows, events = self._drain()
            poll.rows += rows
            poll.events += events
        return poll

    def _outcome(self, rank: int, ref: Any) -> dict[str, Any] | Failure:
        ip = self.nodes[rank].get("ip")
        try:
            return ray.get(ref)
        except RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            step = cause.step - 1 if isinstance(cause, WorkerError) and cause.step else None
            message = cause.message if isinstance(cause, WorkerError) else f"{type(cause).__name__}: {cause}"
            if not isinstance(cause, RaytrainerError):
                cause = WorkerError(rank, message)
            return Failure(rank, "error", message, step, ip, cause)
        except RayActorError as exc:
            return Failure(rank, "died", f"the worker process died ({type(exc).__name__}): "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}", None, ip)

    # ------------------------------------------------------------------ recovery

    def status(self, timeout: float = 1.0) -> list[dict[str, Any] | None]:
        """Each worker's progress (None: no answer within `timeout`, or dead)."""
        refs = [a.status.remote() for a in self.actors]
        ray.wait(refs, num_returns=len(refs), timeout=timeout)
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref, timeout=0))
            except (GetTimeoutError, RayActorError, RayTaskError):
                out.append(None)
        return out

    def dump_stacks(self, rank: int, timeout: float = 5.0) -> str | None:
        try:
            return ray.get(self.actors[rank].dump_stacks.remote(), timeout=timeout)
        except (GetTimeoutError, RayActorError, RayTaskError):
            return None

    def kill(self, rank: int) -> None:
        ray.kill(self.actors[rank], no_restart=True)

    def joinable(self) -> int:
        """Start a worker in every free slot the cluster has placed; return how many
        started workers are ready to join at the next `reform`."""
        placed: dict[Any, bool] = {}
        for slot in self._free_slots():
            pg = slot[0]
            if pg not in placed:
                placed[pg] = placement_group_table(pg).get("state") == "CREATED"
            if placed[pg]:
                actor = self._actor(slot)
                self._joining.append((slot, actor, actor.node.remote()))
        return len(self._ready_joiners(take=False))

    def pause(self) -> None:
        """Ask every worker to pause at a step boundary they agree on (run() returns "paused")."""
        for actor in self.actors:
            actor.request_pause.remote()

    def reform(self, dead: list[int]) -> dict[str, Any]:
        """Re-form the process group after a failure or a pause; all workers must have
        stopped. The `dead` ranks get a new worker in their slot if one is placed in time
        (scaling.replace_timeout_s while the others are at least min_workers, else
        scaling.placement_timeout_s), and are dropped otherwise; workers ready to join
        are added. Ranks keep their order (the remaining ones close up, newcomers come
        last); every worker gets the state of the survivor furthest ahead, unless it has
        it already. Returns the step, the new world size, and who was replaced, dropped,
        added and resynced (ranks before the re-form)."""
        scaling = self.config.scaling
        world = len(self.actors)
        survivors = [r for r in range(world) if r not in dead]
        if not survivors:
            raise NoSurvivors("no worker survived")
        for rank in dead:
            ray.kill(self.actors[rank], no_restart=True)
            self.actors[rank] = self._take_spare(rank) or self._actor(self.slots[rank])  # its slot is free again
        statuses = _gather([self.actors[r].status.remote() for r in survivors])
        position = {r: (s["step"], not s["after_pending"]) for r, s in zip(survivors, statuses)}
        source = max(survivors, key=lambda r: position[r])
        state = self.actors[source].get_state.remote()  # stays in the object store
        placed = self._wait_placed(dead, len(survivors) + len(self._ready_joiners(take=False)))
        for rank in dead:
            if rank not in placed:  # its slot stays reserved: it may join later
                ray.kill(self.actors[rank], no_restart=True)
        joiners = self._ready_joiners(take=True)
        keep = [r for r in range(world) if r in placed or r not in dead]
        self.actors = [self.actors[r] for r in keep] + [actor for _, actor, _ in joiners]
        self.slots = [self.slots[r] for r in keep] + [slot for slot, _, _ in joiners]
        self.nodes = [placed.get(r) or self.nodes[r] for r in keep] + [node for _, _, node in joiners]
        if len(self.actors) < scaling.min_workers:
            raise PlacementError(
                f"only {len(self.actors)} workers could be placed within scaling.placement_timeout_s="
                f"{scaling.placement_timeout_s:g} after losing rank(s) {dead}, fewer than "
                f"scaling.min_workers={scaling.min_workers}; {_resources_text()}. Add nodes, or "
                "lower scaling.min_workers (or num_workers)"
            )
        new_world = len(self.actors)
        addr, port = ray.get(self.actors[0].rendezvous.remote())
        calls = []
        for rank, actor in enumerate(self.actors):
            old = keep[rank] if rank < len(keep) else None
            if old is None or old in dead:
                calls.append(actor.setup.remote(rank, new_world, addr, port, self.use_gpu, state))
            else:
                behind = position[old] != position[source]
                calls.append(actor.regroup.remote(rank, new_world, addr, port, state if behind else None))
        _gather(calls)
        self._start_spare()
        return {"step": position[source][0], "world_size": new_world, "source": source,
                "replaced": sorted(placed), "dropped": [r for r in dead if r not in placed],
                "added": len(joiners), "resynced": [r for r in survivors if position[r] != position[source]]}

    def _start_spare(self) -> None:
        if self._spare is None and self.config.failure.warm_spare and not self.use_gpu:
            self._spare = self._actor(self.slots[0], spare=True)
            self._spare_node = (self._spare.node.remote(), self.nodes[0].get("node_id"))

    def _take_spare(self, rank: int) -> Any:
        """The spare, if it is (or is being) started on the node of `rank`'s bundle; used
        even while it still imports torch, it is ahead of a cold start."""
        if self._spare is None:
            return None
        ref, node_id = self._spare_node
        try:
            node_id = ray.get(ref, timeout=0)["node_id"]
        except GetTimeoutError:
            pass
        except (RayActorError, RayTaskError):  # it died (its node with it?): start a new one later
            self._spare = None
            return None
        if node_id != self.nodes[rank].get("node_id"):
            return None
        spare, self._spare = self._spare, None
        if not any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            ray.kill(spare, no_restart=True)  # the node is gone, and the spare with it
            return None
        return spare

    def _wait_placed(self, ranks: list[int], others: int) -> dict[int, dict[str, Any]]:
        """Wait for the new workers of `ranks` to be placed and up; return their nodes by rank.
        Gives up on the rest after replace_timeout_s if `others` plus those placed make
        min_workers, and after placement_timeout_s in any case."""
        scaling = self.config.scaling
        refs = {self.actors[r].node.remote(): r for r in ranks}
        placed: dict[int, dict[str, Any]] = {}
        t0 = time.monotonic()
        while refs:
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0.1)
            for ref in ready:
                rank = refs.pop(ref)
                try:
                    placed[rank] = ray.get(ref)
                except (RayActorError, RayTaskError):
                    pass  # lost again (its node went too): treated as not placed
            waited = time.monotonic() - t0
            if waited >= scaling.placement_timeout_s or (
                    waited >= scaling.replace_timeout_s and others + len(placed) >= scaling.min_workers):
                break
        return placed

    def _free_slots(self) -> list[tuple[Any, int]]:
        taken = set(self.slots) | {slot for slot, _, _ in self._joining}
        return [(pg, i) for pg in self.pgs for i in range(len(pg.bundle_specs)) if (pg, i) not in taken]

    def _ready_joiners(self, take: bool) -> list[tuple[tuple[Any, int], Any, dict[str, Any]]]:
        """The started workers that are up, as (slot, actor, node); `take` removes them
        from those joining. Workers that failed to start are dropped."""
        ready, still = [], []
        for slot, actor, ref in self._joining:
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
        self._joining = still
        return ready

    def shutdown(self) -> None:
        joining = [actor for _, actor, _ in self._joining]
        for actor in self.actors + joining + ([self._spare] if self._spare is not None else []):
            ray.kill(actor, no_restart=True)
        self._spare = None
        self.actors, self._runs, self._pending, self._finished, self._joining = [], [], [], {}, []
        for pg in self.pgs:
            remove_placement_group(pg)
        self.pgs, self.slots = [], []

    # ------------------------------------------------------------------ helpers

    def _drain(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        try:
            return ray.get(self.actors[0].drain.remote())
        except RayActorError:
            return [], []  # rank 0 died; its run() ref reports why

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
                f"{_resources_text(free=False)}. Lower scaling.num_workers or "
                "scaling.resources_per_worker, or connect to a larger cluster (--address)"
            )


def _resources_text(free: bool = True) -> str:
    """The cluster's schedulable resources, for error messages (placement groups' own
    bundle resources and node labels left out)."""
    total = ray.cluster_resources()
    keys = sorted(k for k in total if not k.startswith(("node:", "accelerator_type:"))
                  and "_group_" not in k and k not in ("memory", "object_store_memory"))
    if not free:
        return "the cluster has " + ", ".join(f"{k} {total[k]:g}" for k in keys) + " in total"
    available = ray.available_resources()
    return "the cluster has " + ", ".join(f"{k} {available.get(k, 0):g} free of {total[k]:g}" for k in keys)


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


def _gather(refs: list[Any]) -> list[Any]:
    """ray.get of all refs, but raise the first failure as soon as it happens (the
    other workers may be blocked waiting for the failed one in a collective)."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        _get(ready[0], refs.index(ready[0]))
    return [ray.get(r) for r in refs]

