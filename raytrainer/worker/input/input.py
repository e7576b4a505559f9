"""Input pipelines: how one rank gets the micro-batches of an optimizer step.

The loop asks for a step's micro-batches by its data position (epoch, sample offset)
and its step count; what it gets does not depend on how they are read:

- map-style datasets (`__getitem__`, `__len__`): the BatchPlan decides which global
  sample indices form each micro-batch (data.py). With `data.num_workers: 0` they are
  read in the training thread when the step needs them (data.fetch); with loader
  processes a torch DataLoader reads them, its batch_sampler yielding the plan's index
  lists from the step's position on, `prefetch_factor` micro-batches ahead per process.
  The batches are the same tensors either way, so the order, resume, recovery and
  resizes stay exact. After anything that moves the position other than the next step
  (a recovery, a resize, a resume, an interrupted step) the loader starts again at the
  new position (`reset`, or a position that is not the one it prepared).
- iterable datasets (`torch.utils.data.IterableDataset`, streams): see StreamInput.
- Ray Data datasets: raytrainer/worker/input/raydata.py (Ray is imported only there).

Loader processes are started with the "forkserver" method, not "fork": a Ray actor
runs Ray's core-worker and gRPC threads and, while training, a Gloo group with its
own threads and sockets; forking such a process copies locks held by other threads
(a child can deadlock on its first malloc or log line) and the group's sockets. A
fork server is a clean single-threaded process, started once per actor with torch
already imported, from which each loader process is forked in milliseconds ("spawn"
would import torch again in every one). Each loader process runs with one intra-op
thread (torch's DataLoader sets it), and exits the moment the worker that reads from it
is gone, however it went and whatever the dataset is doing (_exit_with_worker). Its
parent is the fork server, not the worker, and neither watches the worker: a fork server
exits only once every process it forked has (each holds its liveness pipe), and torch's
loader process waits on its queue for as long as its parent, the fork server, lives. A
SIGKILLed worker used to leave both running for good wherever Ray does not kill a dead
worker's process group (Ray 2.60 does, unless RAY_process_group_cleanup_enabled=0).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import pickle
import select
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate, get_worker_info

from ...config import DataConfig
from ...data import BatchPlan, fetch, val_shard
from ...errors import ConfigError, TaskError
from ...task import import_object
from .. import _internals
from ..loaders import loader_context
from ..pids import running

STREAM_SIZE = sys.maxsize // 4
"""What a stream counts as its length in the BatchPlan: its epoch never ends."""


def is_stream(dataset: Any) -> bool:
    return isinstance(dataset, IterableDataset)


def is_ray_dataset(dataset: Any) -> bool:
    # By name: importing ray.data here would cost every worker seconds.
    return any(c.__module__.startswith("ray.data") and c.__name__ == "Dataset" for c in type(dataset).__mro__)


def dataset_size(dataset: Any) -> int:
    """The sample count the BatchPlan is built on (streams have none: never-ending)."""
    return STREAM_SIZE if is_stream(dataset) or is_ray_dataset(dataset) else len(dataset)


Collate = Callable[[list[Any]], Any]


def collate_of(task: Any, name: str | None) -> Collate:
    """data.collate_fn made callable on this worker: a method of the task (bound: loader
    processes get the task with it), a function by import path, or torch's default."""
    if name is None:
        return default_collate
    if ":" in name:
        found = import_object(name, "data.collate_fn")
    else:
        found = getattr(task, name, None)
        if found is None:
            raise ConfigError(f"data.collate_fn={name!r}: the task {type(task).__name__} has no method {name!r}; "
                              "define it, or give an import path 'package.module:function'")
    if not callable(found):
        raise ConfigError(f"data.collate_fn={name!r} is a {type(found).__name__}, not a function of the samples")
    return found


def build_train_input(dataset: Any, cfg: DataConfig, *, max_epochs: int | None, rank: int,
                      plan: BatchPlan, device: torch.device, collate: Collate = default_collate):
    if is_ray_dataset(dataset) or is_stream(dataset):
        if max_epochs is not None:
            kind = "Ray Data dataset" if is_ray_dataset(dataset) else "stream (IterableDataset)"
            raise ConfigError(
                f"the training dataset is a {kind}: it has no epochs, so trainer.max_epochs cannot "
                "end the run; set trainer.max_epochs: null and trainer.max_steps"
            )
        if is_ray_dataset(dataset):
            from .raydata import RayDataInput

            if cfg.collate_fn is not None:
                raise ConfigError(f"data.collate_fn={cfg.collate_fn!r} shapes batches of a torch dataset's samples; "
                                  "the training dataset is a Ray Data dataset: shape its batches with map_batches")

            return RayDataInput(dataset, cfg, rank=rank, plan=plan)
        start_loader_server(cfg)
        return StreamInput(dataset, cfg, rank=rank, plan=plan, device=device, collate=collate)
    start_loader_server(cfg)
    return MapInput(dataset, cfg, rank=rank, plan=plan, device=device, collate=collate)


# --------------------------------------------------------------------------- loader processes

def _init_loader_process(worker: int, worker_id: int) -> None:
    """In each loader process: die with its parent (the fork server; Linux) and with the
    worker `worker` (the pid of the process that reads from it), whatever the dataset is
    doing."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent went before the request took effect
        os._exit(0)
    threading.Thread(target=_exit_with_worker, args=(worker,), name="raytrainer-loader-watch", daemon=True).start()


def _exit_with_worker(worker: int) -> None:
    """End this loader process once process `worker` has exited: waits on a pidfd (Linux
    5.3+), else looks once a second."""
    try:
        fd = os.pidfd_open(worker)
    except (AttributeError, OSError):  # no pidfd here, or the worker is gone already
        while running(worker):
            time.sleep(1.0)
    else:
        select.select([fd], [], [])  # readable once the process has exited
    os._exit(0)


def start_loader_server(cfg: DataConfig) -> None:
    """Start this process's fork server now (while the worker sets up), not in the first step."""
    if cfg.num_workers and loader_context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def _identity(batch: Any) -> Any:
    return batch


def _loader(dataset: Dataset, cfg: DataConfig, device: torch.device, seed: int, **kwargs) -> DataLoader:
    pin = cfg.pin_memory and device.type == "cuda"
    # Its own generator: starting the processes draws their base seed from it, and a draw
    # from torch's default one would change the step's dropout (seeded per step, see loop).
    return DataLoader(dataset, num_workers=cfg.num_workers, prefetch_factor=cfg.prefetch_factor,
                      pin_memory=pin, pin_memory_device=str(device) if pin else "",
                      multiprocessing_context=loader_context(),
                      worker_init_fn=functools.partial(_init_loader_process, os.getpid()),
                      generator=torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF), **kwargs)


def _start(loader: DataLoader, what: str) -> Iterator:
    """iter(loader), which starts the loader processes: a dataset that cannot be pickled
    to them fails here, with the setting to change."""
    try:
        return iter(loader)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        if "pickle" not in str(exc) and not isinstance(exc, pickle.PicklingError):
            raise
        raise ConfigError(
            f"the {what} cannot be sent to loader processes (data.num_workers="
            f"{loader.num_workers}): {type(exc).__name__}: {exc}; make it picklable (no open "
            "files, locks or lambdas in its attributes: open them in __getitem__/__iter__), or "
            "set data.num_workers: 0 to read it in the training process"
        ) from exc


def _next(it: Iterator, what: str) -> Any:
    try:
        return next(it)
    except (RuntimeError, ConnectionError, EOFError) as exc:
        # A process killed while it wrote to the result pipe can surface as a broken pipe
        # before torch has seen that it exited.
        text = str(exc)
        if isinstance(exc, RuntimeError) and not ("DataLoader worker" in text and (
                "exited unexpectedly" in text or "killed by signal" in text)):
            raise
        raise LoaderProcessDied(
            f"a loader process reading the {what} died: {type(exc).__name__}: {exc} (if it ran "
            "out of memory, lower data.num_workers or data.prefetch_factor)"
        ) from exc


def _shutdown(it: Iterator | None) -> None:
    _internals.shutdown_loader_iterator(it)


class LoaderProcessDied(RuntimeError):
    """A loader process exited without a Python exception (a signal, the OOM killer): a
    worker failure, counted and recovered from like any other."""


# --------------------------------------------------------------------------- map-style

class PlanSampler:
    """The DataLoader's batch_sampler: this rank's micro-batch index lists, step after
    step, from a data position on (epochs roll over as the loop's do)."""

    def __init__(self, plan: BatchPlan, rank: int):
        self.plan, self.rank = plan, rank
        self.epoch = self.position = 0

    def __iter__(self) -> Iterator[list[int]]:
        plan, rank, epoch, position = self.plan, self.rank, self.epoch, self.position
        while True:
            if not plan.fits(position):
                epoch, position = epoch + 1, 0
            for index in plan.micro_batches(epoch, position, rank):
                yield index.tolist()
            position += plan.global_batch_size


class _Fetch(Dataset):
    """The dataset as loader processes read it: one micro-batch per request, through
    data.fetch, so a batch is the same tensors as one read in the training thread."""

    def __init__(self, dataset: Dataset, collate: Collate):
        self.dataset, self.collate = dataset, collate

    def __getitems__(self, index: list[int]) -> Any:
        return fetch(self.dataset, torch.tensor(index, dtype=torch.int64), self.collate)

    def __len__(self) -> int:
        return len(self.dataset)


class MapInput:
    def __init__(self, dataset: Dataset, cfg: DataConfig, *, rank: int, plan: BatchPlan,
                 device: torch.device, collate: Collate = default_collate):
        self.dataset, self.cfg, self.device, self.collate = dataset, cfg, device, collate
        self.sampler = PlanSampler(plan, rank)
        self._loader: DataLoader | None = None
        self._it: Iterator | None = None
        self._cursor: tuple[int, int, int] | None = None  # (epoch, position, micro-batch) it yields next

    @property
    def plan(self) -> BatchPlan:
        return self.sampler.plan

    def batches(self, epoch: int, position: int, step: int) -> Iterator[Any]:
        """This rank's micro-batches of the optimizer step at (epoch, position)."""
        plan, rank = self.plan, self.sampler.rank
        if not self.cfg.num_workers:
            for index in plan.micro_batches(epoch, position, rank):
                yield fetch(self.dataset, index, self.collate)
            return
        if self._cursor != (epoch, position, 0):
            self._restart(epoch, position)
        for i in range(plan.accumulation):
            batch = _next(self._it, "training dataset")
            if i + 1 < plan.accumulation:
                self._cursor = (epoch, position, i + 1)
            else:  # the next step's position, as the loop will compute it
                nxt = position + plan.global_batch_size
                self._cursor = (epoch, nxt, 0) if plan.fits(nxt) else (epoch + 1, 0, 0)
            yield batch

    def _restart(self, epoch: int, position: int) -> None:
        self.sampler.epoch, self.sampler.position = epoch, position
        self._cursor = None
        if self._loader is None or not self.cfg.persistent_workers:
            self.close()
            seed = hash((self.plan.seed, self.sampler.rank, epoch, position))
            self._loader = _loader(_Fetch(self.dataset, self.collate), self.cfg, self.device, seed, batch_sampler=self.sampler,
                                   collate_fn=_identity, persistent_workers=self.cfg.persistent_workers)
        self._it = _start(self._loader, "training dataset")  # persistent: the same processes, a new order
        self._cursor = (epoch, position, 0)

    def regroup(self, plan: BatchPlan, rank: int, step: int) -> None:
        self.sampler.plan, self.sampler.rank = plan, rank
        self.reset()

    def reset(self) -> None:
        """Forget what was prepared: the next step starts the loader at its position."""
        self._cursor = None
        if not self.cfg.persistent_workers:
            self.close()

    def pass_over(self, through_step: int, at_step: int) -> None:
        """A rollback: the loop moves its position past the batches passed over."""
        self.reset()

    def state_dict(self, step: int) -> None:
        return None  # the position is the loop's (epoch, position)

    def load_state_dict(self, state: Any, step: int) -> None:
        self.reset()

    def close(self) -> None:
        it, self._it, self._cursor = self._it, None, None
        kept = _internals.take_loader_iterator(self._loader) if self._loader is not None else None
        if kept is not None:  # persistent workers
            it = kept
        self._loader = None
        _shutdown(it)


class ValInput:
    """Validation micro-batches (every validation sample once across ranks), through
    loader processes when data.num_workers > 0."""

    def __init__(self, dataset: Dataset, cfg: DataConfig, device: torch.device, collate: Collate = default_collate):
        self.dataset, self.cfg, self.device, self.collate = dataset, cfg, device, collate
        self._loader: DataLoader | None = None
        self._chunks: list[list[int]] = []

    def most_batches(self, world_size: int, micro_batch_size: int, limit: int | None) -> int:
        """The most batches any rank's shard has (rank 0's shard is never shorter)."""
        return len(val_shard(len(self.dataset), 0, world_size).split(micro_batch_size)[:limit])

    def batches(self, rank: int, world_size: int, micro_batch_size: int, limit: int | None) -> Iterator[Any]:
        chunks = val_shard(len(self.dataset), rank, world_size).split(micro_batch_size)[:limit]
        if not self.cfg.num_workers:
            for chunk in chunks:
                yield fetch(self.dataset, chunk, self.collate)
            return
        self._chunks[:] = [c.tolist() for c in chunks]  # the sampler below reads this list
        if self._loader is None:
            self._loader = _loader(_Fetch(self.dataset, self.collate), self.cfg, self.device, rank, batch_sampler=self._chunks,
                                   collate_fn=_identity, persistent_workers=self.cfg.persistent_workers)
        it = _start(self._loader, "validation dataset")
        try:
            for _ in range(len(chunks)):
                yield _next(it, "validation dataset")
        finally:
            if not self.cfg.persistent_workers:
                self._loader = None
                _shutdown(it)

    def close(self) -> None:
        if self._loader is not None:
            _shutdown(_internals.take_loader_iterator(self._loader))
            self._loader = None


# --------------------------------------------------------------------------- streams

class StreamInput:
    """An IterableDataset, sharded across ranks and loader processes.

    Item i of the stream (as the dataset's __iter__ yields them) goes to rank i % W;
    rank r's items are split among its K loader processes (K = max(1, num_workers)),
    and micro-batch j of the rank is read by process j % K from its own items, in order.
    So every item is read by exactly one (rank, process), and the rank's order depends
    on W and K. A dataset that defines `shard(index, count)`, returning an iterable of its
    items i with i % count == index, is asked for its share (read only what it needs:
    e.g. every count-th file); otherwise each process iterates the stream and skips the
    items of the others.

    The position is a segment: (its first stream item `base`, W, K, the step it started
    at, the micro-batch sizes of each rank); every rank's consumed samples follow from the
    steps since it started. A resume, or an in-memory recovery at the same W and K,
    continues exactly. A resize (or another K) starts a new segment after the furthest item
    any process of any rank had trained on: no item is used twice, and the few that
    lagging processes had not reached yet are skipped.
    """

    def __init__(self, dataset: IterableDataset, cfg: DataConfig, *, rank: int, plan: BatchPlan,
                 device: torch.device, collate: Collate = default_collate):
        self.dataset, self.cfg, self.device, self.collate = dataset, cfg, device, collate
        self.rank, self.plan = rank, plan
        self.segment = self._segment(base=0, start_step=0)
        self._it: Iterator | None = None
        self._next_step: int | None = None  # the step whose micro-batches self._it yields next

    def _segment(self, base: int, start_step: int) -> dict[str, Any]:
        return {"base": base, "world_size": self.plan.world_size, "processes": max(1, self.cfg.num_workers),
                "start_step": start_step,
                "sizes": [self.plan.micro_batch_sizes(r) for r in range(self.plan.world_size)]}

    def batches(self, epoch: int, position: int, step: int) -> Iterator[Any]:
        if self._next_step != step:
            self._restart(step)
        for i in range(self.plan.accumulation):
            batch = _next(self._it, "training stream")
            if i + 1 == self.plan.accumulation:
                self._next_step = step + 1
            else:
                self._next_step = None  # mid-step: any other request restarts
            yield batch

    def _restart(self, step: int) -> None:
        self.close()
        seg = self.segment
        shard = _StreamShard(self.dataset, rank=self.rank, base=seg["base"], world_size=seg["world_size"],
                             processes=seg["processes"], sizes=seg["sizes"][self.rank],
                             done=(step - seg["start_step"]) * len(seg["sizes"][self.rank]), collate=self.collate)
        if self.cfg.num_workers:
            loader = _loader(shard, self.cfg, self.device, hash((self.plan.seed, self.rank, step)), batch_size=None)
            self._it = _start(loader, "training stream")
        else:
            self._it = iter(shard)
        self._next_step = step

    def regroup(self, plan: BatchPlan, rank: int, step: int) -> None:
        self.plan, self.rank = plan, rank
        self._continue(step)

    def reset(self) -> None:
        self.close()

    def pass_over(self, through_step: int, at_step: int) -> None:
        """A rollback: from `at_step` steps done on, the items after those of step
        `through_step` (a new segment: the steps no longer follow from the old one's start)."""
        self.close()
        seg = self.segment
        self.segment = self._segment(seg["base"] + _items_read(seg, through_step - seg["start_step"]), at_step)

    def state_dict(self, step: int) -> dict[str, Any]:
        return dict(self.segment)

    def load_state_dict(self, state: dict[str, Any] | None, step: int) -> None:
        if state is None or "base" not in state:
            raise ConfigError("the checkpoint was not trained on a stream (IterableDataset) and this task's training "
                              "dataset is one; resume with the task the checkpoint was trained with")
        self.segment = dict(state)
        self._continue(step)

    def _continue(self, step: int) -> None:
        """At `step`: keep the segment if the world size and process count are its own,
        else start a new one after everything the old one handed out."""
        self.close()
        seg = self.segment
        if (seg["world_size"], seg["processes"]) != (self.plan.world_size, max(1, self.cfg.num_workers)):
            self.segment = self._segment(seg["base"] + _items_read(seg, step - seg["start_step"]), step)

    def close(self) -> None:
        it, self._it, self._next_step = self._it, None, None
        _shutdown(it)


def _consumed(sizes: list[int], micro_batches: int, processes: int, process: int) -> int:
    """Items process `process` of a rank had trained on after `micro_batches` of them."""
    period = math.lcm(len(sizes), processes)
    full, rest = divmod(micro_batches, period)
    per_period = sum(sizes[j % len(sizes)] for j in range(process, period, processes))
    return full * per_period + sum(sizes[j % len(sizes)] for j in range(process, rest, processes))


def _items_read(seg: dict[str, Any], steps: int) -> int:
    """One past the furthest segment item any (rank, process) trained on in `steps` steps."""
    world, k = seg["world_size"], seg["processes"]
    furthest = 0
    for rank, sizes in enumerate(seg["sizes"]):
        for w in range(k):
            n = _consumed(sizes, steps * len(sizes), k, w)
            if n:
                furthest = max(furthest, (n - 1) * world * k + w * world + rank + 1)
    return furthest


class _StreamShard(IterableDataset):
    """One rank's micro-batches of a stream, from `done` micro-batches on; iterated in a
    loader process (get_worker_info) or in the training thread (one process)."""

    def __init__(self, dataset: IterableDataset, *, rank: int, base: int, world_size: int, processes: int,
                 sizes: list[int], done: int, collate: Collate = default_collate):
        self.dataset, self.rank, self.base, self.collate = dataset, rank, base, collate
        self.world_size, self.processes, self.sizes, self.done = world_size, processes, sizes, done

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        offset = info.id if info is not None else 0  # the DataLoader asks its processes in turn
        k = self.processes
        j = self.done + offset  # the rank's first micro-batch this process makes
        process = j % k
        count = self.world_size * k
        index = (self.base + process * self.world_size + self.rank) % count
        below = max(0, -(-(self.base - index) // count))  # this shard's items before the segment
        skip = below + _consumed(self.sizes, self.done, k, process)
        shard = getattr(self.dataset, "shard", None)
        items = iter(shard(index, count) if callable(shard) else itertools.islice(iter(self.dataset), index, None, count))
        read = 0
        for _ in itertools.islice(items, skip):
            read += 1
        if read < skip:
            raise self._dry(read, skip, process)
        while True:
            size = self.sizes[j % len(self.sizes)]
            chunk = list(itertools.islice(items, size))
            read += len(chunk)
            if len(chunk) < size:
                raise self._dry(read, read - len(chunk) + size, process)
            yield self.collate(chunk)
            j += k

    def _dry(self, read: int, needed: int, process: int) -> TaskError:
        return TaskError(
            f"the training stream ran dry: rank {self.rank}'s share for its loader process {process} "
            f"(every {self.world_size * self.processes}th item of {type(self.dataset).__name__}) ended "
            f"after {read} items where {needed} were needed; lower trainer.max_steps, or make the "
            "stream longer (repeat it)"
        )
