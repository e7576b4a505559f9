"""accelerate inside: a plain `Accelerator` loop run as your own loop (raytrainer.train_loop).

Nothing to import from raytrainer: `Accelerator()` made inside the function finds the
process group raytrainer formed and the environment torchrun would set, and wraps the model
in DDP as under `accelerate launch`. The loop reports each step (ctx.report) with its state
every `state_every` steps, and after a lost worker starts again from ctx.state (a survivor's
memory). The batches come from ctx.sampler: raytrainer's seeded global order, resumed at
ctx.step, so the replay is exact (accelerator.prepare(loader) would shard a loader too, but
its order after a restart depends on the process's random state).

A small MLP regresses a fixed random function of 16 numbers (synthetic, seeded).

    raytrainer train configs/accelerate_loop.yaml      # or from Python:
    raytrainer.train_loop(train_func, "configs/accelerate_loop.yaml")  # the config's task section removed
"""

from __future__ import annotations

import torch


def dataset(n: int = 2048) -> torch.utils.data.TensorDataset:
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(0))
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(1234))
    return torch.utils.data.TensorDataset(x, torch.tanh(x @ w))


def train_func(ctx, samples: int = 2048, hidden: int = 64, lr: float = 1e-3, state_every: int = 1,
               step_sleep_s: float = 0.0):
    import time

    from accelerate import Accelerator

    accelerator = Accelerator(cpu=ctx.device.type == "cpu")
    torch.manual_seed(ctx.seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    if ctx.state is not None:  # after a failure: the newest report every rank reached
        model.load_state_dict(ctx.state["model"])
        optimizer.load_state_dict(ctx.state["optimizer"])
    model, optimizer = accelerator.prepare(model, optimizer)
    data = dataset(samples)
    sampler = ctx.sampler(data)  # this rank's share of each global batch, from ctx.step
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    step = ctx.step
    for epoch in range(sampler.epoch, 10**6):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(accelerator.device), y.to(accelerator.device)
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            time.sleep(step_sleep_s)  # for the test: a window to kill a worker in a step
            state = {"model": accelerator.unwrap_model(model), "optimizer": optimizer}
            ctx.report({"loss": loss, "step": step, "epoch": epoch},
                       state=state if step % state_every == 0 else None)
            if step >= ctx.max_steps:
                return accelerator.unwrap_model(model)
