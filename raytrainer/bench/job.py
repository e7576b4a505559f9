"""The job every contender trains: an MLP regressing a fixed random linear map, the same
seeded data, global batch and per-epoch sample order (raytrainer's BatchPlan), SGD.
Torch is imported inside the functions: the CLI imports this package to build its parser."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from ..task import Task
from .kill import arm_kill

TASK_TARGET = "raytrainer.bench:BenchTask"
"""How raytrainer's workers import the bench task (config task.target)."""


def build_mlp(spec: dict[str, Any]):
    import torch

    dims = [spec["in_dim"]] + [spec["hidden"]] * spec["layers"]
    layers: list[Any] = []
    for a, b in zip(dims, dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(dims[-1], 1))


def make_data(spec: dict[str, Any]):
    import torch

    g = torch.Generator().manual_seed(spec["seed"])
    x = torch.randn(spec["samples"], spec["in_dim"], generator=g)
    w = torch.randn(spec["in_dim"], 1, generator=g)
    return x, x @ w + 0.1 * torch.randn(spec["samples"], 1, generator=g)


def make_optimizer(model, name: str = "sgd"):
    """SGD with momentum; Adam for the stall runs (a checkpoint three times the model, as
    most large models are trained)."""
    import torch

    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def threads_at(steps: int) -> int:
    """The step at which rank 0 takes its thread snapshot: mid-run, at steady state."""
    return max(1, steps // 2)


def malloc_settings(environ: Any) -> dict[str, str]:
    """The malloc settings (MALLOC_*) that `environ` holds."""
    return {k: v for k, v in environ.items() if k.startswith("MALLOC_")}


def thread_snapshot() -> dict[str, Any]:
    """What this process computes with, taken by rank 0 at steady state, so a reader can
    check that every contender's ranks run with the same threads: torch's intra- and
    inter-op threads, the process's threads (the launcher's, Ray's, Gloo's, the loop's
    own), its nice value (Ray starts its workers at RAY_worker_niceness, 15 by default), and
    the malloc settings of its environment (a Ray raytrainer starts sets them: localray.py)."""
    import torch

    threads = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Threads:"):
                threads = int(line.split()[1])
    return {"torch_intra_op": torch.get_num_threads(), "torch_inter_op": torch.get_num_interop_threads(),
            "process_threads": threads, "nice": os.nice(0), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "malloc": malloc_settings(os.environ)}


def sgd_step(model, optimizer, xb, yb):
    """One optimizer step of the contenders that write their own loop; returns the loss."""
    import torch

    loss = torch.nn.functional.mse_loss(model(xb), yb)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss


def batch_plan(spec: dict[str, Any], world: int):
    from ..data import BatchPlan

    return BatchPlan(spec["samples"], spec["global_batch_size"], spec["global_batch_size"] // world, world,
                     spec["seed"])


def rank_batch(spec: dict[str, Any], x, y, step: int, rank: int, world: int):
    """This rank's share of optimizer step `step`: raytrainer's sample order, so all
    three contenders see the same samples in the same order."""
    plan = batch_plan(spec, world)
    epoch, in_epoch = divmod(step, plan.steps_per_epoch)
    (index,) = plan.micro_batches(epoch, in_epoch * plan.global_batch_size, rank)
    return x[index], y[index]


class SlowSamples:
    """The input scenario's dataset: sample i is the training set's row i, read with
    `input_io_ms` of latency (a sleep, as a read from a network filesystem) and decoded
    with `input_decode_rounds` small matrix products. A map-style torch dataset (by
    protocol: torch is not imported until a sample is read)."""

    def __init__(self, spec: dict[str, Any]):
        self.spec = spec
        self._data = None

    def __len__(self) -> int:
        return self.spec["samples"]

    def __getitem__(self, i: int):
        import torch

        if self._data is None:  # in the process that reads: not pickled to loader processes
            self._data = make_data(self.spec)
            self._mix = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)) / 8
        time.sleep(self.spec["input_io_ms"] / 1000)
        m = self._mix
        for _ in range(self.spec["input_decode_rounds"]):
            m = torch.tanh(m @ self._mix)
        x, y = self._data
        return x[i] + 0 * m[0, 0], y[i]

    def __getstate__(self):
        return {"spec": self.spec, "_data": None}


class BenchTask(Task):
    """The bench job as a raytrainer task; workers import it as raytrainer.bench:BenchTask."""

    def __init__(self, **spec):
        self.spec = spec
        self._steps = 0  # train_step calls: one per optimizer step (no accumulation in the bench)

    def build_model(self):
        return build_mlp(self.spec)

    def build_optimizer(self, model):
        return make_optimizer(model, self.spec.get("optimizer", "sgd"))

    def train_dataset(self):
        from torch.utils.data import TensorDataset

        if self.spec.get("scenario") == "input":
            return SlowSamples(self.spec)
        return TensorDataset(*make_data(self.spec))

    def train_step(self, model, batch):
        import torch

        x, y = batch
        self._steps += 1
        if self.spec.get("kill_marker"):
            arm_kill(self.spec, self._steps, torch.distributed.get_rank())
        if self.spec.get("pace_while") and os.path.exists(self.spec["pace_while"]):
            time.sleep(self.spec.get("pace_s", 0.02))
        if (self.spec.get("threads_file") and self._steps == self.spec["threads_at"]
                and torch.distributed.get_rank() == 0):
            Path(self.spec["threads_file"]).write_text(json.dumps(thread_snapshot()))
        return {"loss": torch.nn.functional.mse_loss(model(x), y)}
