"""The data section: how the Task loop reads its datasets."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


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
