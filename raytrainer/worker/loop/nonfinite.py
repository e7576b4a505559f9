"""Non-finite steps (trainer.nonfinite): whether a step's update may be applied, decided
alike on every rank with no collective of its own; then the run stops before that update
(NonFiniteLoss), or, with `skip`, the step is dropped and counted; with `rollback` the run
goes back to a state kept in memory (rollback.py)."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch

from ...errors import NonFiniteLoss
from ..dist import all_reduce_sum


def what_is_not_finite(step: int, loss_col: int, total: torch.Tensor, carried: list[float] | None,
                       norm: torch.Tensor | None, *, rank: int, world_size: int, grads: bool,
                       module: torch.nn.Module,
                       waiting: Callable[[], contextlib.AbstractContextManager]) -> str | None:
    """What is not finite in step `step` ("step 3: the loss is inf on rank(s) 1"), or None.

    Judged from values every rank has alike: the loss summed over ranks where the metrics
    rode on the gradient all-reduce (DDP; `carried`, on the host), this rank's own loss
    (`total`) at one rank, the norm of all-reduced gradients where clipping computed it,
    and for sharded gradients, whose loss is not summed anywhere, whether this rank's
    gradient shards are finite (a NaN loss on any rank makes every shard NaN in the
    reduce-scatter). `grads`: whether the gradients are this check's to judge (under fp16
    they are the scaler's: an overflow is skipped and counted as skipped_steps). Naming
    the ranks of a bad summed loss takes one all-reduce (`waiting` marks it for the hang
    check), on the way out only."""
    sharded = carried is None and world_size > 1
    loss = carried[loss_col] if carried is not None else None
    bad_grads = False
    if grads and norm is not None:
        bad_grads = not math.isfinite(norm.item())
    elif grads and sharded:
        shards = [g.to_local() if hasattr(g, "to_local") else g
                  for g in (p.grad for p in module.parameters()) if g is not None]
        bad_grads = bool(shards) and not bool(torch.stack([torch.isfinite(g).all() for g in shards]).all())
    if loss is None and (not sharded or bad_grads):  # this rank's own, for the check or the message
        loss = total[loss_col].item()
    bad_loss = not sharded and not math.isfinite(loss)
    if bad_loss:
        if carried is None:
            where = f" on rank {rank}"
        else:  # every rank is here: the sum is the same on all of them
            with waiting():
                bad = ranks_with_bad_loss(total[loss_col], rank, world_size)
            where = f" on rank(s) {', '.join(map(str, bad))}" if bad else " (the sum over ranks overflows)"
        return f"step {step}: the loss is {loss}{where}"
    if bad_grads and norm is not None:
        return f"step {step}: the gradient norm is {norm.item()} (the loss, summed over ranks: {loss})"
    if bad_grads:
        return f"step {step}: the gradients are not finite (the loss on rank {rank}: {loss})"
    return None


def ranks_with_bad_loss(loss: torch.Tensor, rank: int, world_size: int) -> list[int]:
    """The ranks whose own loss is not finite: one all-reduce, which every rank calls."""
    flags = torch.zeros(world_size, device=loss.device)
    flags[rank] = float(not math.isfinite(loss.item()))
    return [r for r, bad in enumerate(all_reduce_sum(flags).tolist()) if bad]


class NonFiniteSteps:
    """What trainer.nonfinite does with a step that is not finite, and the count of those
    dropped (`skips`, part of the training state)."""

    def __init__(self, mode: str, max_skips: int, notify: Callable[[dict[str, Any]], None]):
        self.mode, self.max_skips, self.notify = mode, max_skips, notify
        self.skips = 0
        self._in_row = 0

    def finite(self) -> None:
        self._in_row = 0

    def drop(self, step: int, what: str, rank: int) -> None:
        """Count step `step` as dropped, or raise NonFiniteLoss (`stop`, or too many in a row)."""
        if self.mode == "stop":
            raise NonFiniteLoss(
                f"{what}. The run stops before applying that update (trainer.nonfinite=stop): the weights "
                "and every committed checkpoint hold finite values. Look for the input that makes it (a "
                "record with inf or NaN features, a log of 0, a division by zero) or lower the learning "
                "rate, then `raytrainer resume` the run; or set trainer.nonfinite: skip to drop such steps")
        self._in_row += 1
        if self._in_row > self.max_skips:
            raise NonFiniteLoss(
                f"{what}, and the {self._in_row - 1} steps before it were skipped for the same reason: "
                f"more than trainer.nonfinite_max_skips={self.max_skips} in a row, so the run "
                "stops (the weights and checkpoints hold finite values). Look for the input or the "
                "learning rate that makes it, then `raytrainer resume` the run")
        self.skips += 1
        if rank == 0:
            self.notify({"event": "nonfinite_skipped", "step": step, "why": what, "nonfinite_skips": self.skips})
