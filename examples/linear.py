"""Smallest complete task: a linear binary classifier on synthetic data.

Shows the minimum a task defines (model, optimizer, dataset, train_step) plus the
optional pieces: a validation set, a val_step and an LR scheduler sized by the
library's `total_steps`.

Each input is 10 numbers uniform in [0, 1); the label is 1 when their mean
exceeds 0.5. The classes are linearly separable, so accuracy should climb well
above 90% within a few epochs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raytrainer.task import Task


class LinearTask(Task):
    def __init__(self, num_samples: int = 4096, val_samples: int = 1024, lr: float = 0.05,
                 seed: int = 0):
        self.num_samples = num_samples
        self.val_samples = val_samples
        self.lr = lr
        self.seed = seed

    def _make(self, n: int, seed: int) -> torch.utils.data.TensorDataset:
        # A private seeded generator (not the global RNG) makes every worker build
        # exactly the same data, which the library then shards.
        g = torch.Generator().manual_seed(seed)
        x = torch.rand(n, 10, generator=g)
        y = (x.mean(dim=1) > 0.5).long()
        return torch.utils.data.TensorDataset(x, y)

    def build_model(self) -> torch.nn.Module:
        return torch.nn.Linear(10, 2)

    def build_optimizer(self, model):
        return torch.optim.Adam(model.parameters(), lr=self.lr)

    def build_scheduler(self, optimizer, total_steps):
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)

    def train_dataset(self):
        return self._make(self.num_samples, self.seed)

    def val_dataset(self):
        # A different seed so validation samples are not copies of training ones.
        return self._make(self.val_samples, self.seed + 1)

    def train_step(self, model, batch):
        x, y = batch
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        accuracy = (logits.argmax(dim=1) == y).float().mean()
        return {"loss": loss, "accuracy": accuracy}

    def val_step(self, model, batch):
        # Same metrics as training (this is also the default); runs under no_grad,
        # and the library averages them over all validation samples.
        return self.train_step(model, batch)
