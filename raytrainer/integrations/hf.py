"""A Hugging Face `Trainer` inside raytrainer.train_loop: one callback, one resume argument.

    from raytrainer.integrations.hf import RaytrainerCallback, checkpoint_to_resume

    def train_func(ctx):
        args = TrainingArguments(output_dir=ctx.scratch_dir, ...)
        trainer = Trainer(model=..., args=args, train_dataset=...,
                          callbacks=[RaytrainerCallback(ctx)])
        trainer.train(resume_from_checkpoint=checkpoint_to_resume(ctx, args.output_dir))

The Trainer is unchanged: raytrainer formed the process group and set the environment
torchrun would, from which the Trainer (through accelerate) initialises itself.

`RaytrainerCallback` makes each optimizer step the Trainer logs, evaluates or saves at a
raytrainer step boundary (ctx.report): its logged loss, learning rate and grad norm, and its
evaluation metrics (`eval_*`), become one row of metrics.jsonl; every `state_every` steps the
Trainer's state (model, optimizer, scheduler, the TrainerState) goes with it to host memory on
every worker; a checkpoint-N the Trainer saves is committed as a raytrainer checkpoint, its
files beside raytrainer's state.pt. The Trainer's control flow is the same on every rank, so
every rank reports at the same steps (ctx.report is a collective).

`checkpoint_to_resume` is what `Trainer.train(resume_from_checkpoint=...)` takes: None at a
fresh start; after a lost worker, the state from a survivor's memory written out as a
checkpoint-N directory on this worker's disk; where no worker survived, the newest committed
checkpoint's directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
from transformers import TrainerCallback

from . import AUTO, state_due, state_every_checked

__all__ = ["RaytrainerCallback", "checkpoint_to_resume"]


class RaytrainerCallback(TrainerCallback):
    """Reports the Trainer's steps to raytrainer (see the module). `state_every`: every how
    many optimizer steps the state goes to memory with the report, a failure costing at most
    that many steps; "auto" (the default): as often as that takes about 2% of the time,
    measured in the run (ctx.state_due). Steps the Trainer neither logs, evaluates nor saves are reported only
    where their state is due (a row without a loss)."""

    def __init__(self, ctx: Any, state_every: int | str = AUTO):
        self.ctx, self.state_every = ctx, state_every_checked(state_every)
        self._row: dict[str, Any] | None = None  # the step's row, until it is reported
        self._with_state = False
        self._last = ""  # the hook that ends this step's work: where the report is made

    def on_step_end(self, args, state, control, **kwargs):
        self._row = {"step": state.global_step, "epoch": int(state.epoch or 0)}
        self._with_state = state_due(self.ctx, self.state_every, state.global_step)
        # The Trainer logs, then evaluates, then saves, after this hook (the flags are its
        # DefaultFlowCallback's, which runs first): report after the last of them.
        self._last = ("save" if control.should_save else "evaluate" if control.should_evaluate
                      else "log" if control.should_log else "")
        if not self._last:
            if self._with_state:
                self._report(kwargs, state)
            else:
                self._row = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._row is None or not logs:  # the end-of-training summary, an evaluation of the user's own
            return
        for key, value in logs.items():
            if key == "learning_rate":
                key = "lr"
            if key != "epoch" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._row[key] = float(value)
        if self._last == "log":
            self._report(kwargs, state)

    def on_evaluate(self, args, state, control, **kwargs):
        # With save_strategy "best" the Trainer decides to save after this hook: the step is
        # reported here, and that save is not committed.
        if self._row is not None and (self._last == "evaluate" or args.save_strategy == "best"):
            self._report(kwargs, state)

    def on_save(self, args, state, control, **kwargs):
        if self._row is not None:
            path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            # Rank 0 writes the checkpoint (its copy is committed); the others may have none.
            self._report(kwargs, state, checkpoint=path if os.path.isdir(path) else None)

    def _report(self, hooks: dict[str, Any], state, checkpoint: str | None = None) -> None:
        snapshot = None
        if self._with_state:
            snapshot = {"model": hooks["model"], "optimizer": hooks["optimizer"],
                        "scheduler": hooks["lr_scheduler"], "trainer_state": json.dumps(dataclasses.asdict(state))}
        row, self._row = self._row, None
        self.ctx.report(row, state=snapshot, checkpoint=checkpoint)


def checkpoint_to_resume(ctx: Any, output_dir: str) -> str | None:
    """What `Trainer.train(resume_from_checkpoint=...)` resumes from (see the module)."""
    if ctx.state is not None and "trainer_state" in ctx.state:
        return _write_checkpoint(ctx.state, output_dir)
    return ctx.checkpoint  # None at a fresh start; the Trainer's files where none survived


def _write_checkpoint(state: dict[str, Any], directory: str) -> str:
    """The state raytrainer kept in memory as the checkpoint-N directory the Trainer resumes
    from (its file names), on local disk, never the run's storage."""
    from safetensors.torch import save_file

    step = json.loads(state["trainer_state"])["global_step"]
    path = os.path.join(directory, f"checkpoint-{step}")
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state["model"].items()}, os.path.join(path, "model.safetensors"))
    torch.save(state["optimizer"], os.path.join(path, "optimizer.pt"))
    torch.save(state["scheduler"], os.path.join(path, "scheduler.pt"))
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        f.write(state["trainer_state"])
    return path
