"""A validation in the training process, where the validation actors (validation.py) do not
take it: this rank's shard of the validation set through the task's val_step, the metrics
summed over the samples, then reduced over ranks into their means; then their row, the
latest metrics keep_best ranks checkpoints by, early stopping and the callbacks.

It runs on the EMA weights when on, and never on the DDP wrapper: its forward adds
collectives, and validation shards may differ in length by one. A sharded model's forward
is a collective itself: every rank then runs as many batches as the longest shard has, the
ranks short of one repeating a batch whose result is not counted.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ...data import batch_size_of, to_device
from ..dist import all_reduce_sum

if TYPE_CHECKING:
    from .face import EvaluateFace


@torch.no_grad()
def validate_here(loop: EvaluateFace, epoch: int) -> dict[str, float] | None:
    if loop.validation is not None and loop.validation.takes(epoch):
        return None  # asked of the validation actors; training goes on
    loop.flush(wait=True)
    if loop.val_data is None:
        return None
    with loop.train.averaged() as model:
        metrics = evaluate(loop, model)
    loop.latest_metrics.update(metrics)
    loop.stop_reason = loop.stopping.check(metrics) or loop.stop_reason
    loop.window.report([loop.row(loop.step, epoch, metrics)])
    loop.callbacks("on_validation_end", loop, metrics)
    loop.last_time = time.perf_counter()  # validation time is not training throughput
    return metrics


def evaluate(loop: EvaluateFace, model: torch.nn.Module) -> dict[str, float]:
    """The validation metrics of `model`, reduced over ranks."""
    model.eval()
    total, count, done = None, 0, 0
    limit = loop.cfg.fast_dev_run or None
    rounds = None if loop.strategy.replicated else loop.val_input.most_batches(
        loop.world_size, loop.plan.micro_batch_size, limit)
    batches = loop.val_input.batches(loop.rank, loop.world_size, loop.plan.micro_batch_size, limit)
    batch = None
    while True:
        with loop.in_user_code():
            last, batch = batch, next(batches, None)
            if batch is None and (rounds is None or done >= rounds or last is None):
                break
            counted = batch is not None
            batch = to_device(batch, loop.device) if counted else last
            with loop.autocast():
                out = loop.task.val_step(model, batch)
        done += 1
        loop.progress += 1
        if not counted:
            continue
        n = batch_size_of(batch)
        values = loop.outputs.stack(out, "val") * n
        total = values if total is None else total + values
        count += n
    model.train()
    with loop.in_phase("collective"):
        sums = all_reduce_sum(torch.cat([total, torch.tensor([count], dtype=total.dtype, device=total.device)]))
    means = (sums[:-1] / sums[-1]).tolist()
    return {f"val_{k}": v for k, v in zip(loop.outputs.keys["val"], means)}
