"""The trainer section: the Task loop's steps, schedule, precision, validation and stops."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import ConfigError


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
class CompileConfig:
    """trainer.compile: torch.compile's options, applied on every worker to the model the
    step calls, after DDP wraps it or fully_shard shards it (see docs/config.md)."""

    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    backend: str = "inductor"
    """A torch.compile backend name (inductor, aot_eager, eager, ...); inductor's compiled
    artifacts are cached for the run's other workers (worker/loop/compiling.py)."""
    dynamic: bool | None = None
    """null: torch's default (static shapes, dynamic after a second shape is seen)."""
    fullgraph: bool = False
    """true: a graph break is an error instead of a fall back to eager Python."""

    def __post_init__(self):
        if not self.backend.strip():
            raise ConfigError("trainer.compile.backend must name a torch.compile backend, e.g. inductor")


@dataclass(kw_only=True)
class ValidationConfig:
    """trainer.validation: when validation runs, and where (see worker/loop/validation.py)."""

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
    compile: bool | CompileConfig | None = None
    """torch.compile the model on every worker: false or null (off, the default), true
    (torch's defaults), or a mapping of its options (trainer.compile.mode, backend, dynamic,
    fullgraph). Resolved to null or a CompileConfig."""
    lr_schedule: LRScheduleConfig | None = None
    early_stopping: EarlyStoppingConfig | None = None
    peak_flops_per_worker: float | None = None
    """Peak FLOP/s of one worker's device, for model FLOPs utilisation ('mfu') when the
    task declares flops_per_sample. Default: known GPUs' bf16/fp16 dense peak."""
    fast_dev_run: int = 0
    """Debug: run N training steps and N validation batches per worker, then stop."""
    overfit_batches: int = 0
    """Debug: train on the same first N global batches every epoch."""
    nonfinite: Literal["stop", "skip", "rollback", "off"] = "stop"
    """A step whose loss (or, with grad_clip_norm, gradient norm) is NaN or Inf, on any rank,
    is never applied. stop: the run fails at that step (exit status 1), naming the step,
    the ranks and the metric; its checkpoints hold only finite weights. skip: that update is
    dropped on every rank and counted ('nonfinite_skips', a nonfinite_skipped event); more
    than nonfinite_max_skips in a row stop the run. rollback: every rank goes back to the
    state it keeps in memory (every failure.snapshot_every_n_steps steps), the data moves past
    the batches since, and the run goes on (a rolled_back event; see worker/loop/rollback.py). off:
    no check (fp16's scaler still skips steps whose gradients overflow)."""
    nonfinite_max_skips: int = 10
    """trainer.nonfinite=skip: how many non-finite steps in a row are skipped before the run stops."""
    spike_factor: float | None = None
    """trainer.nonfinite=rollback: a step whose loss (the mean over every rank's batch) is
    finite but over this many times the median of the recent steps' losses is rolled back too
    (a spike: a bad batch, or weights starting to diverge). null: only non-finite losses."""
    rollback_max: int = 3
    """trainer.nonfinite=rollback: more rollbacks than this within 100 steps stop the run as
    `stop` does (the same bad data or a learning rate that keeps diverging)."""

    def __post_init__(self):
        for key in ("max_epochs", "max_steps", "global_batch_size", "micro_batch_size",
                    "val_every_n_steps", "log_every_n_steps"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"trainer.{key}={value} must be a positive integer")
        self._join_val_every()
        # One shape for the rest of the package: off is None, on is its options.
        if self.compile is True:
            self.compile = CompileConfig()
        elif self.compile is False:
            self.compile = None
        for key in ("fast_dev_run", "overfit_batches", "nonfinite_max_skips"):
            if getattr(self, key) < 0:
                raise ConfigError(f"trainer.{key} must be >= 0 (0 turns it off)")
        self._check_rollback()
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

    def _check_rollback(self) -> None:
        if self.spike_factor is not None and self.nonfinite != "rollback":
            raise ConfigError(f"trainer.spike_factor={self.spike_factor} needs trainer.nonfinite: rollback "
                              f"(it is {self.nonfinite}): a finite spike is undone by going back, not stopped "
                              "or skipped")
        if self.spike_factor is not None and not self.spike_factor > 1:
            raise ConfigError(f"trainer.spike_factor={self.spike_factor} must be > 1 (e.g. 10), or null")
        if self.rollback_max < 1:
            raise ConfigError(f"trainer.rollback_max={self.rollback_max} must be >= 1")

    def _join_val_every(self) -> None:
        """val_every_n_steps and validation.every_n_steps are one setting under two names:
        either may be given (YAML written before trainer.validation keeps loading, and the
        resolved config holds both); two different values are an error."""
        old, new = self.val_every_n_steps, self.validation.every_n_steps
        if old is not None and new is not None and old != new:
            raise ConfigError(f"trainer.val_every_n_steps={old} and trainer.validation.every_n_steps={new} "
                              "are the same setting; keep one of them")
        self.val_every_n_steps = self.validation.every_n_steps = old if old is not None else new
