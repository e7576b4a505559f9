"""What a task's train_step and val_step return: a dict of metrics (train_step's with
'loss', a scalar tensor that requires grad), the same keys every step, reduced over ranks
as one float tensor in sorted key order."""

from __future__ import annotations

from typing import Any

import torch

from ...errors import TaskError


class StepOutputs:
    def __init__(self, task: Any, device: torch.device, val_keys: list[str] | None = None):
        self.task, self.device = task, device
        # The metric names of each kind, sorted, fixed by the first step of that kind.
        self.keys: dict[str, list[str] | None] = {"train": None, "val": val_keys}

    def loss(self, out: Any) -> torch.Tensor:
        loss = out.get("loss") if isinstance(out, dict) else None
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            got = f"a dict with keys {sorted(out)}" if isinstance(out, dict) else type(out).__name__
            raise TaskError(
                f"{type(self.task).__name__}.train_step returned {got}; it must return a dict "
                "with 'loss': a scalar tensor that requires grad"
            )
        return loss

    def stack(self, out: Any, kind: str) -> torch.Tensor:
        """The step's metrics as one float tensor on the device, in the kind's key order."""
        if not isinstance(out, dict):
            raise TaskError(f"{type(self.task).__name__}.{kind}_step must return a dict of metrics")
        keys = self.keys[kind]
        if keys is None:
            keys = self.keys[kind] = sorted(out)
        elif sorted(out) != keys:
            raise TaskError(
                f"{type(self.task).__name__}.{kind}_step returned keys {sorted(out)} after "
                f"{keys} earlier; return the same metrics every step"
            )
        return torch.stack([
            out[k].detach().float().reshape(()) if isinstance(out[k], torch.Tensor)
            else torch.tensor(float(out[k]), device=self.device)
            for k in keys
        ])
