"""The parts of an optimizer step that Loop.train_step runs in turn: this rank's micro-batches
(forward and backward, the gradients synchronised in the last), whether the update may be
applied (trainer.nonfinite), the update (the optimizer, then the scheduler and EMA), and the
step's row of metrics.

Functions of the loop rather than methods, so that the step reads as their sequence while
the loop stays one object. The step is the hot path: they read and update the loop's
attributes as the step did, one lookup deep, and build nothing per step that it did not.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import torch

from ...data import to_device
from .nonfinite import what_is_not_finite
from .rollback import agreed_loss, roll_back

if TYPE_CHECKING:
    from .face import StepFace
    from ..state.carrier import Carrier

_NO_PHASE = contextlib.nullcontext()


def accumulate(loop: StepFace, scaler: torch.amp.GradScaler | None, carrier: Carrier | None) -> torch.Tensor:
    """Run this rank's micro-batches of the step and return their metrics, weighted like the
    loss (this rank's share of the global batch). Where the strategy has a carrier, the
    metrics, the pause flag and the save ask ride on the gradient all-reduce."""
    started = time.perf_counter()  # this rank's compute time runs from here (state/carrier.py)
    sizes = loop.plan.micro_batch_sizes(loop.rank)
    batches = loop.train_input.batches(loop.epoch, loop.position, loop.step)
    last = len(sizes) - 1
    total = None
    for i, size in enumerate(sizes):
        divisor = loop.plan.loss_divisor(size)
        sync = i == last
        with contextlib.nullcontext() if sync else loop.strategy.no_sync(loop.wrapped):
            with loop.in_user_code():
                batch = to_device(next(batches), loop.device)
                with loop.autocast():
                    out = loop.task.train_step(loop.model, batch)
            loss, values = loop.outputs.loss(out), loop.outputs.stack(out, "train")
            if divisor != 1:  # one micro-batch a step: nothing to divide (x / 1 is x)
                loss, values = loss / divisor, values / divisor
            total = values if total is None else total + values
            if sync and carrier is not None:
                carrier.send(total, loop.pause_requested, loop.save_wanted(), loop.world_size,
                             rank=loop.rank, started=started)
            # The gradient all-reduce (DDP) or reduce-scatter (FSDP) completes inside
            # the last backward.
            with loop.in_phase("collective") if sync and loop.world_size > 1 else _NO_PHASE:
                (scaler.scale(loss) if scaler else loss).backward()
        loop.progress += 1
    return total


def finite(loop: StepFace, step: int, total: torch.Tensor, carried: list[float] | None,
           norm: torch.Tensor | None, scaler: torch.amp.GradScaler | None) -> bool | None:
    """Whether step `step`'s update may be applied (trainer.nonfinite, see nonfinite.py); if
    not, the step is dropped: its gradients and BatchNorm statistics go, the data moves on.
    None: the run went back to an earlier step (rollback, see rollback.py)."""
    loss_col, waiting = loop.outputs.keys["train"].index("loss"), lambda: loop.in_phase("collective")
    what = what_is_not_finite(step, loss_col, total, carried, norm, rank=loop.rank,
                              world_size=loop.world_size, grads=scaler is None, module=loop.module,
                              waiting=waiting)
    if what is None and loop.spikes.factor is not None:
        what = loop.spikes.judge(step, agreed_loss(loss_col, total, carried, loop.world_size, waiting))
    if what is None:
        loop.nonfinite.finite()
        return True
    if loop.rollbacks is not None:
        roll_back(loop, step, what)  # or the run stops here
        return None
    loop.nonfinite.drop(step, what, loop.rank)  # or the run stops here
    loop.train.abandon_step()
    return False


def update(loop: StepFace, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
           lr_scale: float) -> None:
    """Step the optimizer at every LR times `lr_scale`; then, unless fp16's scaler skipped
    the step for gradients that overflowed (counted in skipped_steps), the scheduler and EMA."""
    with scaled_lr(optimizer, lr_scale):
        if scaler is not None:
            scale = scaler.get_scale()
            scaler.step(optimizer)  # skips the step if any gradient is inf/nan
            scaler.update()
            applied = scaler.get_scale() >= scale  # the scale only drops on overflow
            loop.skipped_steps += not applied
        else:
            optimizer.step()
            applied = True
    if applied:
        scheduler = loop.scheduler
        if scheduler is not None:
            scheduler.step()
        loop.train.update_ema()


@contextlib.contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, scale: float):
    """The optimizer steps with every param group's LR times `scale`; the scheduler and the
    saved state keep the unscaled LRs."""
    if scale == 1.0:  # nothing touched: bit-identical to a fixed run
        yield
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * scale
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved):
            group["lr"] = lr


def step_row(loop: StepFace, lr: float, scaler: torch.amp.GradScaler | None) -> dict[str, Any]:
    """The step's row: the LR it used, samples/s since the last step's row (or since training
    resumed), and where the task gives what they need, tokens/s, model FLOP/s and MFU; the
    counts of dropped steps where steps can be dropped."""
    now = time.perf_counter()
    rate = loop.plan.global_batch_size / max(now - loop.last_time, 1e-9)
    loop.last_time = now
    info = loop.row(loop.step, loop.epoch, {"lr": lr, "samples_per_s": rate})
    if loop.tokens_per_sample:
        info["tokens_per_s"] = rate * loop.tokens_per_sample
    if loop.flops_per_sample:
        info["model_flops_per_s"] = rate * loop.flops_per_sample
        if loop.peak_flops:
            info["mfu"] = info["model_flops_per_s"] / (loop.peak_flops * loop.world_size)
    if scaler is not None:
        info["skipped_steps"] = loop.skipped_steps
    if loop.cfg.nonfinite == "skip":
        info["nonfinite_skips"] = loop.nonfinite.skips
    return info
