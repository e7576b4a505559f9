"""The scaling section: how many workers, on what, and how long to wait for them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError


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
