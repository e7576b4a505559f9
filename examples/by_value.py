"""Your code as it is: a Task defined in the script you run, and your own training loop,
passed to raytrainer as Python objects. Neither needs to be importable by the workers:
each is pickled (cloudpickle) once, put in Ray's object store, and unpickled by every
worker, as Ray ships a remote function. The same works from a notebook.

    python examples/by_value.py --storage runs
    ray job submit --working-dir . -- python examples/by_value.py --storage /shared/runs
"""

from __future__ import annotations

import argparse
import math

import torch
from torch.utils.data import DataLoader, TensorDataset

import raytrainer


def sine_data(n: int = 512) -> TensorDataset:
    x = torch.linspace(-math.pi, math.pi, n).unsqueeze(1)
    return TensorDataset(x, torch.sin(x))


class SineTask(raytrainer.Task):
    """Defined here, in __main__: shipped by value, with its settings (hidden, lr)."""

    def __init__(self, hidden: int = 32, lr: float = 0.01):
        self.hidden, self.lr = hidden, lr

    def build_model(self):
        return torch.nn.Sequential(torch.nn.Linear(1, self.hidden), torch.nn.Tanh(), torch.nn.Linear(self.hidden, 1))

    def build_optimizer(self, model):
        return torch.optim.Adam(model.parameters(), lr=self.lr)

    def train_dataset(self):
        return sine_data()

    def train_step(self, model, batch):
        x, y = batch
        return {"loss": torch.nn.functional.mse_loss(model(x), y)}


def train_func(ctx, hidden: int = 32, lr: float = 0.01):
    """Your own loop, as under torchrun: raytrainer has formed the process group."""
    torch.manual_seed(ctx.seed)
    model = torch.nn.Sequential(torch.nn.Linear(1, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    if ctx.state is not None:  # after a failure: the newest state every rank reported
        model.load_state_dict(ctx.state["model"])
        optimizer.load_state_dict(ctx.state["optimizer"])
    model = ctx.prepare_model(model)  # DDP over the group
    data = sine_data()
    sampler = ctx.sampler(data)  # by global sample index, from ctx.step
    step = ctx.step
    for epoch in range(sampler.epoch, ctx.max_epochs or 1):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_sampler=sampler):
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            ctx.report({"loss": loss, "step": step, "epoch": epoch},
                       state={"model": model, "optimizer": optimizer})
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", default="runs")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    common = {"scaling": {"num_workers": args.workers}, "run": {"storage": args.storage}, "loggers": []}
    task = raytrainer.train({"task": SineTask(hidden=32), "trainer": {"max_epochs": args.epochs,
                                                                      "global_batch_size": 32}, **common})
    loop = raytrainer.train_loop(train_func, {"trainer": {"max_epochs": args.epochs, "global_batch_size": 32},
                                              **common}, args={"hidden": 32})
    for result in (task, loop):
        print(f"finished {result.run_dir}: step {result.metrics['step']}, loss {result.metrics['loss']:.4f}")


if __name__ == "__main__":
    main()
