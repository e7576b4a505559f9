"""`raytrainer bench`: raytrainer against raw torch DDP (the floor) and Ray Train (the peer).

Every contender trains the same job (an MLP regressing a fixed random linear map,
the same seeded data, global batch and per-epoch sample order, SGD, Gloo on CPU,
one intra-op thread per rank) in a fresh subprocess,

    python -m raytrainer.bench _contender NAME SPEC_JSON RESULT_JSON

so "process start to first finished step" includes everything a user waits for:
the interpreter, imports, starting Ray, starting the workers, forming the group.
Each contender records the wall-clock time at the end of every optimizer step on
rank 0 (raytrainer: the `time` of its metrics.jsonl rows), and every step's
metrics travel to the driver, so steps/s is measured with that cost included.

Repetitions are interleaved (raw, Ray Train, raytrainer, then rotated) so a
slow minute on the machine does not land on one contender. Medians are reported.

The worker-SIGKILL figures come from separate kill runs (scenario "kill", Ray Train
and raytrainer only: raw DDP has no recovery), so the start-up and steps/s runs stay
undisturbed; see _Killer for how the kill is delivered.

The input figures (scenario "input") train on a dataset whose every sample costs I/O
latency (a sleep) and some decoding CPU: raw DDP reads it with DataLoader(num_workers=k)
and the BatchPlan's micro-batch index lists as its batch_sampler, raytrainer with
`data.num_workers: k` (the same sampler, see input.py) and, in the same contender
process before that, with `data.num_workers: 0` (each sample read in the training thread).

The faults figures come from one raytrainer run with five faults (three single kills
and a freeze at random moments of a step, a double kill), each recovery's time and
steps lost, and whether its final weights are bit-identical to an undisturbed run's
(see the faults section below).

The grow figure comes from a run on a local multi-node Ray (ray.cluster_utils: one
1-CPU raylet per worker, on this machine) with max_workers one above --workers: a node
is added once training runs, and the pause is the gap between rank 0's last step at
the old size and its first at the new one (raytrainer only; see notes()).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from .errors import ConfigError, RaytrainerError
from .task import Task

CONTENDERS = ("raw", "ray_train", "raytrainer")
LABELS = {"raw": "raw DDP", "ray_train": "Ray Train", "raytrainer": "raytrainer"}
PACKAGE_ROOT = Path(__file__).resolve().parent.parent


class BenchError(RaytrainerError):
    """A contender failed or timed out; the message carries the tail of its log."""


# --------------------------------------------------------------------------- settings

@dataclass(kw_only=True)
class BenchSpec:
    workers: int = 2
    hidden: int = 256
    """Width of the MLP's hidden layers."""
    layers: int = 2
    """Number of hidden layers."""
    in_dim: int = 32
    global_batch_size: int = 64
    samples: int = 4096
    steps: int = 300
    """Optimizer steps for raw DDP and raytrainer."""
    ray_train_steps: int = 20
    """Ray Train's report() waits for its controller's 2 s poll, so it manages about
    0.5 steps/s; 300 steps would take 10 minutes per repetition for the same rate."""
    repetitions: int = 3
    warmup_fraction: float = 0.1
    """Leading share of the steps left out of steps/s (allocator, caches, first collectives)."""
    timeout_s: float = 600.0
    """Per contender run; a run past it is killed and the bench fails."""
    seed: int = 0
    checkpoint_mb: int = 64
    """Model size for the checkpoint-stall figures (optimizer state adds twice as much)."""
    kill_steps: int = 400
    """Optimizer steps of the kill runs (Ray Train and raytrainer alike)."""
    kill_step: int = 325
    """The last worker is SIGKILLed from outside once it starts this step: warm by then
    (raytrainer's warm spare has imported torch), and mid-way between two checkpoints."""
    kill_checkpoint_every: int = 50
    """Both contenders checkpoint every this many steps in the kill runs (Ray Train also
    reports only then: its report() costs about 2 s)."""
    grow_steps: int = 2000
    """Optimizer steps of the grow run; paced at 20 ms a step or more until the group has
    grown (adding a node takes seconds), then free."""
    input_steps: int = 150
    """Optimizer steps of the input runs with loader processes (raw DDP and raytrainer)."""
    input_steps_no_loaders: int = 40
    """Optimizer steps of raytrainer's input run with data.num_workers 0 (each is slow)."""
    input_workers: int = 4
    """Loader processes per rank in the input runs (raw DDP's DataLoader num_workers too)."""
    input_io_ms: float = 2.0
    """I/O latency of one sample in the input runs (a sleep: no CPU)."""
    input_decode_rounds: int = 4
    """Decoding CPU of one sample: 64x64 matrix products (about 15 us each on a laptop core)."""
    faults_workers: int = 3
    """Workers of the faults runs: 3, so that a double kill leaves a survivor holding the state."""
    faults_every: int = 1000
    """Steps between the faults of the faults run (the first at this step; the run is six
    times as long): enough for each recovery, and the warm spare after it, to be done
    before the next fault."""
    faults_step_timeout_s: float = 3.0
    """failure.step_timeout_s of the faults runs: how long a frozen worker goes unnoticed."""
    scenarios: str = "train,kill,stall,grow,input,faults"
    """Which measurements to run: train (start-up, steps/s), kill (worker SIGKILL),
    stall (checkpoint stall), grow (elastic grow by one worker), input (a slow dataset
    through loader processes), faults (five faults in one run, against an undisturbed
    one); comma-separated."""

    def __post_init__(self):
        for key in ("workers", "hidden", "layers", "in_dim", "global_batch_size", "samples",
                    "steps", "ray_train_steps", "repetitions", "checkpoint_mb", "kill_steps", "kill_step",
                    "kill_checkpoint_every", "grow_steps", "input_steps", "input_steps_no_loaders",
                    "input_workers", "faults_every"):
            if getattr(self, key) < 1:
                raise ConfigError(f"bench --{key.replace('_', '-')}={getattr(self, key)} must be >= 1")
        if self.input_io_ms < 0 or self.input_decode_rounds < 0:
            raise ConfigError("bench --input-io-ms and --input-decode-rounds must be >= 0")
        for key in ("steps", "ray_train_steps", "input_steps", "input_steps_no_loaders"):
            if getattr(self, key) < 2:
                raise ConfigError(f"bench --{key.replace('_', '-')} must be >= 2 to measure a rate")
        if self.global_batch_size % self.workers:
            raise ConfigError(
                f"bench --global-batch-size={self.global_batch_size} must be a multiple of "
                f"--workers={self.workers}"
            )
        if self.samples < self.global_batch_size:
            raise ConfigError(f"bench --samples={self.samples} must be >= --global-batch-size")
        if not 0 <= self.warmup_fraction < 1:
            raise ConfigError("bench warmup_fraction must be in [0, 1)")
        if self.timeout_s <= 0:
            raise ConfigError("bench --timeout-s must be > 0")
        if self.faults_workers < 3:
            raise ConfigError(f"bench --faults-workers={self.faults_workers} must be >= 3: a double kill "
                              "must leave a survivor")
        if self.faults_step_timeout_s <= 0:
            raise ConfigError("bench --faults-step-timeout-s must be > 0")
        unknown = set(self.scenario_list) - set(SCENARIOS)
        if unknown or not self.scenario_list:
            raise ConfigError(f"bench --scenarios={self.scenarios!r}: choose from {', '.join(SCENARIOS)}")
        if "kill" in self.scenario_list:
            if self.workers < 2:
                raise ConfigError("bench --scenarios kill needs --workers >= 2: a worker must survive")
            if not 1 < self.kill_step < self.kill_steps:
                raise ConfigError(f"bench --kill-step={self.kill_step} must be in (1, --kill-steps="
                                  f"{self.kill_steps})")

    @property
    def scenario_list(self) -> list[str]:
        return [s for s in self.scenarios.split(",") if s]

    def steps_for(self, contender: str) -> int:
        return self.ray_train_steps if contender == "ray_train" else self.steps


SCENARIOS = ("train", "kill", "stall", "grow", "input", "faults")
SMOKE = dict(steps=6, ray_train_steps=3, repetitions=1, samples=256, hidden=32, timeout_s=180.0,
             checkpoint_mb=4, kill_steps=24, kill_step=15, kill_checkpoint_every=10, input_steps=8,
             input_steps_no_loaders=3, input_workers=2, faults_every=250)


# --------------------------------------------------------------------------- the job

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


def make_optimizer(model):
    import torch

    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


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
        return make_optimizer(model)

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
            _arm_kill(self.spec, self._steps, torch.distributed.get_rank())
        if self.spec.get("pace_while") and os.path.exists(self.spec["pace_while"]):
            time.sleep(0.02)
        return {"loss": torch.nn.functional.mse_loss(model(x), y)}


# --------------------------------------------------------------------------- the kill
# The worker that is to die says so when it starts step `kill_step` (its pid, in a
# marker file); a thread in the contender's own process SIGKILLs it from outside at
# once, so the kill lands wherever the worker happens to be (mid-step, mid-collective),
# not at a clean step boundary as raytrainer's failure.chaos kill would.

def _arm_kill(spec: dict[str, Any], step: int, rank: int) -> None:
    marker = Path(spec["kill_marker"])
    if step != spec["kill_step"] or rank != spec["workers"] - 1 or marker.exists():
        return  # a replacement worker counts from 0 again: the marker makes it once per run
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "step": step, "rank": rank}))
    os.replace(tmp, marker)


class _Killer(threading.Thread):
    def __init__(self, marker: Path):
        super().__init__(daemon=True, name="bench-killer")
        self.marker = marker
        self.done = threading.Event()
        self.killed: dict[str, Any] | None = None

    def run(self) -> None:
        while not self.done.is_set():
            try:
                armed = json.loads(self.marker.read_text())
            except FileNotFoundError:
                time.sleep(0.001)
                continue
            at = time.time()
            os.kill(armed["pid"], signal.SIGKILL)
            self.killed = dict(armed, killed_at=at)
            return

    def result(self) -> dict[str, Any]:
        self.done.set()
        self.join()
        if self.killed is None:
            raise BenchError(f"the worker to kill never said it reached the kill step (no {self.marker})")
        return self.killed


def _kill_figures(killed: dict[str, Any], before: list[tuple[int, float]], after: list[tuple[int, float]],
                  resumed_from: int, reached: int = 0) -> dict[str, Any]:
    """The same arithmetic for both contenders: `before` and `after` are rank 0's (step, time)
    before the failure was handled and after training restarted; `reached`, a step known
    to have been finished before the failure though it has no row."""
    if not after:
        raise BenchError("no step finished after the kill")
    reached = max([reached] + [s for s, _ in before])
    return {"killed_at": killed["killed_at"], "kill_armed_step": killed["step"], "killed_pid": killed["pid"],
            "killed_rank": killed["rank"], "step_at_kill": reached, "resumed_from": resumed_from,
            "first_step_after": after[0][0],
            "kill_to_first_step_s": after[0][1] - killed["killed_at"],
            "steps_lost": max(0, reached - resumed_from)}


def _rank_batch(spec: dict[str, Any], x, y, step: int, rank: int, world: int):
    """This rank's share of optimizer step `step`: raytrainer's sample order, so all
    three contenders see the same samples in the same order."""
    from .data import BatchPlan

    per_rank = spec["global_batch_size"] // world
    plan = BatchPlan(spec["samples"], spec["global_batch_size"], per_rank, world, spec["seed"])
    epoch, in_epoch = divmod(step, plan.steps_per_epoch)
    (index,) = plan.micro_batches(epoch, in_epoch * plan.global_batch_size, rank)
    return x[index], y[index]


# --------------------------------------------------------------------------- contenders
# Each runs in its own process (see _contender_main) and returns a dict with
# "step_times" (wall clock after each optimizer step on rank 0) and "phases"
# (wall-clock marks for the profile of the start-up).

def _run_raw(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    import queue

    import torch.multiprocessing as mp

    from .dist import free_port

    phases = {"torch_imported": time.time()}
    ctx = mp.get_context("spawn")
    metrics = ctx.Queue()
    procs = mp.start_processes(_raw_worker, args=(spec, free_port(), metrics), nprocs=spec["workers"],
                               join=False, start_method="spawn")
    phases["workers_spawned"] = time.time()
    rows, done = [], False
    try:
        # The driver reads every step's loss as it arrives, as a real launcher's logger would.
        while not done:
            try:
                item = metrics.get(timeout=0.2)
            except queue.Empty:
                if procs.join(timeout=0):  # all exited without saying done: cannot happen unless killed
                    break
                continue
            if item[0] == "step":
                rows.append(item[1:])
            elif item[0] == "phase":
                phases[item[1]] = item[2]
            else:
                done = True
        while not procs.join(timeout=1):
            pass
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
                p.join()
    if not done:
        raise BenchError("raw DDP workers exited before finishing")
    return {"step_times": [t for _, _, t in rows], "last_loss": rows[-1][1], "phases": phases,
            "threads": phases.pop("threads", None)}


def _raw_worker(rank: int, spec: dict[str, Any], port: int, metrics) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    world = spec["workers"]
    torch.set_num_threads(1)  # as Ray does for a 1-CPU actor (OMP_NUM_THREADS=1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        if rank == 0:
            metrics.put(("phase", "group_formed", time.time()))
            metrics.put(("phase", "threads", torch.get_num_threads()))
        torch.manual_seed(spec["seed"])
        model = DistributedDataParallel(build_mlp(spec))
        optimizer = make_optimizer(model)
        for step, (xb, yb) in zip(range(spec["steps"]), _raw_batches(spec, rank, world)):
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if rank == 0:
                value = loss.item()
                metrics.put(("step", step + 1, value, time.time()))
        if rank == 0:
            metrics.put(("done",))
    finally:
        dist.destroy_process_group()


def _raw_batches(spec: dict[str, Any], rank: int, world: int):
    """This rank's batches, step after step: sliced from the tensors, or in the input
    scenario read by DataLoader(num_workers=k) processes (torch's default start method)
    with the BatchPlan's index lists as the batch_sampler."""
    if spec.get("scenario") != "input":
        x, y = make_data(spec)
        return (_rank_batch(spec, x, y, step, rank, world) for step in itertools.count())
    from torch.utils.data import DataLoader

    from .data import BatchPlan
    from .input import _PlanSampler

    per_rank = spec["global_batch_size"] // world
    sampler = _PlanSampler(BatchPlan(spec["samples"], spec["global_batch_size"], per_rank, world, spec["seed"]), rank)
    return iter(DataLoader(SlowSamples(spec), batch_sampler=sampler, num_workers=spec["input_workers"]))


def _input_raw(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    return _run_raw({**spec, "steps": spec["input_steps"]}, work)


def _input_raytrainer(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """With data.num_workers 0 first (the steps/s without loader processes), then with
    input_workers loader processes per rank: the run whose step times are reported."""
    none = _run_raytrainer({**spec, "steps": spec["input_steps_no_loaders"]}, work / "no-loaders",
                           {"num_workers": 0})
    out = _run_raytrainer({**spec, "steps": spec["input_steps"]}, work / "loaders",
                          {"num_workers": spec["input_workers"]})
    out["no_loaders_steps_per_s"] = _rate(none["step_times"], spec["warmup_fraction"])
    out["no_loaders_step_times"] = none["step_times"]
    return out


def _run_ray_train(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    phases = {"ray_train_imported": time.time()}
    ray.init(include_dashboard=False, logging_level="WARNING")
    phases["ray_started"] = time.time()
    try:
        times_file = work / "ray_train_steps.json"
        trainer = TorchTrainer(
            _ray_train_loop,
            train_loop_config={"spec": spec, "times_file": str(times_file)},
            scaling_config=ScalingConfig(num_workers=spec["workers"], use_gpu=False),
            run_config=RunConfig(name="bench", storage_path=str(work / "ray_train_storage")),
        )
        trainer.fit()
        out = json.loads(times_file.read_text())
        out["phases"].update(phases)
        return out
    finally:
        ray.shutdown()


def _ray_train_loop(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch
    import torch

    spec = config["spec"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    phases = {"loop_started": time.time()}
    torch.manual_seed(spec["seed"])
    model = ray.train.torch.prepare_model(build_mlp(spec))  # DDP over the group Ray Train formed
    optimizer = make_optimizer(model)
    x, y = make_data(spec)
    times, loss_value = [], None
    for step in range(spec["ray_train_steps"]):
        xb, yb = _rank_batch(spec, x, y, step, rank, world)
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        times.append(time.time())
        loss_value = loss.item()
        ray.train.report({"loss": loss_value, "step": step + 1})  # to the driver, every step
    if rank == 0:
        Path(config["times_file"]).write_text(json.dumps(
            {"step_times": times, "last_loss": loss_value, "phases": phases,
             "threads": torch.get_num_threads()}))


def _run_raytrainer(spec: dict[str, Any], work: Path, data: dict[str, Any] | None = None) -> dict[str, Any]:
    from .api import train

    config = {
        "task": {"target": "raytrainer.bench:BenchTask", "args": spec},
        "trainer": {"max_steps": spec["steps"], "global_batch_size": spec["global_batch_size"],
                    "seed": spec["seed"], "log_every_n_steps": 1},  # every step's metrics to the driver
        "scaling": {"num_workers": spec["workers"], "use_gpu": False, "backend": "gloo"},
        "data": data or {},
        "run": {"name": "bench", "storage": str(work)},
    }
    result = train(config, progress=False)
    rows = [r for r in result.history if "loss" in r]
    phases = {f"event_{e['event']}": e["time"] for e in result.events}
    return {"step_times": [r["time"] for r in rows], "last_loss": rows[-1]["loss"], "phases": phases,
            "run_dir": str(result.run_dir)}


def _kill_raytrainer(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """raytrainer with the last worker SIGKILLed at spec["kill_step"]; its default
    failure settings (warm spare) and a checkpoint every kill_checkpoint_every steps."""
    from .api import train

    marker = work / "kill-marker.json"
    config = {
        "task": {"target": "raytrainer.bench:BenchTask", "args": {**spec, "kill_marker": str(marker)}},
        "trainer": {"max_steps": spec["kill_steps"], "global_batch_size": spec["global_batch_size"],
                    "seed": spec["seed"], "log_every_n_steps": 1},
        "scaling": {"num_workers": spec["workers"], "use_gpu": False, "backend": "gloo"},
        "checkpoint": {"every_n_steps": spec["kill_checkpoint_every"], "async": True},
        "failure": {"max_failures": 1},
        "run": {"name": "bench-kill", "storage": str(work)},
    }
    killer = _Killer(marker)
    killer.start()
    try:
        result = train(config, progress=False)
    finally:
        killed = killer.result()
    rows = [(r["step"], r["time"]) for r in result.history if "loss" in r]
    failed = [e for e in result.events if e["event"] == "worker_failed"]
    recovered = [e for e in result.events if e["event"] == "recovered"]
    if len(recovered) != 1 or not failed:
        raise BenchError(f"expected one recovery after the kill; events: {result.events}")
    # The controller logs worker_failed once every worker has stopped, before it recovers.
    # A step the survivor finished as the peer died has no row (its metrics all-reduce
    # failed), but the controller counts it: resumed step + steps_lost is how far it got.
    handled, rec = failed[0]["time"], recovered[0]
    out = _kill_figures(killed, [r for r in rows if r[1] < handled], [r for r in rows if r[1] > handled],
                        rec["step"], reached=rec["step"] + rec["steps_lost"])
    out.update(step_times=[t for _, t in rows], last_loss=result.history[-1].get("loss"),
               phases={f"event_{e['event']}": e["time"] for e in result.events},
               recovered_event=recovered[0], worker_failed_event=failed[0], run_dir=str(result.run_dir))
    return out


def _kill_ray_train(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """Ray Train with FailureConfig(max_failures=1): it restarts the whole worker group
    and the loop resumes from the last reported checkpoint."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    phases = {"ray_train_imported": time.time()}
    marker = work / "kill-marker.json"
    rows_file = work / "ray_train_rows.jsonl"
    ray.init(include_dashboard=False, logging_level="WARNING")
    phases["ray_started"] = time.time()
    killer = _Killer(marker)
    killer.start()
    try:
        trainer = TorchTrainer(
            _ray_train_kill_loop,
            train_loop_config={"spec": {**spec, "kill_marker": str(marker)}, "rows_file": str(rows_file)},
            scaling_config=ScalingConfig(num_workers=spec["workers"], use_gpu=False),
            run_config=RunConfig(name="bench-kill", storage_path=str(work / "ray_train_storage"),
                                 failure_config=FailureConfig(max_failures=1)),
        )
        trainer.fit()
    finally:
        killed = killer.result()
        ray.shutdown()
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    # An attempt is a worker process: the restart replaces them all.
    first = [(r["step"], r["time"]) for r in rows if r["pid"] == rows[0]["pid"]]
    again = [(r["step"], r["time"]) for r in rows if r["pid"] != rows[0]["pid"]]
    if not again:
        raise BenchError("Ray Train did not restart after the kill")
    out = _kill_figures(killed, first, again, rows[-1]["resumed_from"])
    out.update(step_times=[r["time"] for r in rows], last_loss=rows[-1]["loss"], phases=phases)
    return out


def _ray_train_kill_loop(config: dict[str, Any]) -> None:
    import tempfile

    import ray.train
    import ray.train.torch
    import torch

    spec = config["spec"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(spec["seed"])
    model = ray.train.torch.prepare_model(build_mlp(spec))
    optimizer = make_optimizer(model)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d) / "state.pt", weights_only=True)
        getattr(model, "module", model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    x, y = make_data(spec)
    every = spec["kill_checkpoint_every"]
    with open(config["rows_file"], "a") as rows:
        for step in range(start, spec["kill_steps"]):
            _arm_kill(spec, step + 1, rank)
            xb, yb = _rank_batch(spec, x, y, step, rank, world)
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if rank == 0:  # flushed every step: the rows of the attempt that dies must survive it
                rows.write(json.dumps({"step": step + 1, "time": time.time(), "loss": loss.item(),
                                       "resumed_from": start, "pid": os.getpid()}) + "\n")
                rows.flush()
            if (step + 1) % every == 0 or step + 1 == spec["kill_steps"]:
                metrics = {"loss": loss.item(), "step": step + 1}
                if rank == 0:
                    with tempfile.TemporaryDirectory() as d:
                        torch.save({"model": getattr(model, "module", model).state_dict(),
                                    "optimizer": optimizer.state_dict(), "step": step + 1}, Path(d) / "state.pt")
                        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
                else:
                    ray.train.report(metrics)


def _grow_raytrainer(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """raytrainer on a local multi-node Ray of `workers` 1-CPU nodes, max_workers one more:
    a node is added once training runs; the figure is rank 0's gap between its last step
    at the old world size and its first at the new one."""
    import ray
    from ray.cluster_utils import Cluster

    from .api import train

    os.makedirs("/tmp/ray", exist_ok=True)  # Cluster writes its head's address there
    temp_dir = tempfile.mkdtemp(prefix="rtb-", dir="/tmp")  # short: Ray's sockets live under it
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "temp_dir": temp_dir})
    pace = work / "pace"
    pace.touch()
    run_dir = work / "bench-grow"
    config = {
        "task": {"target": "raytrainer.bench:BenchTask", "args": {**spec, "pace_while": str(pace)}},
        "trainer": {"max_steps": spec["grow_steps"], "global_batch_size": spec["global_batch_size"],
                    "seed": spec["seed"], "log_every_n_steps": 1},
        "scaling": {"num_workers": spec["workers"], "max_workers": spec["workers"] + 1, "use_gpu": False,
                    "backend": "gloo"},
        "run": {"name": run_dir.name, "storage": str(work)},
    }
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["result"] = train(config, progress=False)
        except BaseException as exc:  # noqa: BLE001 - raised below, in this thread
            out["error"] = exc

    def read(name: str) -> list[dict[str, Any]]:
        path = run_dir / name
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def resized() -> list[dict[str, Any]]:
        return [e for e in read("events.jsonl") if e["event"] == "resized"]

    try:
        for _ in range(spec["workers"]):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING")
        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        while thread.is_alive() and not read("metrics.jsonl"):
            time.sleep(0.1)  # until training runs
        added = time.time()
        cluster.add_node(num_cpus=1)
        while thread.is_alive() and not resized():
            time.sleep(0.1)
        pace.unlink()
        thread.join()
    finally:
        ray.shutdown()
        cluster.shutdown()
    if "error" in out:
        raise out["error"]
    result = out["result"]
    rows = [r for r in result.history if "loss" in r]
    events = resized()
    if not events or events[0]["new_world_size"] != spec["workers"] + 1:
        raise BenchError(f"the group did not grow; events: {result.events}")
    old = [r for r in rows if r["world_size"] == spec["workers"]]
    new = [r for r in rows if r["world_size"] == spec["workers"] + 1]
    gaps = [b["time"] - a["time"] for a, b in zip(old, old[1:])]
    return {"step_times": [r["time"] for r in rows], "last_loss": rows[-1]["loss"],
            "phases": {f"event_{e['event']}": e["time"] for e in result.events},
            # The gap beyond an ordinary (paced) step: what the resize cost training.
            "grow_pause_s": new[0]["time"] - old[-1]["time"] - statistics.median(gaps),
            "paced_step_s": statistics.median(gaps),
            "node_added_to_resized_s": events[0]["time"] - added, "resized_event": events[0],
            "run_dir": str(result.run_dir)}


# --------------------------------------------------------------------------- faults
# One raytrainer run with five faults, `faults_every` steps apart so that each recovery
# (and the warm spare it uses up) is done before the next, beside an undisturbed run of
# the same config (same seed, same world size) in the same contender process, on the
# same Ray: the faulted run must end with bit-identical weights. The single kills and
# the freeze are failure.chaos faults with at=random: a timer thread in the worker fires
# at a seeded random moment of the step (forward, backward, a collective, the
# optimizer), and the worker's own code does not know. The double kill comes from
# outside: a thread here SIGKILLs two workers by pid, DOUBLE_KILL_GAP_S apart, once
# metrics.jsonl shows the step, so the second lands while the first recovery is under way.

FAULTS = (("kill", (0,)), ("kill", (-1,)), ("freeze", (1,)), ("double_kill", (1, -1)), ("kill", (-1,)))
"""(kind, ranks) of each fault in order; rank -1 is the last one."""
FAULT_TITLES = {"kill": "SIGKILL of {} at a random moment of a step",
                "freeze": "SIGSTOP of {} at a random moment of a step",
                "double_kill": "SIGKILL of {}, 0.3 s apart, from outside"}
DOUBLE_KILL_GAP_S = 0.3
FAULTS_COLLECTIVE_TIMEOUT_S = 30.0
"""failure.collective_timeout_s of the faults runs (default 600 s): it bounds whatever else
nothing catches. Before the driver killed a survivor still waiting in a Gloo collective
that its surviving peers had left, that wait lasted this long (5 of 7 runs with 3 workers
while this scenario was built); 30 s keeps any such stall visible as a slow recovery in
the figures instead of timing the contender out."""
RECOVERY_GOAL_S = 3.0
"""Every recovery: fault to the first step after it (a freeze: plus step_timeout_s)."""


def fault_plan(spec: dict[str, Any]) -> list[dict[str, Any]]:
    world = spec["faults_workers"]
    return [{"fault": kind, "step": (i + 1) * spec["faults_every"], "ranks": [r % world for r in ranks]}
            for i, (kind, ranks) in enumerate(FAULTS)]


def _faults_config(spec: dict[str, Any], work: Path, name: str, chaos: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "task": {"target": "raytrainer.bench:BenchTask", "args": spec},
        "trainer": {"max_steps": (len(FAULTS) + 1) * spec["faults_every"],
                    "global_batch_size": spec["global_batch_size"], "seed": spec["seed"],
                    "log_every_n_steps": 1},
        "scaling": {"num_workers": spec["faults_workers"], "use_gpu": False, "backend": "gloo"},
        # Room for every fault's failures and two more: an extra one is reported, not fatal.
        "failure": {"chaos": chaos, "step_timeout_s": spec["faults_step_timeout_s"],
                    "max_failures": sum(len(r) for _, r in FAULTS) + 2,
                    "collective_timeout_s": FAULTS_COLLECTIVE_TIMEOUT_S},
        "run": {"name": name, "storage": str(work)},
    }


class _DoubleKiller(threading.Thread):
    """SIGKILLs the workers of `ranks`, `gap_s` apart, once a training row at or after
    `step` is in the run's metrics.jsonl (pids: the newest event that lists them)."""

    def __init__(self, run_dir: Path, step: int, ranks: list[int], gap_s: float):
        super().__init__(daemon=True, name="bench-double-killer")
        self.run_dir, self.step, self.ranks, self.gap_s = run_dir, step, ranks, gap_s
        self.done = threading.Event()
        self.killed: dict[str, Any] | None = None

    def run(self) -> None:
        offset, tail = 0, ""
        while not self.done.is_set():
            try:
                with open(self.run_dir / "metrics.jsonl") as f:
                    f.seek(offset)
                    chunk = f.read()
                    offset = f.tell()
            except FileNotFoundError:
                chunk = ""
            *lines, tail = (tail + chunk).split("\n")
            seen = [row["step"] for row in map(json.loads, lines) if "loss" in row]
            if seen and max(seen) >= self.step:
                events = [json.loads(line) for line in (self.run_dir / "events.jsonl").read_text().splitlines()]
                pids = next(e["pids"] for e in reversed(events) if "pids" in e)
                times = []
                for i, rank in enumerate(self.ranks):
                    if i:
                        time.sleep(self.gap_s)
                    times.append(time.time())
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pids[rank], signal.SIGKILL)
                self.killed = {"step_seen": max(seen), "pids": [pids[r] for r in self.ranks], "killed_at": times}
                return
            time.sleep(0.005)

    def result(self) -> dict[str, Any] | None:
        self.done.set()
        self.join()
        return self.killed


def _faults_raytrainer(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """The undisturbed run, then the faulted one, on one local Ray; the figures of each
    recovery and whether the two runs' final weights are bit-identical."""
    import ray
    import torch

    from .api import train

    plan = fault_plan(spec)
    chaos = [{"action": f["fault"], "step": f["step"], "rank": f["ranks"][0], "at": "random"}
             for f in plan if f["fault"] != "double_kill"]
    (double,) = [f for f in plan if f["fault"] == "double_kill"]
    loads: list[tuple[float, float]] = []  # (time, 1-minute load average): the machine is shared
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(1.0):
            loads.append((time.time(), os.getloadavg()[0]))

    threading.Thread(target=sample, daemon=True, name="bench-load").start()
    ray.init(num_cpus=spec["faults_workers"], include_dashboard=False, logging_level="WARNING")
    try:
        base = train(_faults_config(spec, work, "bench-undisturbed", []), progress=False)
        run_dir = work / "bench-faults"
        killer = _DoubleKiller(run_dir, double["step"], double["ranks"], DOUBLE_KILL_GAP_S)
        killer.start()
        try:
            result = train(_faults_config(spec, work, run_dir.name, chaos), progress=False)
        finally:
            killed = killer.result()
    finally:
        ray.shutdown()
        sampling.set()
    if any(e["event"] == "worker_failed" for e in base.events):
        raise BenchError(f"the undisturbed run had a failure; events: {base.events}")
    if killed is None:
        raise BenchError(f"the double kill never fired (step {double['step']} not seen)")
    double["killed_at"] = killed["killed_at"]
    a, b = (torch.load(r.run_dir / "model.pt", weights_only=True) for r in (base, result))
    identical = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [(r["step"], r["time"]) for r in result.history if "loss" in r]
    return {"step_times": [t for _, t in rows], "last_loss": result.history[-1].get("loss"),
            "phases": {f"event_{e['event']}": e["time"] for e in result.events},
            "faults": plan, "step_timeout_s": spec["faults_step_timeout_s"],
            "recoveries": _recoveries(plan, result.events, rows, spec["faults_step_timeout_s"], loads),
            "load_samples": loads,
            "failures": sum(e["event"] == "worker_failed" for e in result.events),
            "bit_identical": identical,
            "max_abs_diff": 0.0 if identical else max(
                (float((a[k].float() - b[k].float()).abs().max()) for k in a if k in b), default=float("nan")),
            "undisturbed_run_dir": str(base.run_dir), "run_dir": str(result.run_dir)}


def _recoveries(plan: list[dict[str, Any]], events: list[dict[str, Any]], rows: list[tuple[int, float]],
                step_timeout_s: float, loads: list[tuple[float, float]] = ()) -> list[dict[str, Any]]:
    """One entry per `recovered` event, with the fault it followed (the last one planned at
    or before the step it resumed from + 1), its worker_failed events, and times from the
    fault: its moment is the kill's for an outside kill; for a chaos fault, which no event
    records (the worker dies or stops as it fires), the time of rank 0's last step before
    the failure (the fault is at most about one step later: these times are upper bounds)."""
    out, failed, handled = [], [], set()
    for event in events:
        if event["event"] == "worker_failed":
            failed.append(event)
        if event["event"] != "recovered":
            continue
        index = max((i for i, f in enumerate(plan) if f["step"] <= event["step"] + 1), default=None)
        fault = plan[index] if index is not None and index not in handled else None
        handled.add(index)
        if fault is not None and "killed_at" in fault:
            fault_at, source = fault["killed_at"][0], "the first os.kill"
        else:
            fault_at = max((t for _, t in rows if t < failed[0]["time"]), default=None)
            source = "rank 0's last step before the failure"
        first_after = min((t for _, t in rows if t > event["time"]), default=None)
        kind = fault["fault"] if fault else "unplanned"
        goal_s = RECOVERY_GOAL_S + (step_timeout_s if kind == "freeze" else 0)
        to_first = first_after - fault_at if first_after is not None and fault_at is not None else None
        out.append({
            "fault": kind, "fault_index": index if fault else None, "fault_step": fault and fault["step"],
            "fault_ranks": fault and fault["ranks"], "fault_at": fault_at, "fault_at_from": source,
            "failed": [{k: f.get(k) for k in ("rank", "kind", "step", "time")} for f in failed],
            # The controller starts recovering (the `recovered` event's seconds count from
            # then) as soon as it sees the failure; worker_failed is logged later, once every
            # worker has stopped.
            "detect_s": event["time"] - event["seconds"] - fault_at if fault_at is not None else None,
            "failure_logged_s": failed[0]["time"] - fault_at if fault_at is not None else None,
            "seconds": event["seconds"], "steps_lost": event["steps_lost"], "attempts": event["attempts"],
            "failures": event["failures"], "step": event["step"], "source_rank": event.get("source_rank"),
            "state_from": event.get("state_from"), "replaced": event.get("replaced"),
            "fault_to_first_step_s": to_first, "goal_s": goal_s,
            "load": min(loads, key=lambda tl: abs(tl[0] - event["time"]))[1] if loads else None,
            "goal_met": to_first is not None and to_first <= goal_s and event["steps_lost"] <= 1})
        failed = []
    return out


RUNNERS: dict[str, Callable[[dict[str, Any], Path], dict[str, Any]]] = {
    "raw": _run_raw, "ray_train": _run_ray_train, "raytrainer": _run_raytrainer,
}
KILL_RUNNERS: dict[str, Callable[[dict[str, Any], Path], dict[str, Any]]] = {
    "ray_train": _kill_ray_train, "raytrainer": _kill_raytrainer,
}
GROW_RUNNERS: dict[str, Callable[[dict[str, Any], Path], dict[str, Any]]] = {"raytrainer": _grow_raytrainer}
INPUT_RUNNERS: dict[str, Callable[[dict[str, Any], Path], dict[str, Any]]] = {
    "raw": _input_raw, "raytrainer": _input_raytrainer,
}
FAULTS_RUNNERS: dict[str, Callable[[dict[str, Any], Path], dict[str, Any]]] = {"raytrainer": _faults_raytrainer}


def _contender_main(name: str, spec_json: str, result_path: str) -> int:
    # SIGTERM from the parent (timeout, Ctrl-C) unwinds through the finally blocks
    # above, so the Ray this process started is shut down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    entered = time.time()  # the interpreter is up and raytrainer imported
    spec = json.loads(spec_json)
    work = Path(result_path).parent / f"{name}-work"
    work.mkdir(parents=True, exist_ok=True)
    runners = {"kill": KILL_RUNNERS, "grow": GROW_RUNNERS, "input": INPUT_RUNNERS,
               "faults": FAULTS_RUNNERS}.get(spec.get("scenario"), RUNNERS)
    out = runners[name](spec, work)
    out["phases"]["contender_main"] = entered
    Path(result_path).write_text(json.dumps(out))
    return 0


# --------------------------------------------------------------------------- figures

@dataclass(frozen=True)
class Figure:
    key: str
    title: str
    unit: str
    better: str  # "lower" | "higher"
    contenders: tuple[str, ...]
    extract: Callable[[dict[str, Any]], float | None]
    """Value of one contender run (None: the run does not measure it)."""
    target: str | None = None
    target_check: Callable[[dict[str, float], dict[str, float]], bool] | None = None
    """(medians, ratios) -> met; not called while a value it reads is missing."""
    scenario: str = "train"
    """The measurement that produces it (BenchSpec.scenarios)."""
    met_in_run: Callable[[dict[str, Any]], bool] | None = None
    """Whether one run met the target, where the target holds for every run (not for the
    median): target_met is then whether all did, and met_runs says how many."""
    fmt: Callable[[float], str] | None = None
    """How the table shows a value, if not as a number."""


def _start_to_first_step(run: dict[str, Any]) -> float | None:
    if "step_times" not in run or run.get("scenario", "train") != "train":
        return None  # not a plain training run (a kill run, the checkpoint-stall measurement)
    return run["step_times"][0] - run["launched"]


def _steady_steps_per_s(run: dict[str, Any]) -> float | None:
    if "step_times" not in run or run.get("scenario", "train") != "train":
        return None
    return _rate(run["step_times"], run["warmup_fraction"])


def _rate(times: list[float], warmup_fraction: float) -> float:
    """Steps/s over the step times, less the leading warm-up share."""
    skip = min(int(len(times) * warmup_fraction), len(times) - 2)
    window = times[skip:]
    return (len(window) - 1) / max(window[-1] - window[0], 1e-9)


def _input_steps_per_s(run: dict[str, Any]) -> float | None:
    if run.get("scenario") != "input":
        return None
    return _rate(run["step_times"], run["warmup_fraction"])


def _loader_speedup(run: dict[str, Any]) -> float | None:
    if run.get("scenario") != "input" or "no_loaders_steps_per_s" not in run:
        return None
    return _input_steps_per_s(run) / run["no_loaders_steps_per_s"]


def _recovery_of(run: dict[str, Any], fault: int) -> dict[str, Any] | None:
    """The recovery that followed fault `fault` of a faults run (None: none did, or not a faults run)."""
    return next((r for r in run.get("recoveries", ()) if r["fault_index"] == fault), None)


def _fault_figures(i: int, kind: str, ranks: tuple[int, ...]) -> tuple[Figure, Figure]:
    who = " and ".join("the last rank" if r == -1 else f"rank {r}" for r in ranks)
    name = f"fault {i + 1} ({FAULT_TITLES[kind].format(who)})"

    def value(key: str) -> Callable[[dict[str, Any]], float | None]:
        return lambda run: (rec := _recovery_of(run, i)) and rec[key]

    return (
        Figure(f"fault_{i + 1}_to_first_step_s", f"{name}: fault to first step after recovery", "s", "lower",
               ("raytrainer",), value("fault_to_first_step_s"),
               target="<= step_timeout_s + 3 s" if kind == "freeze" else "<= 3 s",
               met_in_run=lambda run: (r := _recovery_of(run, i))["fault_to_first_step_s"] <= r["goal_s"],
               scenario="faults"),
        Figure(f"fault_{i + 1}_steps_lost", f"{name}: steps lost", "steps", "lower", ("raytrainer",),
               value("steps_lost"), target="<= 1 step", met_in_run=lambda run: _recovery_of(run, i)["steps_lost"] <= 1,
               scenario="faults"),
    )


FIGURES = (
    Figure("start_to_first_step_s", "process start to first finished step", "s", "lower",
           CONTENDERS, _start_to_first_step, target="<= 1.5x raw DDP",
           target_check=lambda m, r: r["raytrainer/raw"] <= 1.5),
    Figure("steps_per_s", "steady-state steps/s, metrics to the driver every step", "steps/s",
           "higher", CONTENDERS, _steady_steps_per_s, target=">= 0.95x raw DDP",
           target_check=lambda m, r: r["raytrainer/raw"] >= 0.95),
    # Raw DDP has no recovery: a lost worker ends its run (its column shows "-").
    Figure("kill_to_first_step_s", "worker SIGKILL to first step after recovery", "s", "lower",
           ("ray_train", "raytrainer"), lambda run: run.get("kill_to_first_step_s"),
           target="<= 5 s and <= 0.25x Ray Train",
           target_check=lambda m, r: m["raytrainer"] <= 5 and r["raytrainer/ray_train"] <= 0.25,
           scenario="kill"),
    Figure("steps_lost", "steps lost to a worker SIGKILL", "steps", "lower",
           ("ray_train", "raytrainer"), lambda run: run.get("steps_lost"), target="<= 1",
           target_check=lambda m, r: m["raytrainer"] <= 1, scenario="kill"),
    # Ray Train's resize restarts its whole group from the last checkpoint: see figure 3.
    Figure("grow_pause_s", "pause to grow the group by one worker", "s", "lower",
           ("raytrainer",), lambda run: run.get("grow_pause_s"), scenario="grow"),
    Figure("input_steps_per_s", "steps/s on a slow dataset (I/O + decode per sample), k loader processes",
           "steps/s", "higher", ("raw", "raytrainer"), _input_steps_per_s, target=">= 0.95x raw DDP",
           target_check=lambda m, r: r["raytrainer/raw"] >= 0.95, scenario="input"),
    Figure("input_loader_speedup", "raytrainer steps/s on it, k loader processes over data.num_workers 0",
           "x", "higher", ("raytrainer",), _loader_speedup, target=">= 3x",
           target_check=lambda m, r: m["raytrainer"] >= 3, scenario="input"),
    Figure("checkpoint_stall_sync_s", "training stall per checkpoint, sync", "s", "lower",
           ("raytrainer",), lambda run: run.get("checkpoint_stall_sync_s"), scenario="stall"),
    Figure("checkpoint_stall_async_s", "training stall per checkpoint, async", "s", "lower",
           ("raytrainer",), lambda run: run.get("checkpoint_stall_async_s"), scenario="stall"),
    *(fig for i, (kind, ranks) in enumerate(FAULTS) for fig in _fault_figures(i, kind, ranks)),
    Figure("faults_bit_identical", "final weights of the faulted run against an undisturbed one",
           "bit-identical", "higher", ("raytrainer",),
           lambda run: float(run["bit_identical"]) if "bit_identical" in run else None,
           target="bit-identical", met_in_run=lambda run: run["bit_identical"], scenario="faults",
           fmt=lambda v: "yes" if v == 1 else "no"),
)

FIGURE_BY_KEY = {fig.key: fig for fig in FIGURES}


def measure_checkpoint_stall(model_mb: int, work: Path) -> dict[str, Any]:
    """How long a training step is blocked by one checkpoint of a model of `model_mb` MB
    with Adam-like optimizer state: the whole write when synchronous, the copy off the
    device when asynchronous (measured with the previous write finished, as in training)."""
    import torch

    from .checkpoint import AsyncWriter, Checkpoints, Storage, to_cpu
    from .config import CheckpointConfig

    n = model_mb * 2**20 // 4
    gen = torch.Generator().manual_seed(0)
    state = {"model": {"w": torch.randn(n, generator=gen)},
             "optimizer": {"exp_avg": torch.randn(n, generator=gen), "exp_avg_sq": torch.rand(n, generator=gen)}}
    ckpts = Checkpoints(Storage(str(work)), "stall", CheckpointConfig(keep_last=1))
    errors: list[BaseException] = []
    writer = AsyncWriter(ckpts, lambda committed: None, errors.append)
    t0 = time.perf_counter()
    ckpts.write(1, state, {})
    sync = time.perf_counter() - t0
    t0 = time.perf_counter()
    writer.submit(2, to_cpu(state), {})
    stall = time.perf_counter() - t0
    writer.wait()
    if errors:
        raise BenchError(f"the asynchronous checkpoint write failed: {errors[0]}")
    return {"contender": "raytrainer", "checkpoint_stall_sync_s": sync, "checkpoint_stall_async_s": stall,
            "checkpoint_bytes": ckpts.committed()[-1].manifest["files"]["state.pt"]["size"]}


def summarize(runs: list[dict[str, Any]], scenarios: list[str] | None = None) -> list[dict[str, Any]]:
    """One entry per figure: per-contender values and medians, ratios, target. Figures of a
    scenario not in `scenarios` (all, if None) are "not measured (not run)"."""
    out = []
    for fig in FIGURES:
        entry: dict[str, Any] = {"key": fig.key, "title": fig.title, "unit": fig.unit,
                                 "better": fig.better, "contenders": list(fig.contenders),
                                 "target": fig.target}
        if scenarios is not None and fig.scenario not in scenarios:
            entry.update(status="not measured", reason=f"not run: --scenarios {fig.scenario}", values=None,
                         medians=None, ratios=None, target_met=None)
            out.append(entry)
            continue
        values = {c: [v for r in runs if r["contender"] == c and (v := fig.extract(r)) is not None]
                  for c in fig.contenders}
        medians = {c: statistics.median(v) for c, v in values.items() if v}
        ratios = {f"raytrainer/{c}": medians["raytrainer"] / medians[c]
                  for c in fig.contenders if c != "raytrainer" and medians.get(c)}
        try:
            met = fig.target_check(medians, ratios) if fig.target_check else None
        except KeyError:  # a contender is missing (or its median is 0 and has no ratio)
            met = None
        if fig.met_in_run is not None:
            flags = [fig.met_in_run(r) for r in runs if r.get("scenario") == fig.scenario
                     and r.get("contender") == "raytrainer" and fig.extract(r) is not None]
            met = all(flags) if flags else None
            entry["met_runs"] = [sum(flags), len(flags)]
        entry.update(status="measured", values=values, medians=medians, ratios=ratios, target_met=met)
        out.append(entry)
    return out


# --------------------------------------------------------------------------- driver

def _launch(name: str, spec: BenchSpec, rep: int, tmp: Path, scenario: str = "train") -> dict[str, Any]:
    """Run one contender in a fresh process; return its result with the launch time."""
    result_path = tmp / (f"{name}-{rep}" if scenario == "train" else f"{name}-{scenario}-{rep}") / "result.json"
    result_path.parent.mkdir(parents=True)
    log_path = result_path.parent / "log.txt"
    env = dict(os.environ)
    # Workers (spawned or Ray actors) must import this raytrainer, whatever else is installed.
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Each contender starts a Ray of its own (what the start-up figure measures), never one
    # it finds running on the machine; the grow scenario names its cluster's address.
    env["RAY_ADDRESS"] = "local"
    cmd = [sys.executable, "-m", "raytrainer.bench", "_contender", name,
           json.dumps({**asdict(spec), "scenario": scenario}), str(result_path)]
    # Other work on the machine skews every figure: keep the load next to each run.
    load_before = os.getloadavg()[0]
    with open(log_path, "w") as log:
        launched = time.time()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=str(result_path.parent), start_new_session=True)
        try:
            rc = proc.wait(timeout=spec.timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:  # also on Ctrl-C: stop it and everything it started
            _stop(proc)
    if rc != 0 or not result_path.exists():
        why = f"timed out after {spec.timeout_s:g} s" if rc is None else f"exited with status {rc}"
        tail = log_path.read_text()[-3000:]
        raise BenchError(f"bench contender {LABELS[name]} {why}; the end of its log "
                         f"({log_path}):\n{tail}")
    result = json.loads(result_path.read_text())
    if not result.get("step_times"):
        raise BenchError(f"bench contender {LABELS[name]} recorded no step")
    result.update(contender=name, scenario=scenario, repetition=rep, launched=launched,
                  load_before=load_before, warmup_fraction=spec.warmup_fraction)
    return result


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the contender's session (it shuts its Ray down), then SIGKILL what is left."""
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return  # the whole session is gone
        if proc.poll() is None:
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        else:
            # The contender exited but something it started may linger in its session.
            time.sleep(0.2 if sig == signal.SIGTERM else 0)


def machine() -> dict[str, Any]:
    import ray
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "os": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "ray": ray.__version__,
            "ray_train_v2": os.environ.get("RAY_TRAIN_V2_ENABLED", "1 (default)")}


def run_bench(spec: BenchSpec, *, out: str | Path | None = None, log: Callable[[str], None] = print,
              keep_in: str | Path | None = None) -> dict[str, Any]:
    """Run every contender `spec.repetitions` times, interleaved; return (and write) the report.

    The contenders' logs and run directories go to a temporary directory, or are
    kept in `keep_in` (raytrainer's run directory is then in each run's "run_dir")."""
    started = time.time()
    with (contextlib.nullcontext(str(keep_in)) if keep_in is not None
          else tempfile.TemporaryDirectory(prefix="raytrainer-bench-")) as tmp:
        runs = []
        for rep in range(spec.repetitions):
            order = CONTENDERS[rep % 3:] + CONTENDERS[:rep % 3]  # rotate: no contender always first
            scenarios = spec.scenario_list
            for name in order if "train" in scenarios else ():
                log(f"bench: repetition {rep + 1}/{spec.repetitions}: {LABELS[name]} ...")
                run = _launch(name, spec, rep, Path(tmp))
                log(f"bench:   first step after {_start_to_first_step(run):.2f} s, "
                    f"{_steady_steps_per_s(run):.1f} steps/s")
                if keep_in is None:
                    run.pop("run_dir", None)  # about to be deleted
                runs.append(run)
            for name in [c for c in order if c in KILL_RUNNERS] if "kill" in scenarios else ():
                log(f"bench: repetition {rep + 1}/{spec.repetitions}: {LABELS[name]}, worker SIGKILL "
                    f"at step {spec.kill_step} of {spec.kill_steps} ...")
                run = _launch(name, spec, rep, Path(tmp), scenario="kill")
                log(f"bench:   step {run['step_at_kill']} reached, resumed from {run['resumed_from']}, "
                    f"first step {run['kill_to_first_step_s']:.2f} s after the kill")
                if keep_in is None:
                    run.pop("run_dir", None)
                runs.append(run)
            if "grow" in scenarios:
                log(f"bench: repetition {rep + 1}/{spec.repetitions}: raytrainer, a node joins, "
                    f"{spec.workers} -> {spec.workers + 1} workers ...")
                run = _launch("raytrainer", spec, rep, Path(tmp), scenario="grow")
                log(f"bench:   training paused {run['grow_pause_s']:.2f} s, "
                    f"{run['node_added_to_resized_s']:.1f} s after the node was added")
                if keep_in is None:
                    run.pop("run_dir", None)
                runs.append(run)
            for name in [c for c in order if c in INPUT_RUNNERS] if "input" in scenarios else ():
                log(f"bench: repetition {rep + 1}/{spec.repetitions}: {LABELS[name]}, a slow dataset, "
                    f"{spec.input_workers} loader processes per rank ...")
                run = _launch(name, spec, rep, Path(tmp), scenario="input")
                extra = (f" ({run['no_loaders_steps_per_s']:.1f} with data.num_workers 0)"
                         if "no_loaders_steps_per_s" in run else "")
                log(f"bench:   {_input_steps_per_s(run):.1f} steps/s{extra}")
                if keep_in is None:
                    run.pop("run_dir", None)
                runs.append(run)
            if "faults" in scenarios:
                log(f"bench: repetition {rep + 1}/{spec.repetitions}: raytrainer, {spec.faults_workers} workers, "
                    f"an undisturbed run, then one with {len(FAULTS)} faults {spec.faults_every} steps apart ...")
                run = _launch("raytrainer", spec, rep, Path(tmp), scenario="faults")
                for line in recovery_lines(run):
                    log(f"bench:   {line}")
                if keep_in is None:
                    run.pop("run_dir", None)
                    run.pop("undisturbed_run_dir", None)
                runs.append(run)
            if "stall" in scenarios:
                log(f"bench: repetition {rep + 1}/{spec.repetitions}: checkpoint stall, "
                    f"{spec.checkpoint_mb} MB model ...")
                runs.append({**measure_checkpoint_stall(spec.checkpoint_mb, Path(tmp) / f"stall-{rep}"),
                             "scenario": "stall"})
    report = {
        "command": " ".join(["raytrainer bench", *_spec_args(spec)]),
        "machine": machine(),
        "settings": asdict(spec),
        "contenders": LABELS,
        "figures": summarize(runs, spec.scenario_list),
        "notes": notes(spec),
        "runs": runs,
        "seconds": round(time.time() - started, 1),
    }
    if out is not None:
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _spec_args(spec: BenchSpec) -> list[str]:
    default = BenchSpec()
    return [f"--{k.replace('_', '-')} {v}" for k, v in asdict(spec).items()
            if v != getattr(default, k) and k != "warmup_fraction"]


# --------------------------------------------------------------------------- the table

def notes(spec: BenchSpec) -> list[str]:
    """How the figures were measured, where the table alone cannot say."""
    out = []
    if "kill" in spec.scenario_list:
        out.append(
            f"Kill runs: {spec.kill_steps} steps each; the last rank is SIGKILLed from outside (os.kill "
            f"of its pid by the contender's process) as soon as it starts step {spec.kill_step}, so it dies "
            f"mid-step; both contenders checkpoint every {spec.kill_checkpoint_every} steps (Ray Train "
            "also reports only then, FailureConfig(max_failures=1), restarting its whole group from the "
            "last checkpoint; raytrainer with its default warm spare). Time: from the kill to the end of "
            "rank 0's first step after the restart; steps lost: the furthest step rank 0 finished before "
            "the failure minus the step training resumed from. Raw DDP has no recovery.")
    if "input" in spec.scenario_list:
        out.append(
            f"Input runs: {spec.input_steps} steps on a dataset whose every sample costs {spec.input_io_ms:g} ms "
            f"of I/O latency (a sleep) and {spec.input_decode_rounds} 64x64 matrix products of decoding; "
            f"k={spec.input_workers} loader processes per rank: raw DDP with DataLoader(num_workers=k) (its "
            "default start method, fork) and the BatchPlan's index lists as batch_sampler, raytrainer with "
            f"data.num_workers: k (fork server). The speedup row divides that by raytrainer's steps/s with "
            f"data.num_workers: 0 ({spec.input_steps_no_loaders} steps in the same contender process).")
    if "grow" in spec.scenario_list:
        out.append(
            f"Grow run: {spec.workers} workers on {spec.workers} 1-CPU nodes of a local multi-node Ray "
            f"(ray.cluster_utils), max_workers {spec.workers + 1}; once training runs a node is added. "
            "Pause: the time from rank 0's last step at the old world size to its first at the new "
            "one, less an ordinary step (steps are paced at 20 ms until the resize); starting the new "
            "worker happens while training goes on. Ray Train "
            "resizes by restarting its whole group from the last checkpoint, as after a kill (figure 3).")
    if "faults" in spec.scenario_list:
        plan = fault_plan(asdict(spec))
        where = ", ".join(f"{f['fault'].replace('_', ' ')} of rank {'+'.join(map(str, f['ranks']))} at step "
                          f"{f['step']}" for f in plan)
        out.append(
            f"Faults run: {spec.faults_workers} workers, {(len(FAULTS) + 1) * spec.faults_every} steps, "
            f"failure.step_timeout_s {spec.faults_step_timeout_s:g}, collective_timeout_s "
            f"{FAULTS_COLLECTIVE_TIMEOUT_S:g}, default warm spare, no checkpoints; "
            f"{where}. Single kills and the freeze are failure.chaos faults with at: random (a timer "
            "thread in the worker SIGKILLs or SIGSTOPs it at a seeded random moment of the step); the "
            f"double kill is two os.kill(SIGKILL) by pid from the contender's process, "
            f"{DOUBLE_KILL_GAP_S:g} s apart, once metrics.jsonl shows the step. Time: from the fault to the "
            "end of rank 0's first step after the `recovered` event; a chaos fault's moment is taken as "
            "rank 0's last step before the failure (no event records it), so its times may be up to one "
            "step too long. Steps lost: the `recovered` event's. Bit-identical: the faulted run's model.pt "
            "against an undisturbed run of the same config (same seed and world size), trained just "
            "before it in the same process.")
    return out


def recovery_lines(run: dict[str, Any]) -> list[str]:
    """One line per recovery of a faults run, with what the table leaves out."""
    lines = []
    for r in run["recoveries"]:
        ranks = "+".join(str(f["rank"]) for f in r["failed"])
        lines.append(
            f"{r['fault'].replace('_', ' ')} of rank {ranks} at step {r['fault_step']}: detected "
            f"{_fmt(r['detect_s'])} s after it, `recovered` after {_fmt(r['seconds'])} s "
            f"({r['attempts']} attempt(s), state from "
            f"{'rank ' + str(r['source_rank']) if r['source_rank'] is not None else r['state_from']}), "
            f"first step {_fmt(r['fault_to_first_step_s'])} s after the fault, {r['steps_lost']} step(s) lost"
            + (f"; load average {r['load']:.2f}" if r.get("load") is not None else ""))
    lines.append(f"final weights {'bit-identical' if run['bit_identical'] else 'NOT bit-identical'} to the "
                 f"undisturbed run's (max abs difference {run['max_abs_diff']:g})")
    return lines


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"


def format_table(report: dict[str, Any]) -> str:
    """A Markdown table of medians and ratios (it goes into the README as is)."""
    head = ["figure", "raw DDP", "Ray Train", "raytrainer", "raytrainer/raw", "raytrainer/Ray Train",
            "target"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for fig in report["figures"]:
        name = f"{fig['title']} ({fig['unit']})"
        if fig["status"] != "measured":
            cells = [name] + [f"not measured ({fig['reason']})"] + ["-"] * 4
        else:
            med, ratio = fig["medians"], fig["ratios"]
            fmt = getattr(FIGURE_BY_KEY.get(fig["key"]), "fmt", None) or _fmt
            cells = [name] + [fmt(med[c]) if c in med else "-" for c in CONTENDERS] + [
                _fmt(ratio.get("raytrainer/raw")) + ("x" if "raytrainer/raw" in ratio else ""),
                _fmt(ratio.get("raytrainer/ray_train")) + ("x" if "raytrainer/ray_train" in ratio else ""),
            ]
        target = fig["target"] or ""
        met_runs = fig.get("met_runs")
        if met_runs and met_runs[1] > 1:
            target += f" (met in {met_runs[0]} of {met_runs[1]} runs)"
        elif fig.get("target_met") is not None:
            target += " (met)" if fig["target_met"] else " (missed)"
        lines.append("| " + " | ".join(cells + [target]) + " |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchSpec()
    parser.add_argument("--workers", type=int, default=d.workers, help="workers per contender (CPU, Gloo)")
    parser.add_argument("--hidden", type=int, default=d.hidden, help="MLP hidden width")
    parser.add_argument("--layers", type=int, default=d.layers, help="MLP hidden layers")
    parser.add_argument("--global-batch-size", type=int, default=d.global_batch_size)
    parser.add_argument("--samples", type=int, default=d.samples, help="training set size")
    parser.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (raw DDP, raytrainer)")
    parser.add_argument("--ray-train-steps", type=int, default=d.ray_train_steps,
                        help="optimizer steps for Ray Train (its report() paces it at about 0.5 steps/s)")
    parser.add_argument("--repetitions", type=int, default=d.repetitions)
    parser.add_argument("--checkpoint-mb", type=int, default=d.checkpoint_mb,
                        help="model size for the checkpoint-stall figures")
    parser.add_argument("--kill-steps", type=int, default=d.kill_steps, help="optimizer steps of the kill runs")
    parser.add_argument("--kill-step", type=int, default=d.kill_step,
                        help="the step at which one worker is SIGKILLed in the kill runs")
    parser.add_argument("--kill-checkpoint-every", type=int, default=d.kill_checkpoint_every,
                        help="checkpoint (and Ray Train report) cadence in the kill runs")
    parser.add_argument("--grow-steps", type=int, default=d.grow_steps, help="optimizer steps of the grow run")
    parser.add_argument("--input-steps", type=int, default=d.input_steps,
                        help="optimizer steps of the input runs with loader processes")
    parser.add_argument("--input-steps-no-loaders", type=int, default=d.input_steps_no_loaders,
                        help="optimizer steps of raytrainer's input run with data.num_workers 0")
    parser.add_argument("--input-workers", type=int, default=d.input_workers,
                        help="loader processes per rank in the input runs")
    parser.add_argument("--input-io-ms", type=float, default=d.input_io_ms,
                        help="I/O latency per sample in the input runs")
    parser.add_argument("--faults-workers", type=int, default=d.faults_workers, help="workers of the faults runs")
    parser.add_argument("--faults-every", type=int, default=d.faults_every,
                        help="steps between the five faults of the faults run")
    parser.add_argument("--faults-step-timeout-s", type=float, default=d.faults_step_timeout_s,
                        help="failure.step_timeout_s of the faults runs (how long a freeze goes unnoticed)")
    parser.add_argument("--scenarios", default=d.scenarios,
                        help="comma-separated subset of train (start-up, steps/s), kill (worker SIGKILL), "
                             "stall (checkpoint stall), grow (elastic grow), input (slow dataset, loader "
                             "processes), faults (five faults in one run)")
    parser.add_argument("--timeout-s", type=float, default=d.timeout_s, help="per contender run")
    parser.add_argument("--smoke", action="store_true",
                        help="a few steps, one repetition, a tiny model: checks the bench works")
    parser.add_argument("--out", help="also write the report as JSON to this path")


def spec_from_args(args: argparse.Namespace) -> BenchSpec:
    keys = ("workers", "hidden", "layers", "global_batch_size", "samples", "steps", "ray_train_steps",
            "repetitions", "timeout_s", "checkpoint_mb", "kill_steps", "kill_step", "kill_checkpoint_every",
            "grow_steps", "scenarios", "input_steps", "input_steps_no_loaders", "input_workers",
            "input_io_ms", "faults_workers", "faults_every", "faults_step_timeout_s")
    values = {k: getattr(args, k) for k in keys}
    if args.smoke:
        default = BenchSpec()
        values.update({k: v for k, v in SMOKE.items() if values[k] == getattr(default, k)})
    return BenchSpec(**values)


def main(args: argparse.Namespace) -> int:
    report = run_bench(spec_from_args(args), out=args.out, log=lambda s: print(s, file=sys.stderr, flush=True))
    m = report["machine"]
    print(f"{m['cpu']}, {m['cores']} cores; torch {m['torch']}, ray {m['ray']}; "
          f"{report['settings']['workers']} CPU workers, Gloo; medians of "
          f"{report['settings']['repetitions']} repetition(s)")
    print(format_table(report))
    for note in report["notes"]:
        print(f"\n{note}")
    for run in (r for r in report["runs"] if r.get("scenario") == "faults"):
        print(f"\nFaults run {run['repetition'] + 1} (load average {run['load_before']:.2f} before it):")
        for line in recovery_lines(run):
            print(f"- {line}")
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "_contender":
        # Through the package, not __main__: spawned workers and Ray pickle these
        # functions by reference to raytrainer.bench.
        from raytrainer.bench import _contender_main as contender_main

        sys.exit(contender_main(*sys.argv[2:]))
    sys.exit("usage: raytrainer bench [options]  (python -m raytrainer.bench is for its contenders)")
