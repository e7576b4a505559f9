"""Ray Train's TorchTrainer, the peer: `ray.train.report` every step (the train scenario),
or at each checkpoint with FailureConfig(max_failures=1) (the kill scenario)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

from .job import build_mlp, make_data, make_optimizer, rank_batch, sgd_step, thread_snapshot, threads_at
from .kill import Killer, arm_kill, kill_figures
from .spec import BenchError


POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
"""Ray Train v2's controller poll: how often it collects the workers' reports (and health)."""


@contextlib.contextmanager
def _local_ray(spec: dict[str, Any], phases: dict[str, float]):
    import ray

    # Read by the controller, which Ray Train gives the driver's value (it propagates it).
    os.environ[POLL_ENV] = str(spec["ray_train_poll_s"])
    ray.init(include_dashboard=False, logging_level="WARNING")
    phases["ray_started"] = time.time()
    try:
        yield
    finally:
        ray.shutdown()


def _fit(loop: Callable[[dict[str, Any]], None], loop_config: dict[str, Any], spec: dict[str, Any], work: Path,
         name: str, failure_config=None) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    TorchTrainer(
        loop,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=spec["workers"], use_gpu=False),
        run_config=RunConfig(name=name, storage_path=str(work / "ray_train_storage"),
                             failure_config=failure_config),
    ).fit()


def _prepare(spec: dict[str, Any]):
    """In a Ray Train worker: its rank and world size, the DDP model over the group Ray
    Train formed, and the optimizer."""
    import ray.train
    import ray.train.torch
    import torch

    ctx = ray.train.get_context()
    torch.manual_seed(spec["seed"])
    model = ray.train.torch.prepare_model(build_mlp(spec))
    return ctx.get_world_rank(), ctx.get_world_size(), model, make_optimizer(model)


def run_ray_train(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    import ray.train.torch  # noqa: F401 - imported before the mark, as a user's script does

    phases = {"ray_train_imported": time.time()}
    times_file = work / "ray_train_steps.json"
    with _local_ray(spec, phases):
        _fit(_ray_train_loop, {"spec": spec, "times_file": str(times_file)}, spec, work, "bench")
    out = json.loads(times_file.read_text())
    out["phases"].update(phases)
    out["contender_settings"] = settings(spec, "every step, metrics only (no checkpoint), on every rank")
    return out


def settings(spec: dict[str, Any], report: str) -> dict[str, Any]:
    """What Ray Train runs with, for the report."""
    return {POLL_ENV: spec["ray_train_poll_s"], "ray.train.report": report,
            "RAY_TRAIN_V2_ENABLED": os.environ.get("RAY_TRAIN_V2_ENABLED", "1 (default)"),
            "ScalingConfig": f"num_workers={spec['workers']}, use_gpu=False", "backend": "gloo (TorchConfig, CPU)",
            "model": "ray.train.torch.prepare_model (DistributedDataParallel)"}


def _ray_train_loop(config: dict[str, Any]) -> None:
    import ray.train
    import torch

    spec = config["spec"]
    phases = {"loop_started": time.time()}
    rank, world, model, optimizer = _prepare(spec)
    x, y = make_data(spec)
    times, loss_value, snapshot = [], None, None
    for step in range(spec["ray_train_steps"]):
        loss = sgd_step(model, optimizer, *rank_batch(spec, x, y, step, rank, world))
        times.append(time.time())
        loss_value = loss.item()
        ray.train.report({"loss": loss_value, "step": step + 1})  # to the driver, every step
        if rank == 0 and step + 1 == threads_at(spec["ray_train_steps"]):
            snapshot = thread_snapshot()
    if rank == 0:
        Path(config["times_file"]).write_text(json.dumps(
            {"step_times": times, "last_loss": loss_value, "phases": phases,
             "threads": torch.get_num_threads(), "worker_threads": snapshot}))


def kill_ray_train(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """Ray Train with FailureConfig(max_failures=1): it restarts the whole worker group
    and the loop resumes from the last reported checkpoint."""
    import ray.train.torch  # noqa: F401 - imported before the mark, as a user's script does
    from ray.train import FailureConfig

    phases = {"ray_train_imported": time.time()}
    marker = work / "kill-marker.json"
    rows_file = work / "ray_train_rows.jsonl"
    with _local_ray(spec, phases):
        killer = Killer(marker)
        killer.start()
        try:
            _fit(_ray_train_kill_loop, {"spec": {**spec, "kill_marker": str(marker)}, "rows_file": str(rows_file)},
                 spec, work, "bench-kill", FailureConfig(max_failures=1))
        finally:
            killed = killer.result()
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    # An attempt is a worker process: the restart replaces them all.
    first = [(r["step"], r["time"]) for r in rows if r["pid"] == rows[0]["pid"]]
    again = [(r["step"], r["time"]) for r in rows if r["pid"] != rows[0]["pid"]]
    if not again:
        raise BenchError("Ray Train did not restart after the kill")
    out = kill_figures(killed, first, again, rows[-1]["resumed_from"])
    out.update(step_times=[r["time"] for r in rows], last_loss=rows[-1]["loss"], phases=phases,
               contender_settings=settings(spec, f"at each checkpoint (every {spec['kill_checkpoint_every']} steps), "
                                                 "FailureConfig(max_failures=1)"))
    return out


def _ray_train_kill_loop(config: dict[str, Any]) -> None:
    import tempfile

    import ray.train
    import torch

    spec = config["spec"]
    rank, world, model, optimizer = _prepare(spec)
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
            arm_kill(spec, step + 1, rank)
            loss = sgd_step(model, optimizer, *rank_batch(spec, x, y, step, rank, world))
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
