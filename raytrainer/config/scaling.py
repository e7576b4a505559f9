"""The scaling section: how many workers, on what, and how long to wait for them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError


@dataclass(kw_only=True)
class ScalingConfig:
    num_workers: int = 1
    """The run's size: the worker count it waits for (scaling.placement_timeout_s) and
    grows back to after it lost workers; the default of max_workers."""
    min_workers: int | None = None
    """The fewest workers the run trains on. Below its size for want of room (a lost node
    not yet back, a cluster still scaling up) it goes on with the workers it has, down to
    this many, and grows back as nodes come. Default 1 where the maths stay the same at any
    size (a Task whose trainer.batch_policy is fixed_global); num_workers where the global
    batch follows the world size (per_worker, your own loop)."""
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
    """How long to wait for the run's size in workers before going on with fewer: at the
    start, and for a lost worker's replacement with failure.recovery exact. Below
    min_workers it is how long the run waits before it fails."""
    replace_timeout_s: float = 10.0
    """How long a replacement may take to be placed before the workers go on without it
    where they are the run's size without it (an elastic run above num_workers): a lost
    worker's with failure.recovery exact (fast goes on at once), a worker's leaving a node
    being drained. Also how long workers that are up to join wait for those started with
    them, to join in one pause."""

    def settle(self, global_batch_fixed: bool) -> None:
        """min_workers's default, which follows what a smaller world would change."""
        if self.min_workers is None:
            self.min_workers = 1 if global_batch_fixed else min(self.num_workers, self.max_workers)

    @property
    def size(self) -> int:
        """The worker count the run waits for and grows back to: num_workers, within the
        bounds (an elastic config that gives only min_workers starts at that many)."""
        low = self.num_workers if self.min_workers is None else self.min_workers
        return min(max(self.num_workers, low), self.max_workers)

    def __post_init__(self):
        for key in ("num_workers", "min_workers", "max_workers"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"scaling.{key}={value} must be >= 1")
        if self.max_workers is None:
            self.max_workers = max(self.num_workers, self.min_workers or 0)
        if self.min_workers is not None and self.min_workers > self.max_workers:
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
