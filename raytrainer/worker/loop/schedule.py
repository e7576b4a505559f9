"""Learning-rate schedules in optimizer steps, so they do not depend on the worker count."""

from __future__ import annotations

import math

import torch

from ...config import LRScheduleConfig


def lr_multiplier(step: int, total_steps: int, cfg: LRScheduleConfig) -> float:
    """Factor on the base LR for optimizer step `step` (0-based): linear warmup over
    warmup_steps (reaching 1 at the last warmup step), then decay to min_lr_ratio at
    the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    span = max(total_steps - 1 - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.decay == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def build_lr_schedule(optimizer: torch.optim.Optimizer, total_steps: int,
                      cfg: LRScheduleConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, cfg))
