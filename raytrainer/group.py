"""The Ray edge: a placement group and one Worker actor per bundle.

The controller drives any object with this interface (start, check_storage, setup, launch,
poll, shutdown); tests give it a fake one without a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .config import Config
from .errors import PlacementError, RaytrainerError, WorkerError
from .storage_check import check_shared_storage
from .worker import Worker


@dataclass
class Poll:
    rows: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # from workers, e.g. checkpoints
    done: bool = False
    result: Any = None  # rank 0's return value once done


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
        self.pg = None
        self._runs: list[Any] = []
        self._pending: list[Any] = []

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
        remote = ray.remote(Worker)
        extra = {k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")}
        config = self.config.to_dict()
        self.actors = [
            remote.options(
                num_cpus=self.bundle.get("CPU", 0),
                num_gpus=self.bundle.get("GPU", 0),
                resources=extra or None,
                max_concurrency=2,  # run() trains while drain() answers the driver
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=i
                ),
            ).remote(config)
            for i in range(num_workers)
        ]
        return _gather([a.node.remote() for a in self.actors])

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

    def poll(self, timeout: float) -> Poll:
        """Wait up to `timeout` for any worker to finish or fail; collect new metric rows."""
        ready, self._pending = ray.wait(self._pending, num_returns=1, timeout=timeout)
        poll = Poll(*self._drain())
        for ref in ready:
            _get(ref, self._runs.index(ref))  # raises the worker's error
        if not self._pending:
            poll.done = True
            poll.result = ray.get(self._runs[0])
            rows, events = self._drain()
            poll.rows += rows
            poll.events += events
        return poll

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors, self._runs, self._pending = [], [], []
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

