"""Typed run configuration: YAML in, validated dataclasses out.

Each section is a small kw_only dataclass that checks its own values in
__post_init__; `Config.validate` checks what spans sections. Unknown keys and
wrong types are errors that name the key and what is allowed, because a typo
in a config silently ignored costs a whole training run.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .errors import ConfigError


@dataclass(kw_only=True)
class Component:
    """A class named by import path and the keyword arguments to build it with."""

    target: str
    """Import path of the class, `package.module:ClassName`."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments the class is constructed with (on every worker, for a task)."""

    def __post_init__(self):
        module, sep, name = self.target.partition(":")
        if not (module and sep and name):
            raise ConfigError(
                f"target={self.target!r} is not an import path; "
                "write it as 'package.module:ClassName', e.g. 'examples.digits:DigitsTask'"
            )


@dataclass(kw_only=True)
class TaskConfig:
    """What to train: a Task class (`target`) or your own loop function (`loop`), named by
    import path and built on every worker with `args`; or either passed as a Python object
    to raytrainer.train / raytrainer.train_loop, which ships it to the workers by value."""

    target: str | None = None
    """A raytrainer.Task subclass, `package.module:ClassName`."""
    loop: str | None = None
    """Your own training loop instead of a Task: a function `fn(ctx, **args)` run on every
    worker, `package.module:function` (see raytrainer.train_loop)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments the class (or the loop function) is called with, on every worker."""
    by_value: str | None = None
    """Written by raytrainer, never by hand: the task or loop was passed as a Python object
    and shipped to the workers pickled (cloudpickle); this says what it was. A YAML file
    cannot carry the object, so such a config.yaml is a record: resume that run from
    Python, passing the same object again."""
    payload: Any = field(default=None, repr=False, metadata={"internal": True})
    """Not a config key: the object passed by value, pickled (bytes), or on the driver the
    reference to those bytes in Ray's object store, which every worker's constructor gets."""

    def __post_init__(self):
        if (self.target is None) == (self.loop is None):
            raise ConfigError(
                "task: give exactly one of target (a raytrainer.Task class, 'package.module:ClassName') "
                "or loop (your own loop function fn(ctx), 'package.module:function')"
            )
        key = "target" if self.loop is None else "loop"
        module, sep, name = getattr(self, key).partition(":")
        if not (module and sep and name):
            raise ConfigError(
                f"task.{key}={getattr(self, key)!r} is not an import path; write it as "
                f"'package.module:{'ClassName' if key == 'target' else 'function'}', e.g. "
                f"'{'examples.digits:DigitsTask' if key == 'target' else 'examples.hf_trainer:train_func'}'"
            )

    @property
    def is_loop(self) -> bool:
        return self.loop is not None

    @property
    def path(self) -> str:
        """Its import path (the class's or the function's)."""
        return self.loop if self.loop is not None else self.target


@dataclass(kw_only=True)
class LRScheduleConfig:
    """Linear warmup, then a decay to min_lr_ratio * base LR, in optimizer steps (so it
    does not depend on the worker count). Multiplies each param group's base LR."""

    warmup_steps: int = 0
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.0

    def __post_init__(self):
        if self.warmup_steps < 0:
            raise ConfigError(f"trainer.lr_schedule.warmup_steps={self.warmup_steps} must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"trainer.lr_schedule.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")


@dataclass(kw_only=True)
class EarlyStoppingConfig:
    """Stop when a validation metric has not improved for `patience` validations."""

    metric: str = "val_loss"
    mode: Literal["min", "max"] = "min"
    patience: int = 3
    min_delta: float = 0.0

    def __post_init__(self):
        if not self.metric.startswith("val_"):
            raise ConfigError(
                f"trainer.early_stopping.metric={self.metric!r} must be a validation metric, "
                "named with its 'val_' prefix (e.g. val_loss)"
            )
        if self.patience < 1:
            raise ConfigError(f"trainer.early_stopping.patience={self.patience} must be >= 1")


@dataclass(kw_only=True)
class FSDPConfig:
    """How trainer.strategy=fsdp shards the model (torch.distributed.fsdp.fully_shard)."""

    shard: list[str] | None = None
    """Class names of the modules to shard each on its own (for example [Block]): each is
    one unit of all-gather and reduce-scatter. null: every direct child of the model that
    has parameters. The root is always sharded (what no unit holds). A Task.shard(model,
    mesh) method, when the task has one, replaces all of this."""
    reshard_after_forward: bool = True
    """Free the gathered parameters after each unit's forward (less memory, one more
    all-gather in the backward); false keeps them until the backward."""
    param_dtype: Literal["fp32", "bf16", "fp16"] | None = None
    """FSDP's mixed precision: the dtype parameters are gathered and computed in (the
    sharded master weights stay fp32), which halves the all-gathers. null: as stored
    (trainer.precision's autocast applies either way)."""
    reduce_dtype: Literal["fp32", "bf16", "fp16"] | None = None
    """The dtype gradients are reduced in. null: param_dtype's."""


@dataclass(kw_only=True)
class ValidationConfig:
    """trainer.validation: when validation runs, and where (see worker/validation.py)."""

    every_n_steps: int | None = None
    """Validate every N optimizer steps (besides at every epoch end and the run's end);
    None: epoch ends only. trainer.val_every_n_steps is the same setting."""
    async_: bool = field(default=False, metadata={"key": "async"})
    """`async: true`: rank 0 hands the weights of the step (EMA weights where EMA is on) to
    validation actors through Ray's object store and training goes on at once; their val_*
    row joins the step it belongs to. The run's last validation is always waited for.
    FSDP runs validate synchronously (a note says so)."""
    num_workers: int = 1
    """Validation actors of an async validation; the validation set is sharded over them
    (with as many as the training workers, the metrics are bit-identical to a sync one)."""
    resources: dict[str, float] | None = None
    """Ray resources of each validation actor, e.g. {CPU: 2} or {GPU: 1}; default {CPU: 1}
    where the cluster has that free at the start, else {CPU: 0} (it shares the workers' CPUs)."""

    def __post_init__(self):
        if self.every_n_steps is not None and self.every_n_steps < 1:
            raise ConfigError(f"trainer.validation.every_n_steps={self.every_n_steps} must be a positive integer")
        if self.num_workers < 1:
            raise ConfigError(f"trainer.validation.num_workers={self.num_workers} must be >= 1")
        for name, amount in (self.resources or {}).items():
            if amount < 0:
                raise ConfigError(f"trainer.validation.resources.{name}={amount} must be >= 0")


@dataclass(kw_only=True)
class TrainerConfig:
    max_epochs: int | None = None
    max_steps: int | None = None
    """Optimizer steps. With max_epochs too, training stops at whichever comes first."""
    global_batch_size: int = 32
    """Samples per optimizer step across all workers. With batch_policy fixed_global it
    fixes the maths whatever the worker count; with per_worker it is the batch at
    scaling.num_workers workers."""
    batch_policy: Literal["fixed_global", "per_worker"] = "fixed_global"
    """What an elastic run keeps when the worker count changes. fixed_global: the global
    batch and the LR (same maths at any size). per_worker: each worker's batch
    (global_batch_size / scaling.num_workers), so the global batch is that times the
    worker count, and every param group's LR is scaled by workers / scaling.num_workers
    (the linear scaling rule); the data position is a sample index either way."""
    micro_batch_size: int | None = None
    """Samples per forward pass on one worker; None means global_batch_size / world size,
    rounded up (no accumulation). Otherwise each rank accumulates its share of the global
    batch in ceil(share / micro_batch_size) micro-batches. Any split works: where the world
    size does not divide the batch, some ranks take one sample more (see data.py)."""
    seed: int = 0
    val_every_n_steps: int | None = None
    """Validate every N optimizer steps (besides at every epoch end); None: epoch ends only.
    The same setting as validation.every_n_steps (kept: configs and tools name it)."""
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    log_every_n_steps: int = 1
    """How often ranks reduce their buffered per-step metrics and ship them to the driver.
    Every step still gets its own row; larger values mean fewer collectives."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """bf16/fp16 run forward passes under autocast; fp16 adds a gradient scaler and skips
    (and counts, as 'skipped_steps') optimizer steps whose gradients overflow."""
    grad_clip_norm: float | None = None
    """Clip the global gradient norm once per optimizer step; the pre-clip norm is logged."""
    ema_decay: float | None = None
    """Keep an exponential moving average of the weights; validate and export it."""
    sync_batchnorm: bool = False
    """Convert BatchNorm layers to SyncBatchNorm (statistics over the global batch)."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """ddp: every rank holds the whole model and optimizer state (DistributedDataParallel).
    fsdp: torch's FSDP2 (fully_shard): parameters, gradients and optimizer state are
    sharded over the ranks, for models that do not fit on one device (see trainer.fsdp)."""
    fsdp: FSDPConfig | None = None
    """Options of the fsdp strategy (only with strategy: fsdp)."""
    lr_schedule: LRScheduleConfig | None = None
    early_stopping: EarlyStoppingConfig | None = None
    peak_flops_per_worker: float | None = None
    """Peak FLOP/s of one worker's device, for model FLOPs utilisation ('mfu') when the
    task declares flops_per_sample. Default: known GPUs' bf16/fp16 dense peak."""
    fast_dev_run: int = 0
    """Debug: run N training steps and N validation batches per worker, then stop."""
    overfit_batches: int = 0
    """Debug: train on the same first N global batches every epoch."""
    nonfinite: Literal["stop", "skip", "off"] = "stop"
    """A step whose loss (or, with grad_clip_norm, gradient norm) is NaN or Inf, on any rank,
    is never applied. stop: the run fails at that step (exit status 1), naming the step,
    the ranks and the metric; its checkpoints hold only finite weights. skip: that update is
    dropped on every rank and counted ('nonfinite_skips', a nonfinite_skipped event); more
    than nonfinite_max_skips in a row stop the run. off: no check (fp16's scaler still skips
    steps whose gradients overflow)."""
    nonfinite_max_skips: int = 10
    """trainer.nonfinite=skip: how many non-finite steps in a row are skipped before the run stops."""

    def __post_init__(self):
        for key in ("max_epochs", "max_steps", "global_batch_size", "micro_batch_size",
                    "val_every_n_steps", "log_every_n_steps"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"trainer.{key}={value} must be a positive integer")
        self._join_val_every()
        for key in ("fast_dev_run", "overfit_batches", "nonfinite_max_skips"):
            if getattr(self, key) < 0:
                raise ConfigError(f"trainer.{key} must be >= 0 (0 turns it off)")
        if self.grad_clip_norm is not None and self.grad_clip_norm <= 0:
            raise ConfigError(f"trainer.grad_clip_norm={self.grad_clip_norm} must be > 0")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ConfigError(f"trainer.ema_decay={self.ema_decay} must be in (0, 1), e.g. 0.999")
        if self.strategy == "fsdp":
            self.fsdp = self.fsdp or FSDPConfig()
            if self.sync_batchnorm:
                raise ConfigError(
                    "trainer.sync_batchnorm does not work with trainer.strategy=fsdp (its layers would "
                    "be sharded, their statistics reduced twice); use strategy: ddp, or a "
                    "normalisation without batch statistics (LayerNorm, GroupNorm)"
                )
        elif self.fsdp is not None:
            raise ConfigError("trainer.fsdp is set but trainer.strategy is ddp; set strategy: fsdp, "
                              "or remove the fsdp section")

    def _join_val_every(self) -> None:
        """val_every_n_steps and validation.every_n_steps are one setting under two names:
        either may be given (YAML written before trainer.validation keeps loading, and the
        resolved config holds both); two different values are an error."""
        old, new = self.val_every_n_steps, self.validation.every_n_steps
        if old is not None and new is not None and old != new:
            raise ConfigError(f"trainer.val_every_n_steps={old} and trainer.validation.every_n_steps={new} "
                              "are the same setting; keep one of them")
        self.val_every_n_steps = self.validation.every_n_steps = old if old is not None else new


@dataclass(kw_only=True)
class ScalingConfig:
    num_workers: int = 1
    """The worker count of a fixed-size run, and the default of min_workers and max_workers."""
    min_workers: int | None = None
    """Elastic runs: start as soon as this many workers are placed, and keep training on
    no fewer (default: num_workers)."""
    max_workers: int | None = None
    """Elastic runs: grow up to this many workers as the cluster gains room (default: the
    larger of num_workers and min_workers). What a resize keeps: trainer.batch_policy."""
    use_gpu: Literal["auto"] | bool = "auto"
    """auto: one GPU per worker when the cluster has GPUs, otherwise CPU."""
    resources_per_worker: dict[str, float] | None = None
    """Ray resources per worker, e.g. {CPU: 2, GPU: 1}; default {CPU: 1} (+ {GPU: 1} on GPUs)."""
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    placement_timeout_s: float = 60.0
    """How long to wait for the cluster to place min_workers workers before failing: at the
    start, and when a failure leaves fewer than min_workers (with failure.recovery fast the
    survivors train meanwhile)."""
    replace_timeout_s: float = 10.0
    """Elastic runs: how long a replacement may take to be placed before the survivors (at
    least min_workers) go on without it: a lost worker's with failure.recovery exact (fast
    goes on at once), a worker's leaving a node being drained. Also how long workers that
    are up to join wait for those started with them, to join in one pause."""

    def __post_init__(self):
        for key in ("num_workers", "min_workers", "max_workers"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"scaling.{key}={value} must be >= 1")
        if self.min_workers is None:
            self.min_workers = self.num_workers
        if self.max_workers is None:
            self.max_workers = max(self.num_workers, self.min_workers)
        if self.min_workers > self.max_workers:
            raise ConfigError(
                f"scaling.min_workers={self.min_workers} is more than scaling.max_workers="
                f"{self.max_workers}; lower min_workers or raise max_workers (both default "
                "to num_workers)"
            )
        for key in ("placement_timeout_s", "replace_timeout_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"scaling.{key} must be > 0")
        for name, amount in (self.resources_per_worker or {}).items():
            if amount < 0:
                raise ConfigError(f"scaling.resources_per_worker.{name}={amount} must be >= 0")
        if self.backend == "nccl" and self.use_gpu is False:
            raise ConfigError(
                "scaling.backend=nccl needs GPU workers but scaling.use_gpu is false; set "
                "scaling.backend: gloo (or auto), or scaling.use_gpu: true on a cluster with GPUs"
            )


@dataclass(kw_only=True)
class KeepBestConfig:
    metric: str
    mode: Literal["min", "max"] = "min"
    k: int = 1

    def __post_init__(self):
        if self.k < 1:
            raise ConfigError(f"checkpoint.keep_best.k={self.k} must be >= 1")


@dataclass(kw_only=True)
class CheckpointConfig:
    every_n_steps: int | None = None
    """Save every N optimizer steps (and at the end of the run); None: only at the end."""
    every_n_minutes: float | None = 30
    """Also save once this many minutes have passed since the last save (rank 0's clock,
    agreed at a step through the metrics' reduction): what a whole-cluster loss or a lost
    driver can cost at most. 30: a save of a 200 MB Adam state held training 0.66 s (sync),
    0.04% of 30 minutes; None: no time trigger."""
    keep_last: int = 2
    """How many of the newest checkpoints to keep (at least 1: the one a resume needs)."""
    keep_best: KeepBestConfig | None = None
    """Also keep the k best by a metric (the latest value logged at save time)."""
    async_save: bool = field(default=False, metadata={"key": "async"})
    """`async: true`: the training thread only copies the state (into shared memory; from a
    GPU, a pinned non-blocking copy) and a process of its own at low priority serialises and
    writes it (DDP: worker/writer.py; FSDP: torch.distributed.checkpoint's async_save, on a
    thread). One save at a time. A failed save (sync or async) is skipped with a warning
    and a checkpoint_failed event, and training goes on; only the final one must succeed."""

    def __post_init__(self):
        if self.every_n_steps is not None and self.every_n_steps < 1:
            raise ConfigError(f"checkpoint.every_n_steps={self.every_n_steps} must be >= 1 (or null)")
        if self.every_n_minutes is not None and not self.every_n_minutes > 0:
            raise ConfigError(f"checkpoint.every_n_minutes={self.every_n_minutes} must be > 0 (or null: "
                              "no time-based checkpoints)")
        if self.keep_last < 1:
            raise ConfigError(
                f"checkpoint.keep_last={self.keep_last} must be >= 1: the newest checkpoint is "
                "the one a resume needs"
            )


@dataclass(kw_only=True)
class ChaosFault:
    """A fault to inject, for tests and for checking a setup. It acts on one rank at the
    end of an optimizer step (after the weights are updated), once per run."""

    action: Literal["kill", "freeze", "hang", "delay", "raise"]
    """kill: SIGKILL the worker process; freeze: SIGSTOP it (alive, holding its sockets,
    answering nothing: a paused VM); hang: stop making progress in the task's code (until
    the driver's step_timeout_s kills it); delay: sleep `seconds`; raise: raise in the worker."""
    step: int | None = None
    """The step it acts after; or null with `probability`."""
    probability: float | None = None
    """Act after any step with this probability (seeded by trainer.seed: reproducible)."""
    rank: int | None = None
    """The rank it acts on; null: a rank drawn at random (seeded)."""
    seconds: float = 1.0
    """How long a delay lasts."""
    at: Literal["end", "random"] = "end"
    """end: after the step's update; random (kill, freeze): from another thread, at a
    random moment of the step (up to the previous step's duration after it begins:
    in the forward, the backward, a collective or the optimizer)."""

    def __post_init__(self):
        if self.at == "random" and self.action not in ("kill", "freeze"):
            raise ConfigError(f"failure.chaos ({self.action}): at=random is for kill and freeze only")
        if (self.step is None) == (self.probability is None):
            raise ConfigError(f"failure.chaos ({self.action}): give exactly one of step or probability")
        if self.step is not None and self.step < 1:
            raise ConfigError(f"failure.chaos ({self.action}): step={self.step} must be >= 1")
        if self.probability is not None and not 0.0 < self.probability <= 1.0:
            raise ConfigError(f"failure.chaos ({self.action}): probability={self.probability} must be in (0, 1]")
        if self.rank is not None and self.rank < 0:
            raise ConfigError(f"failure.chaos ({self.action}): rank={self.rank} must be >= 0 (or null)")
        if self.seconds < 0:
            raise ConfigError(f"failure.chaos ({self.action}): seconds={self.seconds} must be >= 0")


@dataclass(kw_only=True)
class FailureConfig:
    max_failures: int = 3
    """Recoveries allowed in one run; the next failure fails the run. 0: fail at the first."""
    step_timeout_s: float | None = 300.0
    """A worker that makes no progress (no micro-batch, no validation batch) for this long
    is hung: its Python stacks are dumped into the run directory and it is replaced.
    null: never time out."""
    collective_timeout_s: float = 600.0
    """How long a collective (and the forming of a group) may wait for a peer before it
    fails. Detection of a lost or hung peer does not wait for it (the driver sees a death
    at once and a hang after step_timeout_s); it bounds what nothing else catches. Keep it
    above the longest wait ranks have for rank 0 alone (a synchronous checkpoint write)."""
    recovery: Literal["fast", "exact"] = "fast"
    """What the survivors do when a lost worker has no warm spare up to take its place.
    fast: go on at once without it, one world size smaller, while its replacement starts;
    it joins at a step boundary once up (a pause of a fraction of a second, as any grow).
    The global batch and the sample order stay the same at any world size, so nothing is
    lost, but the run ends within float tolerance of an undisturbed one, not bit for bit.
    Below scaling.min_workers only while the replacements come (up to
    scaling.placement_timeout_s, then the run fails as when they cannot be placed). exact:
    wait for the replacement (a process start and torch import: seconds), keeping the world
    size, so a run with failures ends bit-identical to an undisturbed one. Either way a
    ready warm spare takes the lost worker's place at once, bit-identically; a fixed-size
    run with trainer.batch_policy per_worker always waits. Sharded state (fsdp) goes back
    to its peer snapshots, re-sharded onto the ranks left (fast) or at the same size (exact)."""
    warm_spares: int = 1
    """Idle worker processes kept ready (torch and torch._dynamo imported, no resources
    held) to take a lost CPU worker's place at once, keeping the world size (a GPU worker
    needs its GPU at creation: none for GPU runs). Spread over the nodes the workers run
    on (a spare replaces a worker of its own node); started once training runs, and again
    after one is used, once no replacement is starting, so their start does not take the
    cores a recovery needs. Each is a process holding torch in memory. 0: none."""
    snapshot_every_n_steps: int = 10
    """Sharded state (trainer.strategy: fsdp): every this many optimizer steps each worker
    copies its shards of the training state to host memory and to one peer's, so that a
    lost worker's state is recovered from its peer and the run replays at most this many
    steps, reading no checkpoint (the memory it takes: docs/fault-tolerance.md, "FSDP: peer
    snapshots"). 0: recover from the newest checkpoint instead. Replicated state (ddp) needs none: every survivor
    holds it. Your own loop (task.loop) under fsdp copies at every report with state instead
    (any value but 0), so that it loses at most the steps since that report."""
    chaos: list[ChaosFault] = field(default_factory=list)
    """Faults to inject (see ChaosFault)."""

    def __post_init__(self):
        if self.snapshot_every_n_steps < 0:
            raise ConfigError(f"failure.snapshot_every_n_steps={self.snapshot_every_n_steps} must be >= 0 "
                              "(0: no peer snapshots)")
        if self.max_failures < 0:
            raise ConfigError(f"failure.max_failures={self.max_failures} must be >= 0")
        if self.warm_spares < 0:
            raise ConfigError(f"failure.warm_spares={self.warm_spares} must be >= 0 (0: none)")
        if self.step_timeout_s is not None and self.step_timeout_s <= 0:
            raise ConfigError(f"failure.step_timeout_s={self.step_timeout_s} must be > 0 (or null)")
        if self.collective_timeout_s <= 0:
            raise ConfigError(f"failure.collective_timeout_s={self.collective_timeout_s} must be > 0")


@dataclass(kw_only=True)
class DataConfig:
    """How each rank reads its training and validation micro-batches (see raytrainer/worker/input.py).
    Loader processes only fetch what the sample order (data.BatchPlan) names, so the order,
    resume, recovery and resizes are the same with or without them."""

    num_workers: int = 0
    """Loader processes per rank. 0: each micro-batch is read in the training thread when
    the step needs it (no prefetch)."""
    prefetch_factor: int = 2
    """Micro-batches each loader process prepares ahead (with num_workers > 0)."""
    pin_memory: bool = False
    """Put batches in page-locked memory for faster copies to the GPU (GPU workers only;
    ignored on CPU)."""
    persistent_workers: bool = False
    """Keep the loader processes between validations and across re-positioning (a recovery,
    a resize), instead of starting new ones (map-style datasets; streams always restart)."""

    def __post_init__(self):
        if self.num_workers < 0:
            raise ConfigError(f"data.num_workers={self.num_workers} must be >= 0 (0: no loader processes)")
        if self.prefetch_factor < 1:
            raise ConfigError(f"data.prefetch_factor={self.prefetch_factor} must be >= 1")


@dataclass(kw_only=True)
class RunConfig:
    name: str | None = None
    """Run directory name under storage; default: <task module>-<UTC timestamp>."""
    storage: str = "runs"
    """Where run directories live: a local path, a file:// or an s3:// URI."""
    resume: str = "auto"
    """auto: continue from the newest committed checkpoint of this run directory, if any;
    never: always start fresh (an existing run directory is an error); or a checkpoint
    directory to start from."""
    cwd: str | None = field(default=None, repr=False, metadata={"internal": True})
    """Not a config key: the directory the run was started from (resolve_paths), where the
    workers work when it exists on their node."""

    def __post_init__(self):
        if self.name is not None and (not self.name or "/" in self.name or self.name in (".", "..")):
            raise ConfigError(f"run.name={self.name!r} must be a plain directory name")
        scheme = self.storage.partition("://")[0] if "://" in self.storage else None
        if scheme not in (None, "file", "s3"):
            raise ConfigError(
                f"run.storage={self.storage!r}: use a local path, a file:// or an s3:// URI"
            )


def resolve_paths(config: Config, cwd: str) -> None:
    """The config's relative local paths (run.storage, a run.resume path) made absolute against
    `cwd`, the directory the user ran from, on the driver before any worker sees them: a
    worker's own working directory is its Ray's (a kept local Ray started from elsewhere, a
    cluster's), and the run directory is one place, the one the run prints. URIs stay."""
    def absolute(path: str) -> str:
        return path if "://" in path else os.path.normpath(os.path.join(cwd, os.path.expanduser(path)))

    config.run.cwd = cwd
    config.run.storage = absolute(config.run.storage)
    if config.run.resume not in ("auto", "never"):
        config.run.resume = absolute(config.run.resume)


LOGGER_KEYS = {
    "tensorboard": ("type", "close_timeout_s"),
    "mlflow": ("type", "tracking_uri", "experiment", "run_name", "log_checkpoints", "close_timeout_s"),
    "wandb": ("type", "project", "entity", "run_name", "mode", "log_checkpoints", "close_timeout_s"),
    None: ("target", "args", "close_timeout_s"),  # a user's own sink
}


@dataclass(kw_only=True)
class LoggerConfig:
    """An experiment tracker the driver sends the run to (metric rows, the config, lifecycle
    events, model.pt): a built-in `type`, or a user's own sink class (`target`, `args`).
    Each runs on its own thread, so a slow or failed one never holds training up."""

    type: Literal["tensorboard", "mlflow", "wandb"] | None = None
    target: str | None = None
    """A user's sink, `package.module:ClassName` (see raytrainer.Sink), built with `args`."""
    args: dict[str, Any] = field(default_factory=dict)
    tracking_uri: str | None = None
    """mlflow: the tracking server (or store) URI; default $MLFLOW_TRACKING_URI, else MLflow's."""
    experiment: str | None = None
    """mlflow: experiment name, created if missing; default $MLFLOW_EXPERIMENT_NAME, else
    MLflow's Default experiment."""
    project: str | None = None
    """wandb: default $WANDB_PROJECT, else W&B's."""
    entity: str | None = None
    """wandb: user or team; default W&B's."""
    mode: Literal["online", "offline"] | None = None
    """wandb: default $WANDB_MODE, else online. Offline runs are uploaded by `wandb sync`."""
    run_name: str | None = None
    """mlflow, wandb: the tracker's run name; default run.name."""
    log_checkpoints: bool = False
    """mlflow, wandb: upload every committed checkpoint too (model.pt always is)."""
    close_timeout_s: float = 60.0
    """How long the end of the run waits for this logger to send what it has left."""

    def __post_init__(self):
        if (self.type is None) == (self.target is None):
            raise ConfigError(
                "type/target: give exactly one: type (one of 'tensorboard', 'mlflow', 'wandb') "
                "or target (your own sink, 'package.module:ClassName')"
            )
        if self.target is not None:
            Component(target=self.target)  # the same import-path check as callbacks
        allowed = LOGGER_KEYS[self.type]
        for f in dataclasses.fields(self):
            given = getattr(self, f.name) != (f.default_factory() if f.default_factory is not dataclasses.MISSING
                                              else f.default)
            if given and f.name not in allowed:
                kind = f"type {self.type!r}" if self.type else "a target sink"
                raise ConfigError(f"{f.name} does not apply to {kind}; its keys: {', '.join(allowed)}")
        if self.close_timeout_s <= 0:
            raise ConfigError(f"close_timeout_s={self.close_timeout_s} must be > 0")


@dataclass(kw_only=True)
class Config:
    task: TaskConfig
    trainer: TrainerConfig | None = None
    """Required with a Task; your own loop (task.loop) may leave it out."""
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)
    data: DataConfig = field(default_factory=DataConfig)
    callbacks: list[Component] = field(default_factory=list)
    """raytrainer.Callback classes; each runs on every worker, or on the driver when its
    class sets on_driver = True."""
    loggers: list[LoggerConfig] = field(default_factory=lambda: [LoggerConfig(type="tensorboard")])
    """Where the driver sends the run besides metrics.jsonl: TensorBoard, MLflow, W&B, or
    a user's sink. [] for none."""

    def __post_init__(self):
        if self.trainer is None:
            if not self.task.is_loop:
                raise ConfigError("missing required key 'trainer'")
            self.trainer = TrainerConfig()
        if self.task.is_loop:
            _check_loop_config(self)
        elif self.trainer.max_epochs is None and self.trainer.max_steps is None:
            raise ConfigError("set trainer.max_epochs or trainer.max_steps (or both)")
        batch, workers = self.trainer.global_batch_size, self.scaling.max_workers
        if self.trainer.batch_policy == "per_worker" and batch % self.scaling.num_workers:
            raise ConfigError(
                f"trainer.batch_policy=per_worker keeps each worker's batch, "
                f"trainer.global_batch_size / scaling.num_workers, but {batch} does not split "
                f"evenly over {self.scaling.num_workers} workers; make the batch a multiple of "
                "num_workers"
            )
        if workers > batch and self.trainer.batch_policy == "fixed_global":
            raise ConfigError(
                f"up to {workers} workers (scaling.max_workers, default num_workers) cannot share "
                f"trainer.global_batch_size={batch}: each needs at least one sample; raise the "
                "batch or lower the worker count"
            )
        for fault in self.failure.chaos:
            if fault.rank is not None and fault.rank >= workers:
                raise ConfigError(
                    f"failure.chaos ({fault.action}): rank={fault.rank} but there are at most "
                    f"{workers} workers (scaling.max_workers, default num_workers); use a rank "
                    f"below {workers} or null for a random one"
                )

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)


# What a run of your own loop (task.loop) takes from the config: the loop does its own
# steps, so the keys that configure the Task loop's step do not apply; a key set anyway is
# an error, never silently ignored. The rest (scaling, failure, checkpoint retention, run,
# loggers, driver callbacks) works as for a Task.
LOOP_TRAINER_KEYS = ("max_epochs", "max_steps", "global_batch_size", "seed", "strategy", "fsdp", "sync_batchnorm")


def _check_loop_config(config: Config) -> None:
    """Keys that a run of your own loop cannot honour, with what to do instead."""
    for section, allowed, instead in (
        (config.trainer, LOOP_TRAINER_KEYS, "do it in your loop (e.g. torch.autocast, "
         "clip_grad_norm_, your scheduler), or write a raytrainer.Task"),
        (config.data, (), "build your DataLoader in your loop (ctx.sampler gives its sample order)"),
    ):
        name = "trainer" if section is config.trainer else "data"
        default = type(section)()
        for f in dataclasses.fields(section):
            if f.name not in allowed and getattr(section, f.name) != getattr(default, f.name):
                raise ConfigError(
                    f"{name}.{_key(f)} applies to a Task's loop, not to your own (task.loop); "
                    f"remove it and {instead}. A loop takes trainer.{', trainer.'.join(allowed)}"
                    if name == "trainer" else
                    f"{name}.{_key(f)} applies to a Task's loop, not to your own (task.loop); {instead}"
                )
    if config.failure.chaos:
        raise ConfigError("failure.chaos injects faults at a Task loop's steps; your own loop (task.loop) has "
                          "none to act at: remove failure.chaos and kill a worker from outside instead")


# --------------------------------------------------------------------------- parsing

def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is dict or dataclasses.is_dataclass(tp):
        return "mapping"
    if origin is list:
        return "list"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _check(value: Any, tp: Any, key: str) -> Any:
    """Return `value` checked (and int->float widened) against annotation `tp`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        arms = typing.get_args(tp)
        if value is None and type(None) in arms:
            return None
        for arm in arms:
            if dataclasses.is_dataclass(arm):  # a section: its own errors are the useful ones
                return _check(value, arm, key)
            try:
                return _check(value, arm, key)
            except ConfigError:
                pass
    elif origin is Literal:
        if any(value == a and type(value) is type(a) for a in typing.get_args(tp)):
            return value
    elif dataclasses.is_dataclass(tp):
        return _build(tp, {} if value is None else value, key)
    elif origin is list:
        if isinstance(value, list):
            (item_tp,) = typing.get_args(tp)
            return [_check(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, dict):
            _, value_tp = typing.get_args(tp)
            return {str(k): _check(v, value_tp, f"{key}.{k}") for k, v in value.items()}
    elif tp is Any:
        return value
    elif tp is type(None):
        if value is None:
            return None
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, tp):
        return value
    raise ConfigError(f"{key}={value!r} has the wrong type or value; allowed: {_type_name(tp)}")


def _build(cls: type, data: Any, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'the config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {_key(f): f for f in _config_fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"section '{prefix}'" if prefix else "the top level"
        raise ConfigError(
            f"unknown key {', '.join(repr(_join(prefix, k)) for k in unknown)} in {where}; "
            f"allowed keys: {', '.join(fields)}"
        )
    kwargs = {}
    for name, f in fields.items():
        key = _join(prefix, name)
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"missing required key '{key}'")
            continue
        kwargs[f.name] = _check(data[name], hints[f.name], key)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        if cls in (Component, LoggerConfig):  # used in lists: their messages need the key
            raise ConfigError(f"{prefix}.{exc}") from None
        raise


def _key(f: dataclasses.Field) -> str:
    """The YAML key of a field (differs where the key is a Python keyword, e.g. async)."""
    return f.metadata.get("key", f.name)


def _config_fields(cls_or_obj: Any) -> list[dataclasses.Field]:
    """The fields that are config keys (not those the library sets for itself)."""
    return [f for f in dataclasses.fields(cls_or_obj) if not f.metadata.get("internal")]


def _to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {_key(f): _to_dict(getattr(obj, f.name)) for f in _config_fields(obj)}
    if isinstance(obj, list):
        return [_to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _to_dict(v) for k, v in obj.items()}
    return obj


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def apply_overrides(raw: dict[str, Any], overrides: typing.Iterable[str]) -> dict[str, Any]:
    """Apply `section.key=value` strings (values parsed as YAML) to a raw config dict."""
    overrides = list(overrides)
    _num_workers_sets_the_size(raw, overrides)
    _one_val_every(raw, overrides)
    for item in overrides:
        path, sep, text = item.partition("=")
        if not sep or not path.strip():
            raise ConfigError(f"--set {item!r}: write overrides as section.key=value")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML ({exc})") from None
        node = raw
        parts = path.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: '{part}' is not a section")
            node = child
        node[parts[-1]] = value
    return raw


def _one_val_every(raw: dict[str, Any], overrides: list[str]) -> None:
    """A run's config.yaml holds trainer.val_every_n_steps and trainer.validation.every_n_steps
    alike (one setting, two names): `--set` of either replaces both."""
    keys = {item.partition("=")[0].strip() for item in overrides}
    trainer = raw.get("trainer")
    if not isinstance(trainer, dict):
        return
    validation = trainer.get("validation")
    if "trainer.val_every_n_steps" in keys and isinstance(validation, dict):
        validation.pop("every_n_steps", None)
    if "trainer.validation.every_n_steps" in keys:
        trainer.pop("val_every_n_steps", None)


def _num_workers_sets_the_size(raw: dict[str, Any], overrides: list[str]) -> None:
    """`--set scaling.num_workers=N` alone makes a fixed-size config N workers: its
    min_workers and max_workers follow, as they would had they been left out. A run's
    config.yaml holds them resolved from its num_workers (`raytrainer resume RUN --set
    scaling.num_workers=1` of a 2-worker run trained on 2, silently). An elastic config
    (bounds other than its num_workers) says nothing that N could replace: an error."""
    keys = {item.partition("=")[0].strip() for item in overrides}
    if "scaling.num_workers" not in keys or keys & {"scaling.min_workers", "scaling.max_workers"}:
        return
    scaling = raw.get("scaling")
    if not isinstance(scaling, dict):
        return
    size = scaling.get("num_workers", 1)
    bounds = {k: scaling[k] for k in ("min_workers", "max_workers") if scaling.get(k) is not None}
    if any(v != size for v in bounds.values()):
        raise ConfigError(
            "--set scaling.num_workers does not resize this config: it is elastic ("
            + ", ".join(f"scaling.{k}={v}" for k, v in bounds.items())
            + "); set scaling.min_workers and scaling.max_workers instead")
    for key in bounds:
        del scaling[key]


def load_config(source: str | Path | dict[str, Any], overrides: typing.Iterable[str] = ()) -> Config:
    """Build a validated Config from a YAML path or a dict, then apply --set overrides."""
    if isinstance(source, dict):
        raw = _deepcopy(source)
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return _build(Config, apply_overrides(_renamed(raw), overrides), "")


def _renamed(raw: dict[str, Any]) -> dict[str, Any]:
    """Keys an earlier raytrainer wrote, read as their new names, so that its run
    directories (config.yaml) still resume: failure.warm_spare (true/false) is now
    failure.warm_spares (a count)."""
    failure = raw.get("failure")
    if isinstance(failure, dict) and isinstance(failure.get("warm_spare"), bool):
        if "warm_spares" in failure:
            raise ConfigError("failure.warm_spare and failure.warm_spares are both set: "
                              "keep warm_spares (a count), the newer name")
        old = failure.pop("warm_spare")
        failure["warm_spares"] = int(old)
        warnings.warn(f"failure.warm_spare: {str(old).lower()} is now failure.warm_spares: "
                      f"{int(old)} (a count of spares); read as such", FutureWarning, stacklevel=3)
    return raw


def _deepcopy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deepcopy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deepcopy(v) for v in data]
    return data


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
