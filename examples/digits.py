"""Image classification: a small CNN on scikit-learn's bundled 8x8 digits.

Shows a real dataset loaded on every worker without a download (and split the
same way on each), a model with BatchNorm (running statistics are buffers, not
parameters), AdamW with an optional cosine schedule, and accuracy logged beside
the loss.

Needs scikit-learn: pip install 'raytrainer[examples]'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raytrainer.task import Task


class DigitsTask(Task):
    def __init__(self, channels: int = 32, lr: float = 3e-3, weight_decay: float = 1e-4,
                 val_fraction: float = 0.2, cosine: bool = True, seed: int = 0):
        self.channels = channels
        self.lr = lr
        self.weight_decay = weight_decay
        self.val_fraction = val_fraction
        self.cosine = cosine
        self.seed = seed
        self._split = None

    def _datasets(self):
        if self._split is None:
            try:
                from sklearn.datasets import load_digits  # lazy: only this example needs it
            except ImportError:
                raise ImportError(
                    "examples.digits needs scikit-learn for its bundled digits dataset; "
                    "install it with: pip install 'raytrainer[examples]'"
                ) from None
            data = load_digits()
            # Pixels are 0..16; scale to [0, 1] and add the channel axis: [N, 1, 8, 8].
            x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
            y = torch.tensor(data.target, dtype=torch.int64)
            # Fixed-seed permutation so every worker gets the same train/val split.
            perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(self.seed))
            n_val = int(len(y) * self.val_fraction)
            val, train = perm[:n_val], perm[n_val:]
            self._split = (
                torch.utils.data.TensorDataset(x[train], y[train]),
                torch.utils.data.TensorDataset(x[val], y[val]),
            )
        return self._split

    def build_model(self) -> torch.nn.Module:
        c = self.channels
        return torch.nn.Sequential(
            torch.nn.Conv2d(1, c, 3, padding=1), torch.nn.BatchNorm2d(c), torch.nn.ReLU(),
            torch.nn.Conv2d(c, c, 3, padding=1), torch.nn.BatchNorm2d(c), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),  # 8x8 -> 4x4
            torch.nn.Flatten(),
            torch.nn.Linear(c * 4 * 4, 10),
        )

    def build_optimizer(self, model):
        return torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=self.weight_decay)

    def build_scheduler(self, optimizer, total_steps):
        if not self.cosine:
            return None
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)

    def train_dataset(self):
        return self._datasets()[0]

    def val_dataset(self):
        return self._datasets()[1]

    def train_step(self, model, batch):
        x, y = batch
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        accuracy = (logits.argmax(dim=1) == y).float().mean()
        return {"loss": loss, "accuracy": accuracy}
