"""Hugging Face inside: a `transformers.Trainer` run as your own loop (raytrainer.train_loop).

The Trainer is unchanged: raytrainer forms the process group and sets the environment
torchrun would (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), from which the Trainer
(through accelerate) initialises itself and wraps the model in DDP. Two lines connect it to
raytrainer (raytrainer.integrations.hf, the `[hf]` extra):
- `RaytrainerCallback(ctx, state_every)`: the Trainer's logged loss and evaluation metrics go
  to metrics.jsonl, its state (model, optimizer, scheduler, TrainerState) to host memory on
  every worker every `state_every` steps, and each checkpoint-N it saves is committed as a
  raytrainer checkpoint;
- `resume_from_checkpoint=checkpoint_to_resume(ctx, output_dir)`: after a lost worker, the
  newest state every rank reported, from a survivor's memory, written out as a checkpoint-N
  the Trainer resumes from; where no worker survived, the newest committed checkpoint.

The model is a small GPT-2 built from a config (random initialisation, nothing
downloaded) over bytes: a character tokenizer of 256 symbols, on the Python standard
library's source (examples/charlm.py's corpus).

    raytrainer train configs/hf_trainer.yaml      # or from Python:
    raytrainer.train_loop(train_func, "configs/hf_trainer.yaml")  # the config's task section removed
"""

from __future__ import annotations

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


def train_func(ctx, block_size: int = 64, n_embd: int = 64, n_layer: int = 2, n_head: int = 4,
               max_bytes: int = 1_000_000, learning_rate: float = 3e-3, save_steps: int = 50,
               state_every: int | str = 1, eval_steps: int = 0, step_sleep_s: float = 0.0):
    """Your own loop: a Hugging Face Trainer, as you would run it under torchrun. Its
    length and batch come from the config (trainer.max_steps, trainer.global_batch_size).
    `eval_steps`: evaluate on held-out bytes every that many steps (0: never)."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from raytrainer.integrations.hf import RaytrainerCallback, checkpoint_to_resume

    data = torch.frombuffer(bytearray(stdlib_text(max_bytes)), dtype=torch.uint8)
    held_out = len(data) // 20 if eval_steps else 0
    config = GPT2Config(vocab_size=VOCAB, n_positions=block_size, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(ctx.seed)
    model = GPT2LMHeadModel(config)  # random initialisation: nothing downloaded
    # This worker's own folder on its local disk, removed when the function ends (or, where
    # the worker is killed, by the next one on its node): raytrainer commits rank 0's checkpoints.
    args = TrainingArguments(
        output_dir=ctx.scratch_dir,
        max_steps=ctx.max_steps, per_device_train_batch_size=ctx.global_batch_size // ctx.world_size,
        learning_rate=learning_rate, lr_scheduler_type="cosine", warmup_steps=min(10, ctx.max_steps // 10),
        logging_steps=1, save_strategy="steps", save_steps=save_steps, report_to=[], seed=ctx.seed,
        eval_strategy="steps" if eval_steps else "no", eval_steps=eval_steps or None,
        use_cpu=ctx.device.type == "cpu", disable_tqdm=True, dataloader_num_workers=0,
        ddp_find_unused_parameters=False)  # every parameter has a gradient: no extra graph traversal
    callbacks = [RaytrainerCallback(ctx, state_every=state_every)]
    if step_sleep_s:  # for the test: steps slow enough to kill a worker in the middle of one
        class Slow(TrainerCallback):
            def on_step_end(self, *a, **k):
                import time

                time.sleep(step_sleep_s)

        callbacks.append(Slow())
    trainer = Trainer(model=model, args=args, train_dataset=ByteWindows(data[held_out:], block_size),
                      eval_dataset=ByteWindows(data[:held_out], block_size) if eval_steps else None,
                      callbacks=callbacks)
    trainer.train(resume_from_checkpoint=checkpoint_to_resume(ctx, args.output_dir))
    return trainer.model
