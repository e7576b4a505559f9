"""trainer.early_stopping: stop when a validation metric stops improving. Every rank holds
the same reduced metrics, so every rank decides the same, with no communication."""

from __future__ import annotations

import math

from ...config import EarlyStoppingConfig
from ...errors import ConfigError


class EarlyStopping:
    def __init__(self, cfg: EarlyStoppingConfig | None):
        self.cfg = cfg
        self.best: float | None = None
        self.bad_validations = 0

    def check(self, metrics: dict[str, float]) -> str | None:
        """Take a validation's metrics; the reason to stop, or None to go on."""
        es = self.cfg
        if es is None:
            return None
        if es.metric not in metrics:
            raise ConfigError(
                f"trainer.early_stopping.metric={es.metric!r} is not a validation metric; "
                f"the task's are {sorted(metrics)}"
            )
        value = metrics[es.metric]
        better = (
            self.best is None
            or (value < self.best - es.min_delta if es.mode == "min" else value > self.best + es.min_delta)
        )
        if better and math.isfinite(value):
            self.best, self.bad_validations = value, 0
            return None
        self.bad_validations += 1
        if self.bad_validations < es.patience:
            return None
        return f"early_stopping: {es.metric} did not improve on {self.best:.6g} for {es.patience} validations"
