"""Small tasks the tests train; workers import them as tests.tasks:<Name>."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from raytrainer import Task


class RegressionTask(Task):
    """A tiny MLP regressing a fixed random linear map; deterministic data on every worker."""

    def __init__(self, num_samples=256, val_samples=64, lr=0.05, fail_at_step=None, fail_rank=0,
                 no_loss=False, val_batch_metric=False):
        self.num_samples, self.val_samples, self.lr = num_samples, val_samples, lr
        self.fail_at_step, self.fail_rank = fail_at_step, fail_rank
        self.no_loss = no_loss
        self.steps = 0

    def build_model(self):
        return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def build_optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.9)

    def _data(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 4, generator=g)
        w = torch.tensor([[1.0], [-2.0], [0.5], [0.0]])
        return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g), torch.arange(n))

    def train_dataset(self):
        return self._data(self.num_samples, 1)

    def val_dataset(self):
        return self._data(self.val_samples, 2) if self.val_samples else None

    def train_step(self, model, batch):
        x, y, _ = batch
        self.steps += 1
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            import torch.distributed as dist

            if dist.get_rank() == self.fail_rank:
                raise ValueError(f"boom at micro-step {self.steps}")
        loss = torch.nn.functional.mse_loss(model(x), y)
        return {"mse": loss.detach()} if self.no_loss else {"loss": loss}

    def val_step(self, model, batch):
        x, y, index = batch
        # 'index' averages to the mean sample index: checks the weighting over ranks.
        return {"loss": torch.nn.functional.mse_loss(model(x), y), "index": index.float().mean()}


class TinyTask(RegressionTask):
    """A dataset smaller than the global batch used by the tests."""

    def train_dataset(self):
        return self._data(8, 1)
