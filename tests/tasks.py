"""Small tasks the tests train; workers import them as tests.tasks:<Name>."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from raytrainer import Task


def _stall(path):
    """Like a stuck read: the GIL is free, so the worker still answers the driver."""
    import os
    import time

    def named():
        try:
            text = open(path).read()
        except FileNotFoundError:
            return False
        listed = str(os.getpid()) in text.lstrip("!").split()
        return not listed if text.startswith("!") else listed

    while named():
        time.sleep(0.1)


def _wait_while(path, every_s=0.05):
    """Until the file `path` does not exist (a test holds a run in place with it)."""
    import os
    import time

    while os.path.exists(path):
        time.sleep(every_s)


def _hold_ahead(path):
    """A build of the task ahead (a spare's or a newcomer's, on the worker's warm-up thread:
    worker/process/warm.py) waits while the file `path` exists, as a large model's build at nice 19
    takes long; each process waiting writes its pid to `path`.waiting first."""
    import os
    import threading

    if threading.current_thread().name != "raytrainer-warm-up" or not os.path.exists(path):
        return
    with open(f"{path}.waiting", "a") as f:
        f.write(f"{os.getpid()}\n")
    _wait_while(path)


class RegressionTask(Task):
    """A tiny MLP regressing a fixed random linear map; deterministic data on every worker."""

    def __init__(self, num_samples=256, val_samples=64, lr=None, fail_at_step=None, fail_rank=0,
                 no_loss=False, dropout=0.0, record=None, sleep_s=0.0, fail_on_sample=None,
                 saving_marker=None, stall_pid_file=None, hidden=16, stall_step_file=None, builds_to=None,
                 hold_ahead=None, steps_to=None, hold=None):
        if stall_pid_file:  # while it exists, the workers it names ("!pids": the others) stall here
            _stall(stall_pid_file)
        if hold_ahead:
            _hold_ahead(hold_ahead)
        # SGD at 0.05 diverges on a wide layer (its gradient grows with the width): the wide
        # ones (a large state to move or save) take a step scaled down to stay finite, as
        # trainer.nonfinite=stop (the default) requires.
        self.num_samples, self.val_samples = num_samples, val_samples
        self.lr = lr if lr is not None else 0.05 * min(1.0, 16 / hidden)
        self.fail_at_step, self.fail_rank = fail_at_step, fail_rank
        self.no_loss = no_loss
        self.dropout, self.record, self.sleep_s = dropout, record, sleep_s
        self.fail_on_sample = fail_on_sample  # a "corrupt sample": fails wherever it is trained on
        # A path prefix: taking the model's state (a checkpoint, a copy for recovery) writes
        # <prefix><pid> and then takes a second, so a test can act while it is under way.
        self.saving_marker = saving_marker
        self.hidden = hidden  # the model's width (its state: ~48 bytes per unit with SGD momentum)
        self.stall_step_file = stall_step_file  # while it names a worker, its steps stall (see _stall)
        self.builds_to = builds_to  # a file: each build_model appends "<pid> <time>"
        # A path prefix: each micro-batch writes how many this process has trained to
        # <prefix><pid>, which a test waits on (faults.Run.wait_for_worker_step) to act
        # mid-run without the lag of the driver's metric rows (seconds, on a loaded machine).
        self.steps_to = steps_to
        self.hold = hold  # (path, n): from micro-batch n on, each waits while the file exists
        self.steps = 0

    def build_model(self):
        if self.builds_to:
            import os
            import time

            with open(self.builds_to, "a") as f:
                f.write(f"{os.getpid()} {time.time()}\n")
        model = torch.nn.Sequential(torch.nn.Linear(4, self.hidden), torch.nn.Tanh(), torch.nn.Dropout(self.dropout),
                                    torch.nn.Linear(self.hidden, 1))
        if self.saving_marker:
            def slowly(module, state, prefix, local_metadata):
                import os
                import time

                open(f"{self.saving_marker}{os.getpid()}", "w").close()
                time.sleep(1.0)

            model._register_state_dict_hook(slowly)
        return model

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
        x, y, index = batch
        self.steps += 1
        if self.steps_to:
            import os

            with open(f"{self.steps_to}{os.getpid()}", "w") as f:
                f.write(str(self.steps))
        if self.hold and self.steps >= self.hold[1]:
            _wait_while(self.hold[0])
        if self.record:  # every sample index this rank trains on, one line per micro-batch
            import torch.distributed as dist

            with open(f"{self.record}.{dist.get_rank()}", "a") as f:
                f.write(" ".join(map(str, index.tolist())) + "\n")
        if self.sleep_s:
            import time

            time.sleep(self.sleep_s)
        if self.stall_step_file:
            _stall(self.stall_step_file)
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            import torch.distributed as dist

            if dist.get_rank() == self.fail_rank:
                raise ValueError(f"boom at micro-step {self.steps}")
        if self.fail_on_sample is not None and self.fail_on_sample in index.tolist():
            raise ValueError(f"sample {self.fail_on_sample} is corrupt")
        loss = torch.nn.functional.mse_loss(model(x), y)
        return {"mse": loss.detach()} if self.no_loss else {"loss": loss}

    def val_step(self, model, batch):
        x, y, index = batch
        # 'index' averages to the mean sample index: checks the weighting over ranks.
        return {"loss": torch.nn.functional.mse_loss(model(x), y), "index": index.float().mean()}


class BadRecordTask(RegressionTask):
    """One training record whose features are all inf: its step's loss is NaN."""

    def __init__(self, bad_sample=37, **kwargs):
        super().__init__(**kwargs)
        self.bad_sample = bad_sample

    def train_dataset(self):
        data = super().train_dataset()
        data.tensors[0][self.bad_sample] = float("inf")
        return data


class SpikedRecordTask(RegressionTask):
    """One training record whose label is `scale` times too large: the step that trains on it
    has a finite loss millions of times the others' (inf: not finite), and its update wrecks
    the weights. scale 1: the same data, clean. A linear model: it reaches the noise floor in
    a few dozen steps, so runs that trained on slightly different batches end alike."""

    def __init__(self, bad_sample=37, scale=1e6, **kwargs):
        super().__init__(**kwargs)
        self.bad_sample, self.scale = bad_sample, scale

    def build_model(self):
        return torch.nn.Linear(4, 1)

    def train_dataset(self):
        data = super().train_dataset()
        data.tensors[1][self.bad_sample] *= self.scale
        return data


class TinyTask(RegressionTask):
    """A dataset smaller than the global batch used by the tests."""

    def train_dataset(self):
        return self._data(8, 1)


class LeakyTask(RegressionTask):
    """Leaves something of its run in the worker's process: a thread still running
    (`leave="thread"`) or an environment variable set (`leave="env"`)."""

    def __init__(self, leave="thread", **kwargs):
        super().__init__(**kwargs)
        self.leave = leave

    def build_model(self):
        import os
        import threading
        import time

        if self.leave == "thread":
            threading.Thread(target=time.sleep, args=(3600,), name="left-by-the-task", daemon=True).start()
        else:
            os.environ["LEFT_BY_THE_TASK"] = "1"
        return super().build_model()


class FeatureTask(RegressionTask):
    """Plain SGD (an update is exactly -lr * grad) and hooks for the feature tests."""

    flops_per_sample = 1000.0
    tokens_per_sample = 16

    def __init__(self, inf_at_step=None, batchnorm=False, frozen=False, **kwargs):
        super().__init__(**kwargs)
        self.inf_at_step, self.batchnorm, self.frozen = inf_at_step, batchnorm, frozen

    def build_model(self):
        layers = [torch.nn.BatchNorm1d(4, momentum=1.0)] if self.batchnorm else []
        return torch.nn.Sequential(*layers, torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


    def build_optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=0.0 if self.frozen else self.lr)

    def train_step(self, model, batch):
        x, y, _ = batch
        self.steps += 1
        out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        if self.inf_at_step == self.steps:
            loss = loss * float("inf")
        return {"loss": loss, "bf16": float(out.dtype == torch.bfloat16),
                "fp16": float(out.dtype == torch.float16)}


class Recorder:
    """A callback that appends every hook it sees to a JSON-lines file per rank."""

    def __init__(self, path):
        self.path = path

    def _log(self, ctx, hook, **extra):
        import json

        rank = getattr(ctx, "rank", "driver")
        with open(f"{self.path}.{rank}", "a") as f:
            f.write(json.dumps({"hook": hook, "step": ctx.step, "epoch": ctx.epoch, **extra}) + "\n")

    def on_run_start(self, ctx):
        self._log(ctx, "on_run_start")

    def on_epoch_start(self, ctx):
        self._log(ctx, "on_epoch_start")

    def on_epoch_end(self, ctx):
        self._log(ctx, "on_epoch_end")

    def on_validation_end(self, ctx, metrics):
        self._log(ctx, "on_validation_end", val_loss=metrics["val_loss"])

    def on_run_end(self, ctx):
        self._log(ctx, "on_run_end", stop_reason=getattr(ctx, "stop_reason", None))


class DriverRecorder(Recorder):
    on_driver = True


class ElasticTask(RegressionTask):
    """Records, for every micro-batch, the world size, the step's seed (a function of the
    rank and the step: see loop._seed_all) and the sample indices; sleeps `sleep_s` per
    micro-batch while the file `slow_while` exists, so a test can hold the run in place
    while it adds and removes nodes, then let it finish."""

    def __init__(self, slow_while=None, **kwargs):
        super().__init__(**kwargs)
        self.slow_while = slow_while

    def train_step(self, model, batch):
        import os
        import time

        import torch.distributed as dist

        x, y, index = batch
        if self.record:
            with open(f"{self.record}.{os.getpid()}", "a") as f:
                f.write(f"{dist.get_world_size()} {torch.initial_seed()} {time.time()} "
                        + " ".join(map(str, index.tolist())) + "\n")
        if self.slow_while and os.path.exists(self.slow_while):
            time.sleep(self.sleep_s)
        return {"loss": torch.nn.functional.mse_loss(model(x), y)}


class RecordingSink:
    """A user's logger (duck-typed, no base class): appends what it is given to a JSON-lines file."""

    def __init__(self, path):
        self.path = path

    def _log(self, **record):
        import json

        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")

    def open(self, run):
        self._log(call="open", run_dir=str(run.run_dir), name=run.name, resumed=run.resumed)

    def write(self, row):
        self._log(call="write", row=row)

    def event(self, record):
        self._log(call="event", event=record["event"])

    def artifact(self, path, kind):
        self._log(call="artifact", path=str(path), kind=kind)

    def close(self):
        self._log(call="close")


class StopServer:
    """A driver callback that SIGKILLs a server's process group once a given step's row
    arrives (and, given `tracking_uri`, the logger has sent metrics to its MLflow run there), and
    returns once its port refuses connections, removing the file `release` (a run held
    there goes on): the tracking server goes away mid-run, at a known step, with every
    later row still to come."""

    on_driver = True

    def __init__(self, pgid, port, step, tracking_uri=None, release=None):
        self.pgid, self.port, self.step, self.done = pgid, port, step, False
        self.tracking_uri, self.release = tracking_uri, release

    def on_metrics(self, ctx, row):
        import os
        import signal
        import socket
        import time

        if self.done or row["step"] < self.step:
            return
        self.done = True
        if self.tracking_uri:
            # Not before the logger has started, on its own thread: its run has metrics,
            # sent only once its start (the run, then the config's params) is done. A run
            # alone is not enough: a server killed between the two is a logger that could
            # not start.
            from mlflow.tracking import MlflowClient

            client = MlflowClient(self.tracking_uri)
            deadline = time.monotonic() + 60
            while not any(r.data.metrics for r in client.search_runs(
                    [e.experiment_id for e in client.search_experiments()])):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no MLflow run with metrics at {self.tracking_uri} after 60 s")
                time.sleep(0.1)
        os.killpg(self.pgid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            except OSError:
                if self.release:  # the run, held after this step (RegressionTask(hold=...)), goes on
                    os.remove(self.release)
                return
            time.sleep(0.05)
        raise RuntimeError(f"the server on port {self.port} still answers")


class RegressionStream(torch.utils.data.IterableDataset):
    """RegressionTask's samples as a stream: item i is (x, y, i), sample i % len(data);
    `length` items, or endless."""

    def __init__(self, data, length=None):
        self.data, self.length = data, length

    def __iter__(self):
        return self._shard(0, 1)

    def _shard(self, index, count):
        import itertools

        items = itertools.count(index, count)
        for i in items if self.length is None else range(index, self.length, count):
            x, y, _ = self.data[i % len(self.data)]
            yield x, y, torch.tensor(i)


class ShardedRegressionStream(RegressionStream):
    """Reads only the items raytrainer asks it for (no skipping)."""

    def shard(self, index, count):
        return self._shard(index, count)


class StreamTask(RegressionTask):
    """RegressionTask on a stream of its training samples (see RegressionStream)."""

    def __init__(self, stream_length=None, sharded=False, **kwargs):
        super().__init__(**kwargs)
        self.stream_length, self.sharded = stream_length, sharded

    def train_dataset(self):
        cls = ShardedRegressionStream if self.sharded else RegressionStream
        return cls(self._data(self.num_samples, 1), self.stream_length)


class Unpicklable(torch.utils.data.Dataset):
    """A dataset holding a lock: it cannot be sent to a loader process."""

    def __init__(self, data):
        import threading

        self.data, self.lock = data, threading.Lock()

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


class DyingLoader(torch.utils.data.Dataset):
    """A dataset whose read of sample `at` kills the process reading it (a segfault, the
    OOM killer) when that is a loader process."""

    def __init__(self, data, at):
        self.data, self.at = data, at

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        import os
        import signal

        if i == self.at and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.data[i]


class BadInputTask(RegressionTask):
    def __init__(self, kind="unpicklable", **kwargs):
        super().__init__(**kwargs)
        self.kind = kind

    def train_dataset(self):
        data = self._data(self.num_samples, 1)
        return Unpicklable(data) if self.kind == "unpicklable" else DyingLoader(data, at=3)


def _regression_rows(batch, dim=4):
    """Ray Data preprocessing (in Ray's tasks): row id -> features and target."""
    import numpy as np

    ids = batch["id"]
    x = np.stack([np.sin(ids * (k + 1) * 0.37) for k in range(dim)], axis=1).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [0.0]], dtype=np.float32))
    return {"x": x, "y": y, "id": ids}


class RayDataTask(RegressionTask):
    """RegressionTask on ray.data.range(rows) preprocessed by map_batches; records the row
    ids each rank trains on under `record` (one line per micro-batch)."""

    def __init__(self, rows=96, **kwargs):
        super().__init__(**kwargs)
        self.rows = rows

    def train_dataset(self):
        import ray.data

        return ray.data.range(self.rows, override_num_blocks=4).map_batches(_regression_rows, batch_format="numpy")

    def train_step(self, model, batch):
        if self.record:
            import torch.distributed as dist

            with open(f"{self.record}.{dist.get_rank()}", "a") as f:
                f.write(" ".join(map(str, batch["id"].tolist())) + "\n")
        return {"loss": torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])}


def regression_loop(ctx, steps=24, state_every=1, sleep_s=0.0, dropout=0.1, marker=None):
    """Your own loop (raytrainer.train_loop): RegressionTask's model and data in a plain DDP
    loop, a state report every `state_every` steps and a metrics report every step. Dropout
    draws from a generator seeded by the step, so a step redone after a recovery draws the
    same numbers. `marker`: a path whose file, while it exists, holds each step for sleep_s
    (the test's window to kill a worker; deleted to let the run finish at full speed)."""
    task = RegressionTask(dropout=dropout)
    torch.manual_seed(ctx.seed)
    model = task.build_model()
    optimizer = task.build_optimizer(model)
    if ctx.state is not None:  # after a failure: the newest report every rank reached
        model.load_state_dict(ctx.state["model"])
        optimizer.load_state_dict(ctx.state["optimizer"])
    model = ctx.prepare_model(model)
    return _regression_steps(ctx, task, model, optimizer, steps, state_every, sleep_s, marker)


def sharded_regression_loop(ctx, steps=24, state_every=1, sleep_s=0.0, dropout=0.1, marker=None):
    """regression_loop as an FSDP loop (trainer.strategy fsdp) is written: ctx.prepare_model
    shards the model, the optimizer is built over its shards, and ctx.state (this rank's
    shards) is loaded into both."""
    task = RegressionTask(dropout=dropout)
    torch.manual_seed(ctx.seed)
    model = ctx.prepare_model(task.build_model())
    optimizer = task.build_optimizer(model)
    if ctx.state is not None:
        model.load_state_dict(ctx.state["model"])
        optimizer.load_state_dict(ctx.state["optimizer"])
    return _regression_steps(ctx, task, model, optimizer, steps, state_every, sleep_s, marker)


def _regression_steps(ctx, task, model, optimizer, steps, state_every, sleep_s, marker):
    import os
    import time

    data = task.train_dataset()
    sampler = ctx.sampler(data)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    step = ctx.step
    for epoch in range(sampler.epoch, 10**6):
        sampler.set_epoch(epoch)
        for x, y, _ in loader:
            torch.manual_seed(ctx.seed * 100_003 + step * 31 + ctx.rank)  # dropout's draws: by step and rank
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if marker and os.path.exists(marker):
                time.sleep(sleep_s)
            state = {"model": model, "optimizer": optimizer} if step % state_every == 0 else None
            ctx.report({"loss": loss, "step": step, "epoch": epoch, "started_at": ctx.step},
                       state=state)
            if step >= steps:
                return model


def nan_loss_loop(ctx, steps=6, nan_from=3):
    """Your own loop whose loss turns NaN at step `nan_from` and stays so."""
    model = ctx.prepare_model(torch.nn.Linear(2, 1))
    for step in range(ctx.step + 1, steps + 1):
        loss = model(torch.ones(1, 2)).sum() * (float("nan") if step >= nan_from else 1.0)
        ctx.report({"loss": loss, "step": step}, state={"model": model})
    return model


def gated_loop(ctx, loop, gate, hold_at, **args):
    """Your own loop `loop` ("module:function", called with `args`) whose reports from step
    `hold_at` on wait while the file `gate` exists: a test that kills a worker once an
    earlier step is in metrics.jsonl cannot find the run already over (the driver writes
    rows behind the workers, by seconds on a loaded machine); it deletes the gate after."""
    import importlib

    module, name = loop.split(":")
    report, reported = ctx.report, [ctx.step]

    def gated(metrics, *a, **k):
        reported[0] = int(metrics.get("step", reported[0] + 1))
        if reported[0] >= hold_at:
            _wait_while(gate, every_s=0.01)
        return report(metrics, *a, **k)

    ctx.report = gated
    return getattr(importlib.import_module(module), name)(ctx, **args)


class SequenceTask(Task):
    """Variable-length sequences (1-6 numbers) regressed to their mean: default_collate
    cannot stack them, so the task pads them in its collate (data.collate_fn: pad)."""

    def __init__(self, num_samples: int = 64, lr: float = 0.05, hidden: int = 8, scale: float | None = None,
                 sizes: list[int] | None = None, shuffle: bool = False, tag: str = ""):
        self.num_samples, self.lr, self.hidden = num_samples, lr, hidden
        # Not used in training: annotated arguments the config's task.args checks coerce.
        self.scale, self.sizes, self.shuffle, self.tag = scale, sizes, shuffle, tag

    def build_model(self):
        return torch.nn.Sequential(torch.nn.Linear(1, self.hidden), torch.nn.Tanh(), torch.nn.Linear(self.hidden, 1))

    def build_optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=self.lr)

    def train_dataset(self):
        g = torch.Generator().manual_seed(5)
        lengths = torch.randint(1, 7, (self.num_samples,), generator=g).tolist()
        return [torch.randn(n, generator=g) for n in lengths]

    def pad(self, samples):
        return pad_sequences(samples)

    def train_step(self, model, batch):
        x, mask = batch
        per_item = model(x.unsqueeze(-1)).squeeze(-1) * mask
        prediction = per_item.sum(1) / mask.sum(1)
        target = (x * mask).sum(1) / mask.sum(1)
        return {"loss": torch.nn.functional.mse_loss(prediction, target)}


def pad_sequences(samples):
    """(padded values, mask): data.collate_fn by import path, tests.tasks:pad_sequences."""
    x = torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)
    mask = torch.zeros_like(x)
    for i, sample in enumerate(samples):
        mask[i, : len(sample)] = 1.0
    return x, mask


class InheritedSequenceTask(SequenceTask):
    """Its __init__ is its base's: the driver's reading of the source cannot tell its
    annotations, the worker's class can."""


class _MLP(torch.nn.Module):
    """RegressionTask's MLP as a plain module: dynamo (torch 2.13) captures no graph from an
    nn.Sequential under a compiled DDP (it will not trace Sequential's generator), so a
    compiled run of the Sequential would test nothing."""

    def __init__(self, hidden):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class CompiledTask(RegressionTask):
    """RegressionTask with a model torch.compile captures whole (trainer.compile's tests)."""

    def build_model(self):
        return _MLP(self.hidden)
