"""The sizes a rank's loop is built on, derived once from its LoopSettings: the world sizes
the config gives (the one the global batch and the LR are set for, the least a worker's
micro-batch is sized for, the most an elastic run may grow to), how long the run trains, and
from them the BatchPlan at any world size and the LR schedule's length.

A frozen value, so the loop's construction reads as what it is built from; `check` makes
the plans a run may need before anything trains, so a batch that the largest group could
not share fails at set-up, not at a grow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...config import TrainerConfig
from ...data import BatchPlan
from ...errors import ConfigError
from ..input.input import dataset_size
from .schedule import build_lr_schedule

if TYPE_CHECKING:
    import torch

    from ...task import Task
    from .settings import LoopSettings


@dataclass(frozen=True, kw_only=True)
class Sizing:
    trainer: TrainerConfig
    base_world_size: int
    """scaling.num_workers: the world size global_batch_size and the LR are given for (what
    the per_worker batch policy scales from); default the world size."""
    min_world_size: int
    """scaling.size: below it a worker's micro-batch stays what it is at that size."""
    most_world_size: int
    """What an elastic run may grow to: scaling.max_workers, at least the world size."""
    max_steps: int | None
    max_epochs: int | None
    """Training stops at max_steps optimizer steps or at the end of epoch max_epochs."""

    @classmethod
    def of(cls, settings: LoopSettings, world_size: int) -> Sizing:
        cfg = settings.trainer
        return cls(trainer=cfg, base_world_size=settings.base_world_size or world_size,
                   min_world_size=settings.min_world_size or 1,
                   most_world_size=max(world_size, settings.max_world_size or 0),
                   max_steps=cfg.fast_dev_run or cfg.max_steps,
                   max_epochs=None if cfg.fast_dev_run else cfg.max_epochs)

    def plan(self, train_data: Any, world_size: int) -> BatchPlan:
        cfg = self.trainer
        batch = cfg.global_batch_size
        if cfg.batch_policy == "per_worker":
            batch = batch // self.base_world_size * world_size
        # A run that went on without a lost worker (failure.recovery: fast, or no room for its
        # replacement) keeps the memory of a forward pass at its size: the survivors
        # accumulate more micro-batches.
        micro = cfg.micro_batch_size or -(-batch // max(world_size, self.min_world_size))
        return BatchPlan(dataset_size(train_data), batch, micro, world_size, cfg.seed,
                         overfit_batches=cfg.overfit_batches)

    def check(self, train_data: Any, val_data: Any, world_size: int) -> BatchPlan:
        """The plan at `world_size`, once the largest group's plan and validation shards are
        known to fit too."""
        plan = self.plan(train_data, world_size)
        most = self.most_world_size
        self.plan(train_data, most)
        if val_data is not None and len(val_data) < most:
            raise ConfigError(
                f"the validation dataset has {len(val_data)} samples, fewer than the "
                f"{most} workers (scaling.max_workers); give it at least one sample per worker"
            )
        if self.trainer.early_stopping and val_data is None:
            raise ConfigError("trainer.early_stopping needs a validation dataset; the task has none")
        return plan

    def total_steps(self, train_data: Any) -> int:
        """The LR schedule's length (and the progress bar's): exact with a fixed global batch;
        under per_worker, the steps at base_world_size workers (a resize changes how many
        steps an epoch takes, not the schedule)."""
        by_epochs = (self.max_epochs * self.plan(train_data, self.base_world_size).steps_per_epoch
                     if self.max_epochs else None)
        return min(s for s in (by_epochs, self.max_steps) if s is not None)


def build_scheduler(task: Task, optimizer: torch.optim.Optimizer, total_steps: int, cfg: TrainerConfig) -> Any:
    """The task's scheduler (build_scheduler), or trainer.lr_schedule's; never both."""
    scheduler = task.build_scheduler(optimizer, total_steps)
    if cfg.lr_schedule is not None:
        if scheduler is not None:
            raise ConfigError(
                f"{type(task).__name__}.build_scheduler returns a scheduler and "
                "trainer.lr_schedule is set too; keep one of them"
            )
        scheduler = build_lr_schedule(optimizer, total_steps, cfg.lr_schedule)
    return scheduler
