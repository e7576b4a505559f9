"""What a rank's loop is built with: what the config tells it beyond the trainer section
(LoopSettings), and its outlets into the process it runs in (Outlets). Below the loop and
what sizes it (sizing.py), and what builds it (process/building.py, process/warm.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ...callbacks import Callbacks
from ...config import ChaosFault, CheckpointConfig, Config, DataConfig, TaskConfig, TrainerConfig

if TYPE_CHECKING:
    from ...checkpoint import Checkpoints
    from ..state.snapshot import PeerSnapshots
    from .window import Report


@dataclass(frozen=True, kw_only=True)
class LoopSettings:
    """What the config tells a rank's loop, beyond the trainer section."""

    trainer: TrainerConfig
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    chaos: tuple[ChaosFault, ...] = ()
    base_world_size: int | None = None
    """scaling.num_workers: the world size global_batch_size and the LR are given for (what
    the per_worker batch policy scales from); default the world size."""
    max_world_size: int | None = None
    """scaling.max_workers: what an elastic run may grow to."""
    min_world_size: int | None = None
    """scaling.size: below it (while a lost worker's replacement starts, or waits for room)
    a worker's micro-batch stays what it is at that size, and it accumulates more of them."""
    task: TaskConfig | None = None
    """How validation actors build the task (trainer.validation.async); None: sync only."""
    snapshot_every_n_steps: int | str = "auto"
    """failure.snapshot_every_n_steps: also how often trainer.nonfinite=rollback keeps a state."""

    @classmethod
    def of(cls, config: Config) -> LoopSettings:
        return cls(trainer=config.trainer, data=config.data, checkpoint=config.checkpoint,
                   chaos=tuple(config.failure.chaos), base_world_size=config.scaling.num_workers,
                   max_world_size=config.scaling.max_workers, min_world_size=config.scaling.size,
                   task=config.task, snapshot_every_n_steps=config.failure.snapshot_every_n_steps)


@dataclass(kw_only=True)
class Outlets:
    """What the loop sends out, and asks of the process it runs in (the worker actor; tests
    give lists): rank 0's metric rows (`report`), lifecycle events for the driver's log
    (`notify`), worker callbacks, the run's checkpoints, the once-per-run claim of a chaos
    fault, and the peer snapshots kept across groups (sharded state)."""

    report: Report = field(default=lambda rows: None)
    notify: Callable[[dict[str, Any]], None] = field(default=lambda event: None)
    callbacks: Callbacks = field(default_factory=lambda: Callbacks([]))
    checkpoints: Checkpoints | None = None
    chaos_claim: Callable[[int, int], bool] | None = None
    snapshots: PeerSnapshots | None = None
    share_compiled: Callable[[], int] = field(default=lambda: 0)
    """trainer.compile: what this process compiled, put where the run's workers on other
    nodes find it (rank 0, once it compiled graphs; compiling.share_run_artifacts); the bytes."""
