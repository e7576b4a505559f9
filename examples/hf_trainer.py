"""Hugging Face inside: a `transformers.Trainer` run as your own loop (raytrainer.train_loop).

The Trainer is unchanged: raytrainer forms the process group and sets the environment
torchrun would (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), from which the Trainer
(through accelerate) initialises itself and wraps the model in DDP. One TrainerCallback
connects it to raytrainer:
- every logged step, `ctx.report` sends the loss to metrics.jsonl and hands raytrainer the
  Trainer's state (model, optimizer, scheduler, and the TrainerState as JSON), which it keeps
  in host memory;
- every saved checkpoint (checkpoint-N, in a directory of this worker's own) is committed
  as a raytrainer checkpoint, the Trainer's files beside raytrainer's state.pt.
After a lost worker, every worker runs `train_func` again: `ctx.state` is the newest state
every rank reported, from a survivor's memory, which the function writes out as a
checkpoint-N directory on local disk for the Trainer's own resume
(`resume_from_checkpoint`). Where no worker survived, `ctx.checkpoint` is the newest
committed checkpoint's directory, which the Trainer resumes from as it is.

The model is a small GPT-2 built from a config (random initialisation, nothing
downloaded) over bytes: a character tokenizer of 256 symbols, on the Python standard
library's source (examples/charlm.py's corpus).

    raytrainer train configs/hf_trainer.yaml      # or from Python:
    raytrainer.train_loop(train_func, "configs/hf_trainer.yaml")  # the config's task section removed
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import torch

from examples.charlm import stdlib_text

VOCAB = 256  # bytes: the character tokenizer


class ByteWindows(torch.utils.data.Dataset):
    """Windows of `block` bytes; the model shifts its labels itself."""

    def __init__(self, data: torch.Tensor, block: int):
        self.data, self.block = data, block

    def __len__(self) -> int:
        return len(self.data) // self.block

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.data[i * self.block:(i + 1) * self.block].long()
        return {"input_ids": ids, "labels": ids}


def report_callback(ctx, state_every: int = 1):
    """A TrainerCallback that reports the Trainer's logs to raytrainer, with its state every
    `state_every` logged steps and each checkpoint it saves."""
    from transformers import TrainerCallback

    class Report(TrainerCallback):
        def __init__(self):
            self.logs: dict | None = None  # a logged step's row, until it is reported
            self.state: dict | None = None

        def on_log(self, args, state, control, logs=None, model=None, optimizer=None, lr_scheduler=None, **_):
            if not logs or "loss" not in logs:  # the end-of-training summary, evaluation
                return
            self.logs = {"loss": logs["loss"], "lr": logs.get("learning_rate", 0.0),
                         "grad_norm": logs.get("grad_norm", 0.0), "step": state.global_step,
                         "epoch": int(state.epoch or 0)}
            self.state = None
            if state.global_step % state_every == 0:
                self.state = {"model": model, "optimizer": optimizer, "scheduler": lr_scheduler,
                              "trainer_state": json.dumps(dataclasses.asdict(state))}
            if not control.should_save:  # else the save that follows reports it, with the checkpoint
                self._report()

        def on_save(self, args, state, control, **_):
            path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            self._report(checkpoint=path if os.path.isdir(path) else None)

        def _report(self, checkpoint=None):
            if self.logs is not None:
                ctx.report(self.logs, state=self.state, checkpoint=checkpoint)
                self.logs = self.state = None

    return Report()


def write_checkpoint(state: dict, directory: str) -> str:
    """The state raytrainer kept in memory, as the checkpoint-N directory the Trainer resumes
    from (its file names); on local disk, never the run's storage."""
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


def train_func(ctx, block_size: int = 64, n_embd: int = 64, n_layer: int = 2, n_head: int = 4,
               max_bytes: int = 1_000_000, learning_rate: float = 3e-3, save_steps: int = 50,
               state_every: int = 1, step_sleep_s: float = 0.0):
    """Your own loop: a Hugging Face Trainer, as you would run it under torchrun. Its
    length and batch come from the config (trainer.max_steps, trainer.global_batch_size)."""
    from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    data = torch.frombuffer(bytearray(stdlib_text(max_bytes)), dtype=torch.uint8)
    config = GPT2Config(vocab_size=VOCAB, n_positions=block_size, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(ctx.seed)
    model = GPT2LMHeadModel(config)  # random initialisation: nothing downloaded
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf-"),  # this worker's own; raytrainer commits rank 0's checkpoints
        max_steps=ctx.max_steps, per_device_train_batch_size=ctx.global_batch_size // ctx.world_size,
        learning_rate=learning_rate, lr_scheduler_type="cosine", warmup_steps=min(10, ctx.max_steps // 10),
        logging_steps=1, save_strategy="steps", save_steps=save_steps, report_to=[], seed=ctx.seed,
        use_cpu=ctx.device.type == "cpu", disable_tqdm=True, dataloader_num_workers=0,
        ddp_find_unused_parameters=False)  # every parameter has a gradient: no extra graph traversal
    callbacks = [report_callback(ctx, state_every)]
    if step_sleep_s:  # for the test: steps slow enough to kill a worker in the middle of one
        class Slow(TrainerCallback):
            def on_step_end(self, *a, **k):
                import time

                time.sleep(step_sleep_s)

        callbacks.append(Slow())
    trainer = Trainer(model=model, args=args, train_dataset=ByteWindows(data, block_size), callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # its log lines: raytrainer's progress and metrics.jsonl have them
    resume = None
    if ctx.state is not None:  # after a failure: the newest state every rank reported, from memory
        resume = write_checkpoint(ctx.state, args.output_dir)
    elif ctx.checkpoint is not None:  # no worker survived: the newest committed checkpoint
        resume = ctx.checkpoint
    trainer.train(resume_from_checkpoint=resume)
    return trainer.model
