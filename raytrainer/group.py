"""The Ray edge: a placement group and one Worker actor per bundle.

The controller drives any object with this interface (start, check_storage, setup, launch,
poll, status, dump_stacks, kill, recover, shutdown); tests give it a fake one without a
cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
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
        self.actors: list[Any] = []
        self.nodes: list[dict[str, Any]] = []
        self.pg = None
        self._runs: list[Any] = []
        self._pending: list[Any] = []
        self._finished: dict[int, Any] = {}
        # A warm spare: an idle actor with torch imported, on a bundle's node but holding no
        # resources, takes a lost worker's place in a fraction of a cold start (CPU workers
        # only: a GPU worker needs its GPU assigned by Ray at creation).
        self._spare: Any = None
        self._spare_node: Any = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, num_workers: int) -> list[dict[str, Any]]:
        """Reserve resources for all workers at once, start the actors; return their nodes."""
        self._check_fits(num_workers)
        self.pg = placement_group([self.bundle] * num_workers, strategy=self.config.scaling.placement)
        timeout = self.config.scaling.placement_timeout_s
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout)
        if not ready:
            raise PlacementError(
                f"could not place {num_workers} workers of {self.bundle} each "
                f"({self.config.scaling.placement}) within scaling.placement_timeout_s={timeout:g}; "
                f"{_resources_text()}. Lower scaling.num_workers or scaling.resources_per_worker, "
                "or add nodes"
            )
        self.actors = [self._actor(i) for i in range(num_workers)]
        self.nodes = _gather([a.node.remote() for a in self.actors])
        self._start_spare()
        return self.nodes

    def _actor(self, bundle: int, spare: bool = False) -> Any:
        extra = {k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")}
        return ray.remote(Worker).options(
            num_cpus=0 if spare else self.bundle.get("CPU", 0),
            num_gpus=0 if spare else self.bundle.get("GPU", 0),
            resources=None if spare else extra or None,
            max_concurrency=2,  # run() trains while drain(), status() answer the driver
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle),
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

    def recover(self, dead: list[int]) -> dict[str, Any]:
        """Replace the `dead` ranks with new actors in their bundles, re-form the process
        group, and give every worker the state of the survivor furthest ahead (those
        already there keep theirs). All other workers must have stopped."""
        world = len(self.actors)
        survivors = [r for r in range(world) if r not in dead]
        if not survivors:
            raise NoSurvivors("no worker survived")
        for rank in dead:
            ray.kill(self.actors[rank], no_restart=True)
            self.actors[rank] = self._take_spare(rank) or self._actor(rank)  # its bundle is free again
        statuses = _gather([self.actors[r].status.remote() for r in survivors])
        position = {r: (s["step"], not s["after_pending"]) for r, s in zip(survivors, statuses)}
        source = max(survivors, key=lambda r: position[r])
        state = self.actors[source].get_state.remote()  # stays in the object store
        self._wait_placed(dead)
        addr, port = ray.get(self.actors[0].rendezvous.remote())
        calls = []
        for rank, actor in enumerate(self.actors):
            if rank in dead:
                calls.append(actor.setup.remote(rank, world, addr, port, self.use_gpu, state))
            else:
                behind = position[rank] != position[source]
                calls.append(actor.regroup.remote(rank, world, addr, port, state if behind else None))
        _gather(calls)
        self._start_spare()
        return {"step": position[source][0], "source": source, "replaced": dead,
                "resynced": [r for r in survivors if position[r] != position[source]]}

    def _start_spare(self) -> None:
        if self._spare is None and self.config.failure.warm_spare and not self.use_gpu:
            self._spare = self._actor(0, spare=True)
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
        return spare

    def _wait_placed(self, ranks: list[int]) -> None:
        refs = [self.actors[r].node.remote() for r in ranks]
        timeout = self.config.scaling.placement_timeout_s
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if len(ready) < len(refs):
            raise PlacementError(
                f"could not place a replacement worker within scaling.placement_timeout_s={timeout:g}; "
                f"{_resources_text()}. Add nodes, or lower scaling.num_workers"
            )
        for rank, node in zip(ranks, _gather(refs)):
            self.nodes[rank] = node

    def shutdown(self) -> None:
        for actor in self.actors + ([self._spare] if self._spare is not None else []):
            ray.kill(actor, no_restart=True)
        self._spare = None
        self.actors, self._runs, self._pending, self._finished = [], [], [], {}
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

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

