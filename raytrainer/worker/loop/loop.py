"""The step and epoch loop of one rank: plain torch, no Ray.

The loop reads the sample order (data.BatchPlan, through input/input.py), runs the step and
validation, and decides what happens after a step. What it holds lives in small units:
the training state (state/state.py: model, optimizer, scheduler, scaler, EMA), the strategy
that divides it over the ranks (state/strategy.py: DDP, or FSDP in state/sharded.py), the metrics
window with the pause agreement (window.py), the checkpoint saver (state/saver.py), early
stopping (stopping.py) and injected faults (chaos.py). What it is built with is derived
once from the config (sizing.py: the world sizes, the BatchPlan at any of them, the run's
length); the parts of the step (step.py), a validation in this process (evaluate.py), and
what a rank starts from and leaves behind (handover.py) are functions of the loop beside it
(each takes it as its Protocol in face.py: what it uses of the loop).

One code path for 1 or N workers. An optimizer step consumes one global batch:
this rank's share of it in `accumulation` micro-batches, gradients synchronised
(by the strategy) on the last micro-batch only. Each micro-batch loss is weighted by its
share of the global batch (plan.loss_divisor: the number of micro-batches when
the split is even) and the strategy averages over ranks, so the gradient is the mean over
the whole global batch whatever the worker count (under the per_worker batch
policy the global batch is a fixed per-worker batch times the world size, and the
optimizer steps with the LR scaled by world size / num_workers). Everything that
happens once per optimizer step (unscaling, clipping, the optimizer, the
scheduler, EMA) happens after the last micro-batch, never inside one.

Fault tolerance rests on three properties kept here. The random streams of a step
are a function of (seed, rank, step), so any process can take over a rank at a
step boundary. `self.step` counts optimizer steps whose update is fully applied,
and what a step interrupted half-way changed (gradients, BatchNorm buffers) is
undone by `abandon_step`, so a survivor's state is the state after `self.step`.
And the work after a step (validation, logging, checkpoint) is flagged pending
until done, so a step interrupted there is finished, not skipped, on resume.

An elastic resize pauses every rank at the same step boundary agreed in the metrics
reduction (window.py: under DDP each step's metrics ride on its gradient all-reduce,
otherwise a window's on one all-reduce of their own); the ranks stop (`paused`), with
nothing half-done, to be regrouped.
"""

from __future__ import annotations

import contextlib
import random
import time
from typing import Any, Callable

import torch

from .chaos import Chaos
from .phase import InPhase
from .settings import LoopSettings, Outlets
from .compiling import compile_report, compiled, graph_count
from ...contract import Reshard, Snapshot
from ...data import BatchPlan
from ..input.input import ValInput, build_train_input, collate_of
from .evaluate import validate_here
from .handover import bind_snapshots, check_resumable, checkpoint_saver, go_back, leave, starting_state, where
from .sizing import Sizing, build_scheduler
from .step import accumulate, finite, step_row, update
from .stopping import EarlyStopping
from ..state.strategy import build_strategy
from ...task import Task
from .validation import AsyncValidation
from .nonfinite import NonFiniteSteps
from .rollback import LossSpikes, rollbacks
from .outputs import StepOutputs
from ..state.state import Prebuilt, train_state
from .window import MetricsWindow, Report

# Dense bf16/fp16 peak FLOP/s of common GPUs, for MFU when the config gives none.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12,
              "A10": 125e12, "V100": 125e12}


class Loop:
    # Called at every step boundary with (step, state_dict) while this rank is the state's
    # only holder, to keep a copy elsewhere (the actor sets it: copies.py).
    keeper: Callable[[int, Callable[[], dict[str, Any]]], None] | None = None

    def __init__(self, task: Task, settings: LoopSettings, outlets: Outlets | None = None, *, rank: int,
                 world_size: int, device: torch.device, state: dict[str, Any] | str | Snapshot | Reshard | None = None,
                 prebuilt: Prebuilt | None = None):
        cfg, outlets = settings.trainer, outlets or Outlets()
        self.task, self.cfg = task, cfg
        self.rank, self.world_size, self.device = rank, world_size, device
        self._report, self.notify, self.callbacks = outlets.report, outlets.notify, outlets.callbacks
        self._share_compiled = outlets.share_compiled
        self.sizing = sizing = Sizing.of(settings, world_size)
        self.max_steps, self.max_epochs = sizing.max_steps, sizing.max_epochs
        self.base_world_size = sizing.base_world_size  # what lr_scale scales from
        self.strategy = build_strategy(cfg, sizing.most_world_size, task)
        self.train = train_state(prebuilt, task, cfg, self.strategy, device, sizing.most_world_size)
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
        self.train_data, self.val_data = task.train_dataset(), task.val_dataset()
        self.plan = sizing.check(self.train_data, self.val_data, world_size)
        # How micro-batches are read (in this thread, loader processes, a stream): input.py.
        collate = collate_of(task, settings.data.collate_fn)
        self.train_input = build_train_input(self.train_data, settings.data, max_epochs=cfg.max_epochs, rank=rank,
                                             plan=self.plan, device=device, collate=collate)
        self.val_input = ValInput(self.val_data, settings.data, device, collate) if self.val_data is not None else None
        self.total_steps = sizing.total_steps(self.train_data)
        self.train.scheduler = build_scheduler(task, self.optimizer, self.total_steps, cfg)
        self.flops_per_sample = getattr(task, "flops_per_sample", None)
        self.tokens_per_sample = getattr(task, "tokens_per_sample", None)
        self.peak_flops = cfg.peak_flops_per_worker or _known_peak(device)

        self.step = 0  # optimizer steps completed
        self.epoch = 0
        self.position = 0  # samples of this epoch's order consumed: the data position
        self.progress = 0  # micro-batches and validation batches done: the driver's hang check
        self.phase = "framework"  # or "user": in the task's code (or the data), not in ours
        self.after_pending = False  # the work after self.step (validation, ...) is not done
        self.skipped_steps = 0
        self.nonfinite = NonFiniteSteps(cfg.nonfinite, cfg.nonfinite_max_skips, self.notify)
        self.spikes = LossSpikes(cfg.spike_factor)  # part of the state: every rank judges alike
        self.stop_reason: str | None = None
        self.stopping = EarlyStopping(cfg.early_stopping)
        self.chaos = Chaos(list(settings.chaos), cfg.seed, self.notify, outlets.chaos_claim)
        self._step_seconds = 0.0  # the last step's duration: where a random moment falls
        self._started = False
        self.window = MetricsWindow(self._report if rank == 0 else _drop, lambda: self.in_phase("collective"))
        self.latest_metrics = self.window.latest  # what keep_best ranks checkpoints by
        self.outputs = StepOutputs(task, device)  # what train_step and val_step return
        self.saver = checkpoint_saver(self, outlets.checkpoints, settings.checkpoint)
        self.validation = AsyncValidation.build(self, cfg, settings.task, sizing.most_world_size,  # None: in this loop
                                                settings.data.collate_fn)
        state = starting_state(state, self.strategy, cfg, self.state_dict)
        if state is not None:
            self.load_state_dict(state)
            # A run resumed from a checkpoint decides anew whether to stop (its max_steps
            # may be larger now); a survivor's state keeps its reason (see regroup).
            self.stop_reason = None
        # Last: the state is final. Every rank loads a state, or none (rank 0's weights then).
        self.wrapped = self.strategy.wrap(self.module, world_size, device, synced=state is not None)
        self.model = compiled(self.wrapped, cfg.compile)  # what the step calls: wrapped, then compiled
        self._compile_unreported = cfg.compile is not None  # the `compiled` event after the first step
        self._graphs_at_join = graph_count() if cfg.compile is not None else 0
        self.snapshots = bind_snapshots(outlets.snapshots, self.strategy, self.train, rank=rank, world_size=world_size)
        self.rollbacks = rollbacks(cfg, settings.snapshot_every_n_steps, self.snapshots, self.train_input, self.step)
        self.last_time = time.perf_counter()
        self._save_asked = False  # rank 0 asked its peers for a checkpoint (every_n_minutes)
        self.pause_requested = False  # set by the driver's thread: pause at a common step
        self._pause_agreed = False  # some rank asked, and every rank knows it at this step
        self.paused = False

    # What the driver learns as the group forms (contract.Formed).
    steps_per_epoch = property(lambda self: self.plan.steps_per_epoch)
    replicated = property(lambda self: self.strategy.replicated)
    min_world_size = property(lambda self: self.sizing.min_world_size)

    # The parts of the training state callbacks and tasks know the loop by.
    module = property(lambda self: self.train.module)
    optimizer = property(lambda self: self.train.optimizer)
    scheduler = property(lambda self: self.train.scheduler)
    scaler = property(lambda self: self.train.scaler)
    nonfinite_skips = property(lambda self: self.nonfinite.skips)  # steps dropped (trainer.nonfinite: skip)
    ema = property(lambda self: self.train.ema)

    # ------------------------------------------------------------------ loop

    def fit(self) -> dict[str, torch.Tensor] | None:
        """Train to the end; return the final weights (EMA weights when on), on CPU, on rank 0.
        Called again after a recovery, it continues from the state it holds."""
        if not self._started:
            self._started = True
            self.callbacks("on_run_start", self)
        self.model.train()
        self.last_time = time.perf_counter()  # set-up time is not training throughput
        if self.rank == 0 and self.window.recent:  # a recovery's new rank 0: the rows the lost one may have held
            self.window.sink([r for r in self.window.recent if r["step"] <= self.step])
        while True:
            if self.after_pending:
                self.after_step()
            if self._done() or self.stop_reason is not None:
                break
            if self._pause_agreed:
                self.paused = True
                break
            if self.snapshots is not None and self.snapshots.due(self.step):
                if (event := self.snapshots.take(self.step, self.state_dict())) and self.rank == 0:
                    self.notify(event)
            if self.rollbacks is not None and self.rollbacks.kept.due(self.step):
                self.rollbacks.kept.take(self.step, self.train.state_dict, self.world_size)
            if self.keeper is not None:
                self.keeper(self.step, self.state_dict)
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
        if self.validation is not None and not self.paused:
            self.validation.finish()
        self.flush(wait=True)
        return leave(self)

    def _done(self) -> bool:
        return ((self.max_steps is not None and self.step >= self.max_steps)
                or (self.max_epochs is not None and self.epoch >= self.max_epochs))

    def after_step(self) -> None:
        """Validation, logging, epoch end and checkpoint after step `self.step`. The epoch
        moves on last: until then the work is pending, and redone the same way on resume."""
        if self._compile_unreported:
            self._report_compile()
        if self.validation is not None:
            self.validation.after_step()
        epoch_end = not self.plan.fits(self.position)
        closes = epoch_end or (self.max_steps is not None and self.step >= self.max_steps)
        every = self.cfg.val_every_n_steps
        if closes or (every and self.step % every == 0):
            self.validate(self.epoch)
        elif self.step % self.cfg.log_every_n_steps == 0:
            self.flush()
        if closes:
            self.callbacks("on_epoch_end", self)
        every = self.saver.cfg.every_n_steps
        due_by_time, self.window.save_agreed = self.window.save_agreed, False  # every rank agreed on this step
        if (every and self.step % every == 0 or due_by_time) and not self.cfg.fast_dev_run:
            self.save_checkpoint()
            self._save_asked = False
        if epoch_end:
            self.epoch, self.position = self.epoch + 1, 0
        self.after_pending = False

    def _report_compile(self) -> None:
        """The `compiled` event after the first compiled step in this group: every rank's
        graph count and cache hits, gathered to rank 0 (the driver hears rank 0 only)."""
        self._compile_unreported = False
        with self.in_phase("collective"):
            event = compile_report(self.step, self._step_seconds, self.device, self.world_size, self._graphs_at_join)
        if self.rank == 0:
            # Whether built here or taken from the node's cache (a peer on the node may have
            # built a graph first), what this process compiled is what the others lack.
            if event["workers"][0]["new_graphs"]:
                event["shared_bytes"] = self._share_compiled()
            self.notify(event)

    def train_step(self) -> None:
        step = self.step + 1
        started = time.perf_counter()
        _seed_all(self.cfg.seed, self.rank, step, self.device)
        self.train.begin_step()
        self.chaos.arm(step, self.rank, self.world_size, self._step_seconds)
        optimizer, scaler, lr_scale = self.optimizer, self.scaler, self.lr_scale
        lr = float(optimizer.param_groups[0]["lr"]) * lr_scale  # the LR this step uses
        carrier = self.strategy.carrier  # the metrics ride on the gradient all-reduce (DDP)
        total = accumulate(self, scaler, carrier)  # the step's metrics, weighted like the loss (this rank's share)
        carried = carrier.receive() if carrier is not None else None

        if scaler is not None:
            scaler.unscale_(optimizer)  # clip the true gradients, not scaled ones
        norm = None
        if self.cfg.grad_clip_norm is not None:
            norm = self.strategy.clip_grad_norm(self.module, self.cfg.grad_clip_norm)
            norm = norm.detach().float().reshape(1).to(total.device)
        applied = True
        if self.cfg.nonfinite != "off":
            if carried is not None:
                carried = carried.tolist()  # the step's one copy to the host: the check's, and the window's
            applied = finite(self, step, total, carried, norm, scaler)
            if applied is None:  # rolled back: self.step is an earlier one, the data past this step's
                optimizer.zero_grad(set_to_none=True)
                return
        if norm is not None:
            # The norm of all-reduced gradients is the same on every rank: carried steps
            # report it as it is; a window reduces it with the rest.
            total = norm if carried is not None else torch.cat([total, norm])
        elif carried is not None:
            total = None
        if applied:  # else a non-finite step, skipped (trainer.nonfinite: skip)
            update(self, optimizer, scaler, lr_scale)
        optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.position += self.plan.global_batch_size
        self.after_pending = True
        self._step_seconds = time.perf_counter() - started
        self.window.add(step_row(self, lr, scaler), total, carried)
        if self.chaos.due:
            with self.in_user_code():
                self.chaos.act(self.step, self.rank)

    def validate(self, epoch: int) -> dict[str, float] | None:
        """Validate after step `self.step` (see evaluate.py); None where the validation actors
        were asked instead, or the task has no validation set."""
        return validate_here(self, epoch)

    def flush(self, wait: bool = False) -> None:
        """Reduce the buffered steps' metrics over ranks and report them (see window.py)."""
        # Carried steps sent their ask with their gradients (train_step); a window sends it here.
        ask = self.strategy.carrier is None and self.save_wanted()
        self._pause_agreed |= self.window.flush(self._row_keys(), self.world_size, pause_requested=self.pause_requested,
                                                wait=wait, save_requested=ask)

    def _row_keys(self) -> list[str]:
        """The names of a training row's metrics, in the order the step holds them."""
        return (self.outputs.keys["train"] or []) + (["grad_norm"] if self.cfg.grad_clip_norm is not None else [])

    # ------------------------------------------------------------------ state

    def state_dict(self, rows: bool = True) -> dict[str, Any]:
        """The training state after `self.step` (on every rank the same, when replicated);
        with the recent metric rows for a worker that takes it in a recovery (window.py),
        not for a checkpoint (`rows` False: a resume's driver has them in metrics.jsonl)."""
        return {**self.train.state_dict(),
                "input": self.train_input.state_dict(self.step),  # a stream's position (None: the loop's position)
                "loop": where(self, rows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` was taken: the next step is state's step + 1, at
        the same global sample index, whatever the world size now is."""
        check_resumable(state["loop"], self.cfg)
        self.train.load_state_dict(state)
        go_back(self, state["loop"])
        self.train_input.load_state_dict(state.get("input"), self.step)
        # The random streams need no restoring: each step seeds them from (seed, rank, step).

    def save_checkpoint(self, wait: bool = False) -> None:
        metrics = self.latest_metrics
        if self.validation is not None:
            metrics = self.validation.manifest_metrics(metrics)
        self.saver.save(self.step, self.checkpoint_state, metrics)
        if wait:
            self.saver.finish()

    def checkpoint_state(self) -> dict[str, Any]:
        return self.state_dict(rows=False)

    def save_wanted(self) -> bool:
        """Rank 0 asks for a checkpoint when checkpoint.every_n_minutes has passed on its
        clock; the ask rides the metrics' reduction, so every rank saves at the same step."""
        if self.rank != 0 or self._save_asked or self.cfg.fast_dev_run or not self.saver.time_due():
            return False
        self._save_asked = True  # once: its step's sums carry it to the next flush on every rank
        return True

    # ------------------------------------------------------------------ recovery

    def abandon_step(self) -> None:
        """Undo what a step interrupted half-way changed, so the state is that after
        `self.step`: gradients, BatchNorm running statistics, metrics not yet reduced."""
        self.train.abandon_step()
        self.window.clear(self._row_keys(), self.world_size)
        self._save_asked = False  # the step that carried the ask was abandoned: ask again
        if self.strategy.carrier is not None:
            self.strategy.carrier.clear()
        self.chaos.cancel()
        self.train_input.reset()  # it had prepared the rest of the interrupted step
        self.phase = "framework"

    def regroup(self, rank: int, world_size: int, report_to: Report | None = None) -> None:
        """Continue in a re-formed process group (the default group, already initialised)
        as `rank` (ranks are renumbered when the group shrinks)."""
        self.rank, self.world_size = rank, world_size
        self.window.sink = (report_to or self._report) if rank == 0 else _drop
        self.saver.rank = rank
        self.plan = self.plan_for()
        self.train_input.regroup(self.plan, rank, self.step)
        if self.rollbacks is not None:  # a replacement keeps none yet: no rank goes back past here
            self.rollbacks.kept.reset(self.step)
        self.wrapped = self.strategy.wrap(self.module, world_size, self.device, synced=True)  # the same state, all
        # Compiled again over the new wrapper: dynamo finds the graphs it compiled for the
        # module (compiling.py); the event after the next step shows whether it did.
        self.model = compiled(self.wrapped, self.cfg.compile)
        self._compile_unreported = self.cfg.compile is not None
        self._graphs_at_join = graph_count() if self.cfg.compile is not None else 0
        self.pause_requested = self._pause_agreed = self.paused = False

    def close_inputs(self) -> None:
        """Stop the loader processes (they also die with this process)."""
        self.train_input.close()
        if self.validation is not None:
            self.validation.close()
        if self.val_input is not None:
            self.val_input.close()

    # ------------------------------------------------------------------ helpers

    def plan_for(self, world_size: int | None = None) -> BatchPlan:
        return self.sizing.plan(self.train_data, world_size or self.world_size)

    @property
    def lr_scale(self) -> float:
        """What the per_worker policy multiplies every LR by: the linear scaling rule."""
        return self.world_size / self.base_world_size if self.cfg.batch_policy == "per_worker" else 1.0

    def in_phase(self, phase: str) -> InPhase:
        """Where this rank is, for the driver's hang check (see Worker.status)."""
        return InPhase(self, phase)

    def in_user_code(self) -> InPhase:
        return InPhase(self, "user")

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def row(self, step: int, epoch: int, metrics: dict[str, float]) -> dict[str, Any]:
        return {"step": step, "epoch": epoch, "world_size": self.world_size, "time": time.time(), **metrics}


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


def _drop(rows: list[dict[str, Any]]) -> None:
    """Where ranks other than 0 report: the driver hears from rank 0 only."""


def _known_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_FLOPS.items() if key in name), None)
