"""The step and epoch loop of one rank: plain torch, no Ray.

One code path for 1 or N workers. An optimizer step consumes one global batch:
this rank's share of it in `accumulation` micro-batches, gradients synchronised
by DDP on the last micro-batch only. Each micro-batch loss is divided by the
number of micro-batches and DDP averages over ranks, so the gradient is the
mean over the whole global batch whatever the worker count.

Per-step metrics stay on the device until a flush (every log_every_n_steps,
before validation, at the end): one all-reduce then covers a whole window of
steps, and `report` receives one row per step.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from .config import TrainerConfig
from .data import BatchPlan, batch_size_of, fetch, to_device, val_shard
from .dist import all_reduce_sum
from .errors import ConfigError, TaskError
from .task import Task

Report = Callable[[list[dict[str, Any]]], None]


class Loop:
    def __init__(self, task: Task, cfg: TrainerConfig, *, rank: int, world_size: int,
                 device: torch.device, report: Report):
        self.task, self.cfg = task, cfg
        self.rank, self.world_size, self.device = rank, world_size, device
        self.report = report if rank == 0 else (lambda rows: None)

        # The same seed on every rank and at every world size: identical initial weights.
        torch.manual_seed(cfg.seed)
        self.module = task.build_model().to(device)
        self.model = (
            DistributedDataParallel(self.module, device_ids=[device.index] if device.type == "cuda" else None)
            if world_size > 1 else self.module
        )
        self.optimizer = task.build_optimizer(self.module)

        self.train_data = task.train_dataset()
        self.val_data = task.val_dataset()
        micro = cfg.micro_batch_size or cfg.global_batch_size // world_size
        self.plan = BatchPlan(len(self.train_data), cfg.global_batch_size, micro, world_size, cfg.seed)
        if self.val_data is not None and len(self.val_data) < world_size:
            raise ConfigError(
                f"the validation dataset has {len(self.val_data)} samples, fewer than the "
                f"{world_size} workers; give it at least one sample per worker"
            )
        by_epochs = cfg.max_epochs * self.plan.steps_per_epoch if cfg.max_epochs else None
        self.total_steps = min(s for s in (by_epochs, cfg.max_steps) if s is not None)
        self.scheduler = task.build_scheduler(self.optimizer, self.total_steps)

        # Dropout and friends draw from a per-rank stream.
        torch.manual_seed(cfg.seed + 1 + rank)
        self.step = 0  # optimizer steps completed
        self._window: list[tuple[int, int, float, float, float, torch.Tensor]] = []
        self._train_keys: list[str] | None = None
        self._val_keys: list[str] | None = None

    # ------------------------------------------------------------------ loop

    def fit(self) -> dict[str, torch.Tensor] | None:
        """Train to the end; return the final weights (CPU) on rank 0."""
        self.model.train()
        spe = self.plan.steps_per_epoch
        self._last_time = time.perf_counter()
        while self.step < self.total_steps:
            epoch, in_epoch = divmod(self.step, spe)
            self.train_step(epoch, in_epoch)
            epoch_end = in_epoch + 1 == spe or self.step == self.total_steps
            every = self.cfg.val_every_n_steps
            if epoch_end or (every and self.step % every == 0):
                self.validate(epoch)
            elif self.step % self.cfg.log_every_n_steps == 0:
                self.flush()
        self.flush()
        if self.rank == 0:
            return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}
        return None

    def train_step(self, epoch: int, in_epoch: int) -> None:
        micro_batches = self.plan.micro_batches(epoch, in_epoch, self.rank)
        last = len(micro_batches) - 1
        total = None
        for i, index in enumerate(micro_batches):
            batch = to_device(fetch(self.train_data, index), self.device)
            sync = i == last or self.model is self.module
            with contextlib.nullcontext() if sync else self.model.no_sync():
                out = self.task.train_step(self.model, batch)
                loss = self._loss_of(out)
                (loss / len(micro_batches)).backward()
            values = self._stack(out, "train")
            total = values if total is None else total + values
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

        now = time.perf_counter()
        rate = self.cfg.global_batch_size / max(now - self._last_time, 1e-9)
        self._last_time = now
        lr = float(self.optimizer.param_groups[0]["lr"])
        self._window.append((self.step, epoch, time.time(), lr, rate, total / len(micro_batches)))

    @torch.no_grad()
    def validate(self, epoch: int) -> dict[str, float] | None:
        self.flush()
        if self.val_data is None:
            return None
        self.module.eval()
        total, count = None, 0
        # The unwrapped module: DDP's forward would add collectives, and shards are uneven.
        for index in val_shard(len(self.val_data), self.rank, self.world_size).split(self.plan.micro_batch_size):
            batch = to_device(fetch(self.val_data, index), self.device)
            n = batch_size_of(batch)
            values = self._stack(self.task.val_step(self.module, batch), "val") * n
            total = values if total is None else total + values
            count += n
        self.module.train()
        sums = all_reduce_sum(torch.cat([total, torch.tensor([count], dtype=total.dtype, device=total.device)]))
        means = (sums[:-1] / sums[-1]).tolist()
        metrics = {f"val_{k}": v for k, v in zip(self._val_keys, means)}
        self.report([self._row(self.step, epoch, metrics)])
        self._last_time = time.perf_counter()  # validation time is not training throughput
        return metrics

    def flush(self) -> None:
        """Reduce the buffered steps' metrics over ranks (one collective) and report them."""
        if not self._window:
            return
        window, self._window = self._window, []
        means = (all_reduce_sum(torch.stack([w[-1] for w in window])) / self.world_size).tolist()
        rows = []
        for (step, epoch, when, lr, rate, _), values in zip(window, means):
            metrics = dict(zip(self._train_keys, values))
            metrics.update(lr=lr, samples_per_s=rate)
            rows.append(self._row(step, epoch, metrics, when))
        self.report(rows)

    # ------------------------------------------------------------------ helpers

    def _row(self, step: int, epoch: int, metrics: dict[str, float], when: float | None = None) -> dict[str, Any]:
        return {"step": step, "epoch": epoch, "world_size": self.world_size,
                "time": when or time.time(), **metrics}

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
