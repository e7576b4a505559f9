"""The step and epoch loop of one rank: plain torch, no Ray.

One code path for 1 or N workers. An optimizer step consumes one global batch:
this rank's share of it in `accumulation` micro-batches, gradients synchronised
by DDP on the last micro-batch only. Each micro-batch loss is weighted by its
share of the global batch (plan.loss_divisor: the number of micro-batches when
the split is even) and DDP averages over ranks, so the gradient is the mean over
the whole global batch whatever the worker count (under the per_worker batch
policy the global batch is a fixed per-worker batch times the world size, and the
optimizer steps with the LR scaled by world size / num_workers). Everything that
happens once per optimizer step (unscaling, clipping, the optimizer, the
scheduler, EMA) happens after the last micro-batch, never inside one.

Per-step metrics stay on the device until a flush (every log_every_n_steps,
before validation, at the end): one all-reduce then covers a whole window of
steps, and `report` receives one row per step.

Fault tolerance rests on three properties kept here. The random streams of a step
are a function of (seed, rank, step), so any process can take over a rank at a
step boundary. `self.step` counts optimizer steps whose update is fully applied,
and what a step interrupted half-way changed (gradients, BatchNorm buffers) is
undone by `abandon_step`, so a survivor's state is the state after `self.step`.
And the work after a step (validation, logging, checkpoint) is flagged pending
until done, so a step interrupted there is finished, not skipped, on resume.

An elastic resize pauses every rank at the same step boundary: a rank asked to
pause (`request_pause`, from the driver) says so in the next metrics all-reduce,
and when that reduction is collected, at the same step on every rank, all of them
see it and stop (`paused`), with nothing half-done, to be regrouped.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import threading
import time
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from .callbacks import Callbacks
from .checkpoint import AsyncWriter, Checkpoints, Committed, to_cpu
from .config import ChaosFault, CheckpointConfig, DataConfig, TrainerConfig
from .data import BatchPlan, batch_size_of, to_device
from .dist import all_reduce_sum
from .errors import ConfigError, TaskError
from .input import ValInput, build_train_input, dataset_size
from .schedule import build_lr_schedule
from .syncbn import convert_sync_batchnorm
from .task import Task

Report = Callable[[list[dict[str, Any]]], None]

# Dense bf16/fp16 peak FLOP/s of common GPUs, for MFU when the config gives none.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12,
              "A10": 125e12, "V100": 125e12}


class Loop:
    def __init__(self, task: Task, cfg: TrainerConfig, *, rank: int, world_size: int,
                 device: torch.device, report: Report, callbacks: Callbacks | None = None,
                 checkpoints: Checkpoints | None = None, checkpoint_cfg: CheckpointConfig | None = None,
                 notify: Callable[[dict[str, Any]], None] | None = None,
                 chaos: list[ChaosFault] | None = None, chaos_claim: Callable[[int, int], bool] | None = None,
                 state: dict[str, Any] | None = None, max_world_size: int | None = None,
                 base_world_size: int | None = None, data: DataConfig | None = None):
        self.task, self.cfg = task, cfg
        self.rank, self.world_size, self.device = rank, world_size, device
        # scaling.num_workers: the world size global_batch_size and the LR are given for
        # (what the per_worker batch policy scales from).
        self.base_world_size = base_world_size or world_size
        self._report = report
        self.report = report if rank == 0 else _drop
        self.notify = notify or (lambda event: None)  # lifecycle events for the driver's log
        self.callbacks = callbacks or Callbacks([])
        self.checkpoint_cfg = checkpoint_cfg or CheckpointConfig()
        self.checkpoints = checkpoints if rank == 0 else None  # only rank 0 writes
        self._writer: AsyncWriter | None = None
        self._write_error: BaseException | None = None

        most = max(world_size, max_world_size or 0)  # what an elastic run may grow to
        # The same seed on every rank and at every world size: identical initial weights.
        torch.manual_seed(cfg.seed)
        module = task.build_model()
        # Decided once for the whole run: every rank must run the same collectives, and
        # an elastic run may grow past one worker later.
        if cfg.sync_batchnorm and most > 1:
            module = convert_sync_batchnorm(module, device)
        self.module = module.to(device)
        self.optimizer = task.build_optimizer(self.module)
        # Every rank applies the same averaged gradients, so every rank's EMA is the same
        # without any communication.
        self.ema = (
            AveragedModel(self.module, multi_avg_fn=get_ema_multi_avg_fn(cfg.ema_decay), use_buffers=True)
            if cfg.ema_decay else None
        )
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
        self.scaler = torch.amp.GradScaler(device.type) if cfg.precision == "fp16" else None

        self.train_data = task.train_dataset()
        self.val_data = task.val_dataset()
        self.plan = self._plan()
        self._plan(most)  # the largest global batch (per_worker) must fit too: fail now, not at a grow
        if self.val_data is not None and len(self.val_data) < most:
            raise ConfigError(
                f"the validation dataset has {len(self.val_data)} samples, fewer than the "
                f"{most} workers (scaling.max_workers); give it at least one sample per worker"
            )
        if cfg.early_stopping and self.val_data is None:
            raise ConfigError("trainer.early_stopping needs a validation dataset; the task has none")
        # How micro-batches are read (in this thread, loader processes, a stream): input.py.
        data = data or DataConfig()
        self.train_input = build_train_input(self.train_data, data, max_epochs=cfg.max_epochs, rank=rank,
                                             plan=self.plan, device=device)
        self.val_input = ValInput(self.val_data, data, device) if self.val_data is not None else None
        # Training stops at max_steps optimizer steps or at the end of epoch max_epochs.
        self.max_steps = cfg.fast_dev_run or cfg.max_steps
        self.max_epochs = None if cfg.fast_dev_run else cfg.max_epochs
        # The LR schedule's length (and the progress bar's): exact with a fixed global batch;
        # under per_worker, the steps at base_world_size workers (a resize changes how many
        # steps an epoch takes, not the schedule).
        by_epochs = self.max_epochs * self._plan(self.base_world_size).steps_per_epoch if self.max_epochs else None
        self.total_steps = min(s for s in (by_epochs, self.max_steps) if s is not None)
        self.scheduler = task.build_scheduler(self.optimizer, self.total_steps)
        if cfg.lr_schedule is not None:
            if self.scheduler is not None:
                raise ConfigError(
                    f"{type(task).__name__}.build_scheduler returns a scheduler and "
                    "trainer.lr_schedule is set too; keep one of them"
                )
            self.scheduler = build_lr_schedule(self.optimizer, self.total_steps, cfg.lr_schedule)
        self.flops_per_sample = getattr(task, "flops_per_sample", None)
        self.tokens_per_sample = getattr(task, "tokens_per_sample", None)
        self.peak_flops = cfg.peak_flops_per_worker or _known_peak(device)

        self.step = 0  # optimizer steps completed
        self.epoch = 0
        self.position = 0  # samples of this epoch's order consumed: the data position
        self.progress = 0  # micro-batches and validation batches done: the driver's hang check
        self.phase = "framework"  # or "user": in the task's code (or the data), not in ours
        self._after_pending = False  # the work after self.step (validation, ...) is not done
        self._buffers_at_step_start: list[torch.Tensor] = []
        self.chaos = list(chaos or [])
        # claim(fault index, step) is True once per run: after a recovery, the step that
        # fired a fault may run again, in a new process, and must not fire it again.
        claimed: set[tuple[int, int]] = set()
        self._chaos_claim = chaos_claim or (lambda i, step: (i, step) not in claimed and not claimed.add((i, step)))
        self._chaos_now: list[tuple[int, ChaosFault, int]] = []
        self._chaos_timers: list[threading.Timer] = []  # faults at a random moment of a step
        self._step_seconds = 0.0  # the last step's duration: where a random moment falls
        self._started = False
        if state is not None:
            self.load_state_dict(state)
        # Last: wrapping broadcasts rank 0's weights to every rank, so they must be final.
        self.model = self._wrap()
        self._last_time = time.perf_counter()
        self.skipped_steps = 0
        self.stop_reason: str | None = None
        self._best: float | None = None
        self._bad_validations = 0
        # (the row's host-side fields, the step's metrics still on the device)
        self._window: list[tuple[dict[str, Any], torch.Tensor]] = []
        self._pending: list[tuple[Any, torch.Tensor, list]] = []  # windows being all-reduced
        self._train_keys: list[str] | None = None
        self._val_keys: list[str] | None = None
        self.latest_metrics: dict[str, float] = {}  # what keep_best ranks checkpoints by
        self._saved_step = -1
        self.pause_requested = False  # set by the driver's thread: pause at a common step
        self._pause_agreed = False  # some rank asked, and every rank knows it at this step
        self.paused = False

    # ------------------------------------------------------------------ loop

    def fit(self) -> dict[str, torch.Tensor] | None:
        """Train to the end; return the final weights (EMA weights when on), on CPU, on rank 0.
        Called again after a recovery, it continues from the state it holds."""
        if not self._started:
            self._started = True
            self.callbacks("on_run_start", self)
        self.model.train()
        self._last_time = time.perf_counter()  # set-up time is not training throughput
        while True:
            if self._after_pending:
                self._after_step()
            if self._done() or self.stop_reason is not None:
                break
            if self._pause_agreed:
                self.paused = True
                break
            if not self.plan.fits(self.position):
                # Only after a resize under the per_worker policy: the larger global batch
                # does not fit in what is left of the epoch, so the epoch ends here.
                self.validate(self.epoch)
                self.callbacks("on_epoch_end", self)
                self.epoch, self.position = self.epoch + 1, 0
                continue
            if self.position == 0:
                self.callbacks("on_epoch_start", self)
            self.train_step()
        self.flush(wait=True)
        if self.paused:  # for a resize: regroup(), then fit() again
            return None
        self.close_inputs()
        if not self.cfg.fast_dev_run:
            self.save_checkpoint()  # the end of the run (a no-op if this step is saved)
            if self._writer is not None:
                self._writer.wait()
            self._raise_write_error()
        self.stop_reason = self.stop_reason or ("fast_dev_run" if self.cfg.fast_dev_run else "completed")
        self.callbacks("on_run_end", self)
        if self.rank == 0:
            final = self.ema.module if self.ema is not None else self.module
            return {k: v.detach().cpu().clone() for k, v in final.state_dict().items()}
        return None

    def _done(self) -> bool:
        return ((self.max_steps is not None and self.step >= self.max_steps)
                or (self.max_epochs is not None and self.epoch >= self.max_epochs))

    def _after_step(self) -> None:
        """Validation, logging, epoch end and checkpoint after step `self.step`. The epoch
        moves on last: until then the work is pending, and redone the same way on resume."""
        epoch_end = not self.plan.fits(self.position)
        closes = epoch_end or (self.max_steps is not None and self.step >= self.max_steps)
        every = self.cfg.val_every_n_steps
        if closes or (every and self.step % every == 0):
            self.validate(self.epoch)
        elif self.step % self.cfg.log_every_n_steps == 0:
            self.flush()
        if closes:
            self.callbacks("on_epoch_end", self)
        every = self.checkpoint_cfg.every_n_steps
        if every and self.step % every == 0 and not self.cfg.fast_dev_run:
            self.save_checkpoint()
        if epoch_end:
            self.epoch, self.position = self.epoch + 1, 0
        self._after_pending = False

    def train_step(self) -> None:
        step = self.step + 1
        started = time.perf_counter()
        _seed_all(self.cfg.seed, self.rank, step, self.device)
        self._buffers_at_step_start = [b.detach().clone() for b in self.module.buffers()]
        self._arm_chaos(step)
        sizes = self.plan.micro_batch_sizes(self.rank)
        batches = self.train_input.batches(self.epoch, self.position, self.step)
        last = len(sizes) - 1
        lr = float(self.optimizer.param_groups[0]["lr"]) * self.lr_scale  # the LR this step uses
        total = None  # the step's metrics, weighted like the loss (this rank's share)
        for i, size in enumerate(sizes):
            divisor = self.plan.loss_divisor(size)
            sync = i == last or self.model is self.module
            with contextlib.nullcontext() if sync else self.model.no_sync():
                with self._in_user_code():
                    batch = to_device(next(batches), self.device)
                    with self._autocast():
                        out = self.task.train_step(self.model, batch)
                loss = self._loss_of(out) / divisor
                # DDP's gradient all-reduce completes inside the last backward.
                with self._phase("collective") if sync and self.model is not self.module else _NO_PHASE:
                    (self.scaler.scale(loss) if self.scaler else loss).backward()
            self.progress += 1
            values = self._stack(out, "train") / divisor
            total = values if total is None else total + values

        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not scaled ones
        if self.cfg.grad_clip_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.grad_clip_norm)
            total = torch.cat([total, norm.detach().float().reshape(1).to(total.device)])
        applied = True
        with self._scaled_lr():
            if self.scaler is not None:
                scale = self.scaler.get_scale()
                self.scaler.step(self.optimizer)  # skips the step if any gradient is inf/nan
                self.scaler.update()
                applied = self.scaler.get_scale() >= scale  # the scale only drops on overflow
                self.skipped_steps += not applied
            else:
                self.optimizer.step()
        if applied:
            if self.scheduler is not None:
                self.scheduler.step()
            if self.ema is not None:
                self.ema.update_parameters(self.module)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.position += self.plan.global_batch_size
        self._after_pending = True
        self._step_seconds = time.perf_counter() - started

        now = time.perf_counter()
        rate = self.plan.global_batch_size / max(now - self._last_time, 1e-9)
        self._last_time = now
        info = self._row(self.step, self.epoch, {"lr": lr, "samples_per_s": rate})
        if self.tokens_per_sample:
            info["tokens_per_s"] = rate * self.tokens_per_sample
        if self.flops_per_sample:
            info["model_flops_per_s"] = rate * self.flops_per_sample
            if self.peak_flops:
                info["mfu"] = info["model_flops_per_s"] / (self.peak_flops * self.world_size)
        if self.scaler is not None:
            info["skipped_steps"] = self.skipped_steps
        self._window.append((info, total))
        self._act_chaos()

    @torch.no_grad()
    def validate(self, epoch: int) -> dict[str, float] | None:
        self.flush(wait=True)
        if self.val_data is None:
            return None
        # EMA weights when on; never the DDP wrapper: its forward adds collectives, and
        # validation shards may differ in length by one.
        model = self.ema.module if self.ema is not None else self.module
        model.eval()
        total, count = None, 0
        batches = self.val_input.batches(self.rank, self.world_size, self.plan.micro_batch_size,
                                         self.cfg.fast_dev_run or None)
        while True:
            with self._in_user_code():
                batch = next(batches, None)
                if batch is None:
                    break
                batch = to_device(batch, self.device)
                with self._autocast():
                    out = self.task.val_step(model, batch)
            n = batch_size_of(batch)
            values = self._stack(out, "val") * n
            self.progress += 1
            total = values if total is None else total + values
            count += n
        model.train()
        with self._phase("collective"):
            sums = all_reduce_sum(torch.cat([total, torch.tensor([count], dtype=total.dtype, device=total.device)]))
        means = (sums[:-1] / sums[-1]).tolist()
        metrics = {f"val_{k}": v for k, v in zip(self._val_keys, means)}
        self.latest_metrics.update(metrics)
        self._check_early_stopping(metrics)
        self.report([self._row(self.step, epoch, metrics)])
        self.callbacks("on_validation_end", self, metrics)
        self._last_time = time.perf_counter()  # validation time is not training throughput
        return metrics

    def flush(self, wait: bool = False) -> None:
        """Reduce the buffered steps' metrics over ranks and report them, one row per step.

        The all-reduce of a window is started here and collected at the next flush, so
        training never waits for it (rows reach the driver one window later); `wait`
        collects everything now (before validation and at the end)."""
        if self._window:
            window, self._window = self._window, []
            values = torch.stack([v for _, v in window])
            # One more column: whether this rank was asked to pause (see the module doc).
            flag = torch.full((len(window), 1), float(self.pause_requested), device=values.device)
            values = torch.cat([values, flag], dim=1)
            self._pending.append((all_reduce_sum(values, async_op=True), values, window))
        while self._pending and (wait or len(self._pending) > 1):
            work, values, window = self._pending.pop(0)
            if work is not None:
                with self._phase("collective"):
                    work.wait()
            self._pause_agreed |= bool(values[-1, -1] > 0)
            means = (values[:, :-1] / self.world_size).tolist()
            keys = self._train_keys + (["grad_norm"] if self.cfg.grad_clip_norm is not None else [])
            rows = [{**info, **dict(zip(keys, v))} for (info, _), v in zip(window, means)]
            self.latest_metrics.update({k: v for k, v in rows[-1].items() if isinstance(v, float)})
            self.report(rows)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The replicated training state (the same on every rank after a step)."""
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "input": self.train_input.state_dict(self.step),  # a stream's position (None: the loop's position)
            "loop": {"step": self.step, "epoch": self.epoch, "position": self.position,
                     "skipped_steps": self.skipped_steps, "best": self._best,
                     "bad_validations": self._bad_validations, "after_pending": self._after_pending,
                     "stop_reason": self.stop_reason,
                     "global_batch_size": self.cfg.global_batch_size, "world_size": self.world_size},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` was taken: the next step is state's step + 1, at
        the same global sample index, whatever the world size now is."""
        saved = state["loop"]
        if saved["global_batch_size"] != self.cfg.global_batch_size:
            raise ConfigError(
                f"the checkpoint was trained with trainer.global_batch_size="
                f"{saved['global_batch_size']}, this run has {self.cfg.global_batch_size}; "
                "resuming needs the same global batch (the steps, the schedule and the LR were set for it)"
            )
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for name in ("scheduler", "scaler", "ema"):
            target = getattr(self, name)
            if (target is None) != (state[name] is None):
                raise ConfigError(f"the checkpoint {'has' if state[name] is not None else 'lacks'} "
                                  f"{name} state but this run {'does not use' if target is None else 'uses'} "
                                  "one; resume with the config the checkpoint was trained with")
            if target is not None:
                target.load_state_dict(state[name])
        self.step, self.skipped_steps = saved["step"], saved["skipped_steps"]
        if "position" in saved:
            self.epoch, self.position = saved["epoch"], saved["position"]
        else:  # written before the position was saved: always a fixed global batch then
            self.epoch, in_epoch = divmod(self.step, self._plan(self.base_world_size).steps_per_epoch)
            self.position = in_epoch * self.cfg.global_batch_size
        self._best, self._bad_validations = saved["best"], saved["bad_validations"]
        self._after_pending, self.stop_reason = saved["after_pending"], saved["stop_reason"]
        self._saved_step = self.step
        self.train_input.load_state_dict(state.get("input"), self.step)
        # The random streams need no restoring: each step seeds them from (seed, rank, step).

    def save_checkpoint(self) -> None:
        """Rank 0 writes the replicated state (no collective: other ranks go on).
        Asynchronously, the step waits only for the copy to CPU."""
        if self.step == self._saved_step:
            return
        self._saved_step = self.step
        self._raise_write_error()
        if self.checkpoints is None:
            return
        state = self.state_dict()
        metrics = dict(self.latest_metrics)
        if self.checkpoint_cfg.async_save:
            if self._writer is None:
                self._writer = AsyncWriter(self.checkpoints, self._committed, self._failed_write)
            self._writer.submit(self.step, to_cpu(state), metrics)
        else:
            self._committed(self.checkpoints.write(self.step, state, metrics))

    def _committed(self, ckpt: Committed) -> None:
        path = self.checkpoints.storage.path(f"{self.checkpoints.prefix}/{ckpt.name}")
        self.notify({"event": "checkpoint_committed", "step": ckpt.step, "path": path,
                     "bytes": ckpt.manifest["files"]["state.pt"]["size"]})
        self.callbacks("on_checkpoint", self, path)

    def _failed_write(self, exc: BaseException) -> None:
        self._write_error = exc

    def _raise_write_error(self) -> None:
        if self._write_error is not None:
            exc, self._write_error = self._write_error, None
            raise RuntimeError(f"writing a checkpoint failed: {exc}") from exc

    # ------------------------------------------------------------------ recovery

    def abandon_step(self) -> None:
        """Undo what a step interrupted half-way changed, so the state is that after
        `self.step`: gradients, BatchNorm running statistics, metrics not yet reduced."""
        self.optimizer.zero_grad(set_to_none=True)
        if self._buffers_at_step_start:
            with torch.no_grad():
                for buffer, saved in zip(self.module.buffers(), self._buffers_at_step_start):
                    buffer.copy_(saved)
        if self.scaler is not None:  # an unscale_ without its step would be remembered
            self.scaler = _fresh_scaler(self.scaler)
        self._window, self._pending, self._chaos_now = [], [], []
        for timer in self._chaos_timers:
            timer.cancel()
        self._chaos_timers = []
        self.train_input.reset()  # it had prepared the rest of the interrupted step
        self.phase = "framework"
        self.module.train()

    def regroup(self, rank: int, world_size: int, report_to: Report | None = None) -> None:
        """Continue in a re-formed process group (the default group, already initialised)."""
        self.rank, self.world_size = rank, world_size
        self.report = (report_to or self._report) if rank == 0 else _drop
        self.plan = self._plan()
        self.train_input.regroup(self.plan, rank, self.step)
        self.model = self._wrap()
        self.pause_requested = self._pause_agreed = self.paused = False

    def close_inputs(self) -> None:
        """Stop the loader processes (they also die with this process)."""
        self.train_input.close()
        if self.val_input is not None:
            self.val_input.close()

    # ------------------------------------------------------------------ helpers

    def _wrap(self) -> torch.nn.Module:
        if self.world_size == 1:
            return self.module
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(self.module, device_ids=device_ids)
        if hasattr(ddp.reducer, "_rebuild_buckets"):
            ddp.reducer = _FixedBuckets(ddp.reducer)
        return ddp

    def _plan(self, world_size: int | None = None) -> BatchPlan:
        world = world_size or self.world_size
        batch = self.cfg.global_batch_size
        if self.cfg.batch_policy == "per_worker":
            batch = batch // self.base_world_size * world
        micro = self.cfg.micro_batch_size or -(-batch // world)
        return BatchPlan(dataset_size(self.train_data), batch, micro, world, self.cfg.seed,
                         overfit_batches=self.cfg.overfit_batches)

    @property
    def lr_scale(self) -> float:
        """What the per_worker policy multiplies every LR by: the linear scaling rule."""
        return self.world_size / self.base_world_size if self.cfg.batch_policy == "per_worker" else 1.0

    @contextlib.contextmanager
    def _scaled_lr(self):
        """The optimizer steps with every param group's LR times lr_scale; the scheduler
        and the saved state keep the unscaled LRs."""
        scale = self.lr_scale
        if scale == 1.0:  # nothing touched: bit-identical to a fixed run
            yield
            return
        saved = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * scale
        try:
            yield
        finally:
            for group, lr in zip(self.optimizer.param_groups, saved):
                group["lr"] = lr

    @contextlib.contextmanager
    def _phase(self, phase: str):
        """Where this rank is, for the driver's hang check (see Worker.status)."""
        outer, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = outer

    def _in_user_code(self):
        return self._phase("user")

    def _arm_chaos(self, step: int) -> None:
        """Decide, on every rank alike, which faults act in or after `step`, and on which
        rank; start the timers of those that act at a random moment of it."""
        for i, fault in enumerate(self.chaos):
            rng = random.Random(hash((self.cfg.seed, 0xC4A05, i, step)))  # ints: hash() is stable
            due = fault.step == step if fault.step is not None else rng.random() < fault.probability
            if not due:
                continue
            rank = fault.rank if fault.rank is not None else rng.randrange(self.world_size)
            if fault.at == "end":
                self._chaos_now.append((i, fault, rank))
            elif rank == self.rank:
                timer = threading.Timer(rng.uniform(0.0, self._step_seconds), self._fire_chaos, (i, fault, step))
                timer.daemon = True
                timer.start()
                self._chaos_timers.append(timer)

    def _act_chaos(self) -> None:
        now, self._chaos_now = self._chaos_now, []
        for i, fault, rank in now:
            if rank == self.rank:
                with self._in_user_code():
                    self._fire_chaos(i, fault, self.step)

    def _fire_chaos(self, i: int, fault: ChaosFault, step: int) -> None:
        if not self._chaos_claim(i, step):
            return
        self.notify({"event": "chaos", "step": step, "action": fault.action, "at": fault.at})
        if fault.action in ("kill", "freeze"):
            os.kill(os.getpid(), signal.SIGKILL if fault.action == "kill" else signal.SIGSTOP)
        elif fault.action == "delay":
            time.sleep(fault.seconds)
        elif fault.action == "hang":
            while True:
                time.sleep(1.0)
        else:
            raise ChaosError(f"chaos: raise after step {step} on rank {self.rank}")

    def _autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _check_early_stopping(self, metrics: dict[str, float]) -> None:
        """Every rank holds the same reduced metrics, so every rank decides the same."""
        es = self.cfg.early_stopping
        if es is None:
            return
        if es.metric not in metrics:
            raise ConfigError(
                f"trainer.early_stopping.metric={es.metric!r} is not a validation metric; "
                f"the task's are {sorted(metrics)}"
            )
        value = metrics[es.metric]
        better = (
            self._best is None
            or (value < self._best - es.min_delta if es.mode == "min" else value > self._best + es.min_delta)
        )
        if better and math.isfinite(value):
            self._best, self._bad_validations = value, 0
        else:
            self._bad_validations += 1
            if self._bad_validations >= es.patience:
                self.stop_reason = (
                    f"early_stopping: {es.metric} did not improve on {self._best:.6g} "
                    f"for {es.patience} validations"
                )

    def _row(self, step: int, epoch: int, metrics: dict[str, float]) -> dict[str, Any]:
        return {"step": step, "epoch": epoch, "world_size": self.world_size, "time": time.time(), **metrics}

    def _loss_of(self, out: Any) -> torch.Tensor:
        loss = out.get("loss") if isinstance(out, dict) else None
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            got = f"a dict with keys {sorted(out)}" if isinstance(out, dict) else type(out).__name__
            raise TaskError(
                f"{type(self.task).__name__}.train_step returned {got}; it must return a dict "
                "with 'loss': a scalar tensor that requires grad"
            )
        return loss

    def _stack(self, out: dict[str, Any], kind: str) -> torch.Tensor:
        """The step's metrics as one float tensor on the device, in a fixed key order."""
        if not isinstance(out, dict):
            raise TaskError(f"{type(self.task).__name__}.{kind}_step must return a dict of metrics")
        attr = f"_{kind}_keys"
        keys = getattr(self, attr)
        if keys is None:
            keys = sorted(out)
            setattr(self, attr, keys)
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


_NO_PHASE = contextlib.nullcontext()


class _FixedBuckets:
    """DDP's reducer, except that it never rebuilds its gradient buckets.

    DDP re-buckets once, after its first iteration, by the order gradients became ready.
    The bucket layout decides how a collective splits the gradients over ranks, and so
    the order in which each element is summed: with 3 or more ranks a fresh DDP (every
    re-form) would sum its first step differently from the undisturbed run, and the
    weights would drift by a few ulps (measured: Gloo, 3 ranks). The layout DDP starts
    with (parameters in reverse order, which backward mostly follows) is kept instead.
    Any other use of the reducer passes through."""

    def __init__(self, reducer: Any):
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


class ChaosError(RuntimeError):
    """Raised in a worker by failure.chaos `raise`."""


def _seed_all(seed: int, rank: int, step: int, device: torch.device) -> None:
    """The random streams of (rank, step): Python, NumPy, torch CPU and this rank's GPU.

    Not torch.manual_seed: where CUDA, XPU or MTIA is not initialised (any CPU worker)
    it queues a lazy seed for each of them with a formatted traceback, on every call:
    about 0.3 ms a step, a third of a small model's step on CPU."""
    value = hash((seed, rank, step)) & 0x7FFF_FFFF_FFFF_FFFF
    random.seed(value)
    torch.default_generator.manual_seed(value)
    if device.type == "cuda":
        torch.cuda.manual_seed(value)  # the current device: this rank's (see dist.choose_device)
    try:
        import numpy as np

        np.random.seed(value & 0xFFFF_FFFF)
    except ImportError:
        pass


def _fresh_scaler(scaler: torch.amp.GradScaler) -> torch.amp.GradScaler:
    fresh = torch.amp.GradScaler(scaler._device)
    fresh.load_state_dict(scaler.state_dict())
    return fresh


def _drop(rows: list[dict[str, Any]]) -> None:
    """Where ranks other than 0 report: the driver hears from rank 0 only."""


def _known_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_FLOPS.items() if key in name), None)
