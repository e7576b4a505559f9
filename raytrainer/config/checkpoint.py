"""The checkpoint section: when to save, where, and which checkpoints to keep."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import ConfigError


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
    writes it (DDP: worker/state/writer.py; FSDP: torch.distributed.checkpoint's async_save, on a
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
