"""Validation that does not stop training (trainer.validation.async).

At a validation step rank 0 copies the weights it would validate (the EMA's where EMA is
on) into Ray's object store as NumPy arrays (one copy; the actors read them without
another) and hands their reference to the validation actors; the training thread goes on
at once. Nothing passes through the driver and nothing is written to storage. Each actor
holds the task's model and validation set and runs `val_step` over its shard of the set
(the shards of a sync validation at that many ranks, the micro-batch the ranks would use),
returning the sums and the sample count; rank 0 adds them in shard order and divides, as
the sync all-reduce does, so the metrics are bit-identical to a sync validation at as many
ranks (with two, where a sum of two is the same in any order; tested).

Results are taken in at step boundaries, in the order they were asked for: the val_* row
goes to the driver with the step it belongs to, a checkpoint of that step written in the
meantime is ranked for keep_best (it is kept until then: checkpoint.VALIDATION_PENDING),
and early stopping decides. Early stopping must stop every rank at the same step: while
it is on, rank 0 shares its decision in one small all-reduce per step.

A validation actor that dies is restarted by Ray and its shard retried (max_restarts,
max_task_retries); one that is lost for good drops that validation (a
`validation_failed` event) and is replaced; the run never fails for it. The actors belong
to rank 0's process: they go with it (a Ctrl-C, a lost rank 0: the validations in flight
are lost; a checkpoint whose validation had not arrived has it re-run when the run
resumes from it). The run's last validation is always synchronous, after every pending
one has arrived. FSDP runs (the weights are sharded) validate synchronously.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import torch

from ...checkpoint import VALIDATION_PENDING, Committed
from ...config import DataConfig, TaskConfig, TrainerConfig
from ...data import batch_size_of, to_device
from ...errors import ConfigError, TaskError
from ..dist import all_reduce_sum
from ..input.input import ValInput, collate_of
from .outputs import StepOutputs

if TYPE_CHECKING:
    from .face import ValidationFace

RETRIES = 3
"""How many times Ray restarts a lost validation actor and retries its shard."""


# --------------------------------------------------------------------------- the sums


def shard_sums(task: Any, model: torch.nn.Module, batches: Iterator[Any], device: torch.device,
               amp_dtype: torch.dtype | None, keys: list[str] | None = None) -> tuple[list[str], torch.Tensor]:
    """(the metric names, sorted; [each metric summed over the samples..., the sample
    count]) of `model` over `batches`: the arithmetic of Loop._validate on one rank, in
    float32, so that summing shards reproduces the sync all-reduce."""
    model.eval()
    total, count = None, 0
    outputs = StepOutputs(task, device, keys)
    with torch.no_grad():
        for batch in batches:
            batch = to_device(batch, device)
            with torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else _nothing():
                out = task.val_step(model, batch)
            values = outputs.stack(out, "val")
            n = batch_size_of(batch)
            values = values * n
            total = values if total is None else total + values
            count += n
    return outputs.keys["val"], torch.cat([total, torch.tensor([count], dtype=total.dtype, device=total.device)]).cpu()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def to_arrays(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A state_dict as NumPy arrays (what Ray's object store holds without pickling a
    copy); dtypes NumPy lacks (bf16) travel as same-sized ints, named in `_dtypes`."""
    arrays, dtypes = {}, {}
    for name, tensor in state.items():
        tensor = tensor.detach().cpu()
        if tensor.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
            dtypes[name] = str(tensor.dtype).removeprefix("torch.")
            tensor = tensor.view(torch.int16 if tensor.dtype == torch.bfloat16 else torch.int8)
        arrays[name] = tensor.numpy()
    arrays["_dtypes"] = dtypes
    return arrays


def from_arrays(arrays: dict[str, Any]) -> dict[str, torch.Tensor]:
    dtypes = arrays["_dtypes"]
    with warnings.catch_warnings():  # the object store's arrays are read-only; load_state_dict copies them
        warnings.simplefilter("ignore", UserWarning)
        state = {k: torch.from_numpy(v) for k, v in arrays.items() if k != "_dtypes"}
    return {k: v.view(getattr(torch, dtypes[k])) if k in dtypes else v for k, v in state.items()}


# --------------------------------------------------------------------------- the actor


class ValidationActor:
    """One validation worker: builds the task's model and validation set once, then
    validates the weights it is handed, one shard at a time."""

    def __init__(self, task: TaskConfig, trainer: TrainerConfig, most_workers: int, threads: int, gpu: bool,
                 collate_fn: str | None = None):
        from ...task import build_task
        from ..state.strategy import build_strategy

        torch.set_num_threads(max(1, threads))
        self.device = torch.device("cuda", 0) if gpu and torch.cuda.is_available() else torch.device("cpu")
        self.task = build_task(task, task.payload)
        torch.manual_seed(trainer.seed)
        # The module as the training workers build it (SyncBatchNorm where they convert it).
        self.model = build_strategy(trainer, most_workers, self.task).prepare(self.task.build_model(), self.device)
        self.data = ValInput(self.task.val_dataset(), DataConfig(), self.device, collate_of(self.task, collate_fn))
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(trainer.precision)

    def pid(self) -> int:
        return os.getpid()

    def validate(self, weights: dict[str, Any], shard: int, shards: int, micro_batch_size: int,
                 limit: int | None) -> tuple[list[str], torch.Tensor]:
        self.model.load_state_dict(from_arrays(weights))
        batches = self.data.batches(shard, shards, micro_batch_size, limit)
        return shard_sums(self.task, self.model, batches, self.device, self.amp_dtype)


# --------------------------------------------------------------------------- rank 0's side


@dataclass
class _Pending:
    step: int
    epoch: int
    weights: Any  # the object ref: held until every shard is in
    shards: list[Any]  # their result refs
    started: float
    held_s: float
    results: dict[int, Any] = field(default_factory=dict)
    failed: str | None = None


class AsyncValidation:
    """The loop's async validation (see the module's doc). Every rank holds one (they all
    take the same steps' validations and agree on early stopping); rank 0's starts the
    validation actors and talks to them."""

    def __init__(self, loop: ValidationFace, cfg: TrainerConfig, task: TaskConfig, most_workers: int,
                 collate_fn: str | None = None):
        self.loop, self.cfg, self.task_cfg, self.collate_fn = loop, cfg.validation, task, collate_fn
        self.trainer_cfg, self.most_workers = cfg, most_workers
        self.pending: deque[_Pending] = deque()
        self.actors: list[Any] = []
        self._pids: Any = None  # the actors' pid() refs, until told (the validation_workers event)
        self.validated_step = -1  # the newest step whose validation was asked for or run
        # keep_best: a checkpoint written while its step's validation was on its way is
        # ranked when both are there (the commit may come on the writer's thread).
        self._lock = threading.Lock()
        self._written: set[int] = set()  # steps saved with VALIDATION_PENDING, not committed yet
        self._scores: dict[int, dict[str, float]] = {}  # validations in, their checkpoint not committed
        self.final = False
        n = self.cfg.num_workers
        if loop.val_data is not None and len(loop.val_data) < n:
            raise ConfigError(f"the validation dataset has {len(loop.val_data)} samples, fewer than "
                              f"trainer.validation.num_workers={n}; lower it")
        if loop.rank == 0:  # now: they start (a process, torch, the task) while training does
            self._start()

    @classmethod
    def build(cls, loop: ValidationFace, cfg: TrainerConfig, task: TaskConfig | None, most_workers: int,
              collate_fn: str | None = None) -> AsyncValidation | None:
        if not cfg.validation.async_ or loop.val_data is None or task is None or cfg.fast_dev_run:
            return None
        if not loop.strategy.replicated:
            loop.notify({"event": "note", "step": loop.step, "note": "trainer.validation.async is not "
                         "supported with trainer.strategy=fsdp (sharded weights): validating synchronously"})
            return None
        return cls(loop, cfg, task, most_workers, collate_fn)

    # -------------------------------------------------------------- the loop's hooks

    def takes(self, epoch: int) -> bool:
        """Called where the loop validates: True when this one runs asynchronously (asked
        for here), False when the loop is to validate synchronously now (the run's last
        validation, once every pending one has arrived)."""
        loop = self.loop
        self.validated_step = loop.step
        if self.final or self._last(epoch):
            self.drain()
            return False
        if loop.rank == 0:
            self._submit(loop.step, epoch)
        return True

    def after_step(self) -> None:
        """At each step boundary: take in the validations that arrived (rank 0), and stop
        where early stopping says so, on every rank at this same step."""
        loop = self.loop
        if loop.rank == 0:
            self._take(wait=False)
        if loop.cfg.early_stopping is not None:
            self._agree()

    def finish(self) -> None:
        """The end of the run: every pending validation arrives, then the last weights are
        validated synchronously (unless they just were)."""
        self.final = True
        self.drain()
        if self.validated_step != self.loop.step:
            self.loop.validate(self.loop.epoch)

    def drain(self) -> None:
        if self.loop.rank == 0:
            self._take(wait=True)

    def manifest_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """What a checkpoint of the current step records: with its validation on its way,
        none of an earlier step's val_* (they would rank it) and the pending mark."""
        step = self.loop.step
        if not any(p.step == step for p in self.pending):
            return metrics
        with self._lock:
            self._written.add(step)
        return {**{k: v for k, v in metrics.items() if not k.startswith("val_")}, VALIDATION_PENDING: 1}

    def committed(self, ckpt: Committed) -> None:
        """A checkpoint committed (maybe on the writer's thread): rank it now if its
        validation arrived first."""
        if not ckpt.manifest.get("metrics", {}).get(VALIDATION_PENDING):
            return
        with self._lock:
            self._written.discard(ckpt.step)
            scores = self._scores.pop(ckpt.step, None)
        if scores is not None:
            self._rescore(ckpt.step, scores)

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors, self.pending = [], deque()

    # -------------------------------------------------------------- rank 0

    def _last(self, epoch: int) -> bool:
        """Whether the validation asked for now is the run's last (the loop ends after it)."""
        loop = self.loop
        if loop.stop_reason is not None:
            return True
        if loop.max_steps is not None and loop.step >= loop.max_steps:
            return True
        epoch_end = not loop.plan.fits(loop.position)
        return loop.max_epochs is not None and epoch_end and epoch + 1 >= loop.max_epochs

    def _submit(self, step: int, epoch: int) -> None:
        import ray

        loop = self.loop
        started = time.perf_counter()
        if not self.actors:
            self._start()
        with loop.train.averaged() as model:
            weights = ray.put(to_arrays(model.state_dict()))
        n, micro, limit = len(self.actors), loop.plan.micro_batch_size, loop.cfg.fast_dev_run or None
        shards = [actor.validate.remote(weights, i, n, micro, limit) for i, actor in enumerate(self.actors)]
        held = time.perf_counter() - started
        self.pending.append(_Pending(step, epoch, weights, shards, time.time(), held))

    def _start(self) -> None:
        import ray

        n, resources = self.cfg.num_workers, dict(self.cfg.resources or {})
        if not resources:
            # A CPU of its own where the cluster has one free; else it shares the workers'.
            free = ray.available_resources().get("CPU", 0.0)
            resources = {"CPU": 1.0 if free >= n else 0.0}
        self._resources = dict(resources)
        self.actors = [self._new_actor() for _ in range(n)]
        self._pids = [actor.pid.remote() for actor in self.actors]

    def _new_actor(self) -> Any:
        import ray

        resources = dict(self._resources)
        cpus, gpus = resources.pop("CPU", 0.0), resources.pop("GPU", 0.0)
        remote = ray.remote(ValidationActor).options(
            num_cpus=cpus, num_gpus=gpus, resources=resources or None,
            max_restarts=RETRIES, max_task_retries=RETRIES)
        return remote.remote(self.task_cfg, self.trainer_cfg, self.most_workers, int(cpus), gpus > 0,
                             self.collate_fn)

    def _take(self, wait: bool) -> None:
        """Collect finished shards; report the validations that are complete, oldest first."""
        import ray

        self._tell_pids()
        while self.pending:
            head = self.pending[0]
            if not self._collect(head, wait):
                return
            self.pending.popleft()
            self._deliver(head)

    def _collect(self, p: _Pending, wait: bool) -> bool:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        loop = self.loop
        while True:
            waiting = [ref for i, ref in enumerate(p.shards) if i not in p.results]
            if not waiting:
                return True
            ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=0.05 if wait else 0)
            for ref in ready:
                i = p.shards.index(ref)
                try:
                    p.results[i] = ray.get(ref)
                except RayTaskError as exc:
                    cause = exc.cause
                    if isinstance(cause, (TaskError, ConfigError)):
                        raise cause from None
                    raise TaskError(f"{type(loop.task).__name__}.val_step raised in a validation actor: "
                                    f"{exc}") from None
                except RayActorError as exc:  # lost past its restarts: this validation is dropped
                    p.failed = f"validation actor {i} lost: {exc}"
                    self._replace(i)
                    return True
            if not wait:
                return len(p.results) == len(p.shards)
            loop.progress += 1  # waiting on validation actors is progress, not a hang
            self._tell_pids()

    def _replace(self, i: int) -> None:
        """Validation actor i is lost past its restarts: a new one in its place (the
        validations it held fail, each dropped in its turn)."""
        import ray

        ray.kill(self.actors[i])
        self.actors[i] = self._new_actor()
        self._pids = [actor.pid.remote() for actor in self.actors]

    def _deliver(self, p: _Pending) -> None:
        loop = self.loop
        if p.failed is not None:
            message = f"the validation of step {p.step} was dropped: {p.failed}"
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            loop.notify({"event": "validation_failed", "step": p.step, "cause": p.failed})
            self._score(p.step, {})
            return
        keys = None
        sums = None
        for i in range(len(p.shards)):  # in shard order: the sync all-reduce's sum
            keys, part = p.results[i]
            sums = part if sums is None else sums + part
        means = (sums[:-1] / sums[-1]).tolist()
        metrics = {f"val_{k}": v for k, v in zip(keys, means)}
        loop.latest_metrics.update(metrics)
        loop.window.report([loop.row(p.step, p.epoch, metrics)])
        loop.notify({"event": "validated", "step": p.step, "at_step": loop.step, "held_s": round(p.held_s, 5),
                     "seconds": round(time.time() - p.started, 3)})
        loop.callbacks("on_validation_end", loop, metrics)
        if loop.cfg.early_stopping is not None:
            loop.stop_reason = loop.stopping.check(metrics) or loop.stop_reason
        self._score(p.step, metrics)

    def _score(self, step: int, metrics: dict[str, float]) -> None:
        with self._lock:
            if step in self._written:  # being written: ranked once committed
                self._scores[step] = metrics
                return
        self._rescore(step, metrics)

    def _rescore(self, step: int, metrics: dict[str, float]) -> None:
        """A committed checkpoint of `step` still waiting for its validation takes it: one
        written by this loop, or (a resume from it redoes its step's validation) by the run
        that was stopped before the validation arrived."""
        checkpoints = self.loop.saver.checkpoints
        if checkpoints is not None:
            checkpoints.rescore(step, metrics)

    def _tell_pids(self) -> None:
        import ray

        if self._pids is None:
            return
        ready, _ = ray.wait(self._pids, num_returns=len(self._pids), timeout=0)
        if len(ready) == len(self._pids):
            pids, self._pids = ray.get(self._pids), None
            self.loop.notify({"event": "validation_workers", "step": self.loop.step, "pids": pids,
                              "resources": self._resources})

    # -------------------------------------------------------------- every rank

    def _agree(self) -> None:
        """Every rank takes rank 0's early-stopping state at this step: one all-reduce of
        three numbers (the others send zeros)."""
        loop, stopping = self.loop, self.loop.stopping
        mine = torch.zeros(4, dtype=torch.float64, device=loop.device)
        if loop.rank == 0:
            mine[0] = float(loop.stop_reason is not None)
            mine[1] = float(stopping.best is not None)
            mine[2] = stopping.best if stopping.best is not None else 0.0
            mine[3] = stopping.bad_validations
        with loop.in_phase("collective"):
            agreed = all_reduce_sum(mine).tolist()
        if loop.rank != 0:
            stopping.best = agreed[2] if agreed[1] else None
            stopping.bad_validations = int(agreed[3])
            if agreed[0] and loop.stop_reason is None:
                es = loop.cfg.early_stopping
                loop.stop_reason = (f"early_stopping: {es.metric} did not improve on {stopping.best:.6g} "
                                    f"for {es.patience} validations")


# --------------------------------------------------------------------------- your own loop


def _run_user_validation(fn: Any, state: dict[str, Any]) -> dict[str, float]:
    """A Ray task: `fn(state)`, the user's validation of a reported state."""
    return fn(state)


class ReportValidations:
    """`ctx.report(..., state=..., validate=fn)` in your own loop (userloop.py): rank 0
    runs `fn(state)` in a Ray task on a copy of the reported state (the one the report
    holds for recovery: no other copy on the training thread) and training goes on; the
    metrics it returns arrive as that step's val_* row. Ray retries a task whose process
    died (RETRIES times); what `fn` raises fails the run, as the loop's own code would.
    Every one pending is waited for when the loop function returns."""

    def __init__(self, cfg: Any, rows: Any, notify: Any):
        self.cfg, self._rows, self.notify = cfg, rows, notify
        self.pending: deque[tuple[int, int, int, Any, float]] = deque()  # step, epoch, world size, ref, asked at

    def submit(self, step: int, epoch: int, world_size: int, state: dict[str, Any], fn: Any) -> None:
        import ray

        resources = dict(self.cfg.resources or {"CPU": 0})  # a task: its CPU back when done
        cpus, gpus = resources.pop("CPU", 0.0), resources.pop("GPU", 0.0)
        remote = ray.remote(_run_user_validation).options(num_cpus=cpus, num_gpus=gpus, resources=resources or None,
                                                          max_retries=RETRIES)
        self.pending.append((step, epoch, world_size, remote.remote(fn, ray.put(state)), time.time()))
        self.take(wait=False)

    def take(self, wait: bool) -> None:
        import ray
        from ray.exceptions import RayTaskError

        while self.pending:
            step, epoch, world_size, ref, asked = self.pending[0]
            ready, _ = ray.wait([ref], timeout=None if wait else 0)
            if not ready:
                return
            self.pending.popleft()
            try:
                metrics = ray.get(ref)
            except RayTaskError as exc:
                raise TaskError(f"the validate function of ctx.report at step {step} raised: {exc}") from None
            except Exception as exc:  # lost past its retries: dropped, never the run
                warnings.warn(f"the validation of step {step} was dropped: {exc}", RuntimeWarning, stacklevel=2)
                self.notify({"event": "validation_failed", "step": step, "cause": str(exc)})
                continue
            if not isinstance(metrics, dict):
                raise TaskError(f"the validate function of ctx.report returned {type(metrics).__name__}; "
                                "return a dict of metrics")
            row = {"step": step, "epoch": epoch, "world_size": world_size, "time": time.time()}
            row.update({(k if k.startswith("val_") else f"val_{k}"): float(v) for k, v in metrics.items()})
            self._rows([row])
            self.notify({"event": "validated", "step": step, "seconds": round(time.time() - asked, 3)})
