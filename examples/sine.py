"""Regression with plain SGD: a small MLP fits y = sin(2*pi*x) on [0, 1].

Shows a regression task (MSE, no accuracy), SGD with momentum and a model with
constructor arguments (width) set from the config's task.args.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from raytrainer.task import Task


class SineTask(Task):
    def __init__(self, num_samples: int = 2048, val_samples: int = 512, hidden: int = 64,
                 lr: float = 0.1, momentum: float = 0.9, seed: int = 0):
        self.num_samples = num_samples
        self.val_samples = val_samples
        self.hidden = hidden
        self.lr = lr
        self.momentum = momentum
        self.seed = seed

    def _make(self, n: int, seed: int) -> torch.utils.data.TensorDataset:
        # Seeded private generator: identical data on every worker.
        g = torch.Generator().manual_seed(seed)
        x = torch.rand(n, 1, generator=g)
        y = torch.sin(2 * math.pi * x)
        return torch.utils.data.TensorDataset(x, y)

    def build_model(self) -> torch.nn.Module:
        h = self.hidden
        return torch.nn.Sequential(
            torch.nn.Linear(1, h), torch.nn.Tanh(),
            torch.nn.Linear(h, h), torch.nn.Tanh(),
            torch.nn.Linear(h, 1),
        )

    def build_optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=self.momentum)

    def train_dataset(self):
        return self._make(self.num_samples, self.seed)

    def val_dataset(self):
        return self._make(self.val_samples, self.seed + 1)

    def train_step(self, model, batch):
        x, y = batch
        return {"loss": F.mse_loss(model(x), y)}
