"""PyTorch Lightning inside: a `lightning.Trainer` run as your own loop (raytrainer.train_loop).

The LightningModule is unchanged; four pieces of raytrainer.integrations.lightning (the
`[lightning]` extra) put the Trainer on raytrainer's process group: the DDP strategy (with
its cluster environment), the callback that reports each step (what the module logs, to
metrics.jsonl; Lightning's checkpoint, to host memory every `state_every` steps), the
checkpoint to resume from after a lost worker (a survivor's memory), and a DataLoader in
raytrainer's global sample order that resumes mid-epoch.

A small MLP classifies 16 numbers by the sign of a fixed random projection (synthetic,
seeded: nothing downloaded).

    raytrainer train configs/lightning_loop.yaml      # or from Python:
    raytrainer.train_loop(train_func, "configs/lightning_loop.yaml")  # the config's task section removed
"""

from __future__ import annotations

import torch

try:
    import lightning as L
except ImportError as exc:  # the worker imports this module: say what to install
    raise ImportError("examples/lightning_loop.py needs Lightning: pip install -e '.[lightning]'") from exc


def dataset(n: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, generator=torch.Generator().manual_seed(1234))
    return torch.utils.data.TensorDataset(x, (x @ w > 0).long())


class Classifier(L.LightningModule):
    def __init__(self, hidden: int = 32, lr: float = 0.05):
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", torch.nn.functional.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(1) == y).float().mean())

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def train_func(ctx, samples: int = 2048, hidden: int = 32, lr: float = 0.05, val_every: int = 10,
               state_every: int | str = 1, step_sleep_s: float = 0.0, ckpt_dir: str | None = None):
    """Your own loop: a Lightning fit. Its length and batch come from the config
    (trainer.max_steps, trainer.global_batch_size). `ckpt_dir`: where a recovery's state is
    written for Lightning to read (ctx.scratch_dir by default; removed once read)."""
    from raytrainer.integrations import lightning as rtl

    torch.manual_seed(ctx.seed)
    model = Classifier(hidden, lr)
    callbacks = [rtl.RaytrainerCallback(ctx, state_every=state_every)]
    if step_sleep_s:  # for the test: steps slow enough to kill a worker in the middle of one
        class Slow(L.Callback):
            def on_train_batch_end(self, *a, **k):
                import time

                time.sleep(step_sleep_s)

        callbacks.append(Slow())
    trainer = L.Trainer(
        max_steps=ctx.max_steps, val_check_interval=val_every, check_val_every_n_epoch=None,
        accelerator="gpu" if ctx.device.type == "cuda" else "cpu", devices=1,
        strategy=rtl.RaytrainerDDPStrategy(ctx), callbacks=callbacks, use_distributed_sampler=False,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0)
    val = torch.utils.data.DataLoader(dataset(512, seed=1), batch_size=256)
    trainer.fit(model, rtl.dataloader(ctx, dataset(samples)), val,
                ckpt_path=rtl.checkpoint_to_resume(ctx, ckpt_dir or ctx.scratch_dir))
    return model
