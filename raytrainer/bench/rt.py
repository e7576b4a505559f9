"""raytrainer, the contender under test: the train, input, kill and grow runs (the faults
run is in faults.py), and the checkpoint stall, measured in the bench's own process.
Every run logs every step's metrics to the driver (log_every_n_steps: 1)."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .job import TASK_TARGET
from .kill import Killer, kill_figures
from .spec import BenchError, rate


def config(spec: dict[str, Any], work: Path, name: str, steps: int, *, workers: int | None = None,
           task_args: dict[str, Any] | None = None, scaling: dict[str, Any] | None = None,
           **sections: Any) -> dict[str, Any]:
    """A raytrainer config of the bench job: `steps` optimizer steps, run directory
    work/name; `sections` add to it (data, checkpoint, failure)."""
    return {
        "task": {"target": TASK_TARGET, "args": {**spec, **(task_args or {})}},
        "trainer": {"max_steps": steps, "global_batch_size": spec["global_batch_size"],
                    "seed": spec["seed"], "log_every_n_steps": 1,  # every step's metrics to the driver
                    # Named only when not the default: a raytrainer without the key still runs DDP.
                    **({"strategy": spec["strategy"]} if spec.get("strategy", "ddp") != "ddp" else {})},
        "scaling": {"num_workers": workers or spec["workers"], "use_gpu": False, "backend": "gloo",
                    **(scaling or {})},
        **sections,
        "run": {"name": name, "storage": str(work)},
    }


def outcome(result) -> dict[str, Any]:
    """What every raytrainer run reports: rank 0's step times (its metrics.jsonl rows'),
    the last loss, the lifecycle events' times, the run directory."""
    rows = [r for r in result.history if "loss" in r]
    return {"step_times": [r["time"] for r in rows], "last_loss": rows[-1]["loss"],
            "phases": {f"event_{e['event']}": e["time"] for e in result.events},
            "run_dir": str(result.run_dir)}


def run_raytrainer(spec: dict[str, Any], work: Path, data: dict[str, Any] | None = None,
                   failure: dict[str, Any] | None = None) -> dict[str, Any]:
    from ..api import train

    out = outcome(train(config(spec, work, "bench", spec["steps"], data=data or {}, failure=failure or {}),
                        progress=False))
    # "local": it started a Ray of its own; an address: it joined that Ray (or failed to start).
    return {**out, "ray_address": os.environ.get("RAY_ADDRESS")}


def input_raytrainer(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """With data.num_workers 0 first (the steps/s without loader processes), then with
    input_workers loader processes per rank: the run whose step times are reported. Both
    on one local Ray (started as raytrainer.train would): the figures are steady-state rates."""
    import ray

    from ..api import init_ray

    init_ray()  # as raytrainer.train would
    try:
        none = run_raytrainer({**spec, "steps": spec["input_steps_no_loaders"]}, work / "no-loaders",
                              {"num_workers": 0})
        out = run_raytrainer({**spec, "steps": spec["input_steps"]}, work / "loaders",
                             {"num_workers": spec["input_workers"]})
    finally:
        ray.shutdown()
    out["no_loaders_steps_per_s"] = rate(none["step_times"], spec["warmup_fraction"])
    out["no_loaders_step_times"] = none["step_times"]
    return out


def kill_raytrainer(spec: dict[str, Any], work: Path, failure: dict[str, Any] | None = None) -> dict[str, Any]:
    """raytrainer with the last worker SIGKILLed at spec["kill_step"]; its default
    failure settings (warm spare) but `failure`, and a checkpoint every kill_checkpoint_every steps."""
    from ..api import train

    marker = work / "kill-marker.json"
    cfg = config(spec, work, "bench-kill", spec["kill_steps"], task_args={"kill_marker": str(marker)},
                 checkpoint={"every_n_steps": spec["kill_checkpoint_every"], "async": True},
                 failure={"max_failures": 1, **(failure or {})})
    killer = Killer(marker)
    killer.start()
    try:
        result = train(cfg, progress=False)
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
    out = kill_figures(killed, [r for r in rows if r[1] < handled], [r for r in rows if r[1] > handled],
                       rec["step"], reached=rec["step"] + rec["steps_lost"])
    out.update(outcome(result), recovered_event=recovered[0], worker_failed_event=failed[0])
    return out


def peers_raytrainer(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """FSDP, on one local Ray: the kill run recovering from peer snapshots (at the default
    failure.snapshot_every_n_steps), the same recovering from the newest checkpoint
    (snapshots off), then the train run with snapshots and without, for their cost."""
    import ray

    from ..api import init_ray
    from ..config import FailureConfig

    init_ray()  # as raytrainer.train would
    try:
        peers = kill_raytrainer(spec, work / "peers")
        checkpoint = kill_raytrainer(spec, work / "checkpoint", failure={"snapshot_every_n_steps": 0})
        on = run_raytrainer(spec, work / "snapshots")
        off = run_raytrainer(spec, work / "no-snapshots", failure={"snapshot_every_n_steps": 0})
    finally:
        ray.shutdown()
    for run, source in ((peers, "peers"), (checkpoint, "checkpoint")):
        if run["recovered_event"].get("state_from") != source:
            raise BenchError(f"expected a recovery from {source}; it was: {run['recovered_event']}")
    with_, without = rate(on["step_times"], spec["warmup_fraction"]), rate(off["step_times"], spec["warmup_fraction"])
    return {"step_times": peers["step_times"], "phases": peers["phases"],
            "snapshot_every_n_steps": FailureConfig().snapshot_every_n_steps,
            "peers_kill_to_first_step_s": peers["kill_to_first_step_s"], "peers_steps_replayed": peers["steps_lost"],
            "checkpoint_kill_to_first_step_s": checkpoint["kill_to_first_step_s"],
            "checkpoint_steps_lost": checkpoint["steps_lost"],
            "snapshot_steps_per_s": with_, "no_snapshot_steps_per_s": without,
            "snapshot_overhead": 1 - with_ / without,
            "peers_run": peers, "checkpoint_run": checkpoint}


def grow_raytrainer(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """raytrainer on a local multi-node Ray of `workers` 1-CPU nodes, max_workers one more:
    a node is added once training runs; the figure is rank 0's gap between its last step
    at the old world size and its first at the new one."""
    import ray
    from ray.cluster_utils import Cluster

    from ..api import train

    os.makedirs("/tmp/ray", exist_ok=True)  # Cluster writes its head's address there
    temp_dir = tempfile.mkdtemp(prefix="rtb-", dir="/tmp")  # short: Ray's sockets live under it
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "temp_dir": temp_dir})
    pace = work / "pace"
    pace.touch()
    run_dir = work / "bench-grow"
    cfg = config(spec, work, run_dir.name, spec["grow_steps"], task_args={"pace_while": str(pace)},
                 scaling={"max_workers": spec["workers"] + 1})
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["result"] = train(cfg, progress=False)
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
    return {**outcome(result),
            # The gap beyond an ordinary (paced) step: what the resize cost training.
            "grow_pause_s": new[0]["time"] - old[-1]["time"] - statistics.median(gaps),
            "paced_step_s": statistics.median(gaps),
            "node_added_to_resized_s": events[0]["time"] - added, "resized_event": events[0]}


def measure_checkpoint_stall(model_mb: int, work: Path) -> dict[str, Any]:
    """How long a training step is blocked by one checkpoint of a model of `model_mb` MB
    with Adam-like optimizer state: the whole write when synchronous, the copy off the
    device when asynchronous (measured with the previous write finished, as in training)."""
    import torch

    from ..checkpoint import AsyncWriter, Checkpoints, Storage, to_cpu
    from ..config import CheckpointConfig

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
