"""raytrainer, the contender under test: the train, input, kill, stall and grow runs (the
faults run is in faults.py). Every run logs every step's metrics to the driver
(log_every_n_steps: 1)."""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .job import TASK_TARGET, threads_at
from .kill import GROW_PACE_S, Killer, kill_figures
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
            "run_dir": str(result.run_dir),
            # The training workers' processes, for the CPU table (bench.cpu): every group's.
            "worker_pids": sorted({pid for e in result.events for pid in e.get("pids", ())})}


def settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """What raytrainer runs with, for the report: its config but the task and run sections."""
    return {"metrics": "trainer.log_every_n_steps 1: every step's metrics reduced over the ranks, to the driver",
            **{k: v for k, v in cfg.items() if k not in ("task", "run")}}


def run_raytrainer(spec: dict[str, Any], work: Path, data: dict[str, Any] | None = None,
                   failure: dict[str, Any] | None = None) -> dict[str, Any]:
    from ..driver import localray
    from ..driver.api import train

    snapshot = work / "threads.json"  # rank 0's thread snapshot, written by the bench task
    cfg = config(spec, work, "bench", spec["steps"], data=data or {}, failure=failure or {},
                 task_args={"threads_file": str(snapshot), "threads_at": threads_at(spec["steps"])})
    out = outcome(train(cfg, progress=False))
    out["worker_threads"] = json.loads(snapshot.read_text())
    # ray_address "local": it started a Ray of its own; ray "kept, joined": it joined the local Ray kept
    # for the next runs (driver/localray).
    out.update(threads=out["worker_threads"]["torch_intra_op"], contender_settings=settings(cfg),
               ray_address=os.environ.get("RAY_ADDRESS"), ray=localray.connected)
    return out


def input_raytrainer(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """With data.num_workers 0 first (the steps/s without loader processes), then with
    input_workers loader processes per rank: the run whose step times are reported. Both
    on one local Ray (started as raytrainer.train would): the figures are steady-state rates."""
    import ray

    from ..driver.api import init_ray

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


def kill_raytrainer(spec: dict[str, Any], work: Path, failure: dict[str, Any] | None = None,
                    async_save: bool = True, until_grown: bool = False) -> dict[str, Any]:
    """raytrainer with the last worker SIGKILLed at spec["kill_step"]; its default
    failure settings (warm spare) but `failure`, and a checkpoint every kill_checkpoint_every
    steps, written in the background unless not `async_save`. `until_grown`: the steps after
    the kill are paced (GROW_PACE_S) until the replacement joins, and the grow is reported."""
    from ..config.failure import AUTO, AUTO_FIRST
    from ..driver.api import train

    marker, pace = work / "kill-marker.json", work / "kill-pace"
    cfg = config(spec, work, "bench-kill", spec["kill_steps"],
                 task_args={"kill_marker": str(marker),
                            **({"pace_while": str(pace), "pace_s": GROW_PACE_S} if until_grown else {})},
                 checkpoint={"every_n_steps": spec["kill_checkpoint_every"], "async": async_save},
                 failure={"max_failures": 1, **(failure or {})})
    killer = Killer(marker, pace, work / "bench-kill") if until_grown else Killer(marker)
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
    grown = [e for e in result.events if e["event"] == "resized" and e["added"]]
    # The peer snapshots' interval at the kill: the newest one snapshot_every_n_steps auto chose before it.
    every = cfg["failure"].get("snapshot_every_n_steps", AUTO)
    chosen = [e["steps"] for e in result.events
              if e["event"] == "snapshot_interval" and e["time"] < killed["killed_at"]]
    out.update(outcome(result), recovered_event=recovered[0], worker_failed_event=failed[0],
               snapshot_interval=chosen[-1] if chosen else AUTO_FIRST if every == AUTO else every,
               grow_event=grown[0] if grown else None, contender_settings=settings(cfg))
    return out


def peers_raytrainer(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """FSDP, on one local Ray: the kill run recovering from peer snapshots (at the default
    failure.snapshot_every_n_steps, the warm spare taking the lost rank), the same with no
    spare (failure.recovery fast: the survivors go on re-sharded, the replacement is taken
    back in by a grow) and waiting for the replacement (recovery exact), the same recovering
    from the newest checkpoint (snapshots off), then the train run with snapshots and
    without, for their cost."""
    import ray

    from ..driver.api import init_ray
    from ..config import FailureConfig

    # Each run's replacement a new process, as in a run of its own: a process the run before
    # kept (driver/group/kept.py) would join at once, and the figures of recovery exact (a
    # wait for a process to start) would measure nothing.
    os.environ["RAYTRAINER_KEEP_WORKERS"] = "0"
    init_ray()  # as raytrainer.train would
    try:
        peers = kill_raytrainer(spec, work / "peers")
        fast = kill_raytrainer(spec, work / "fast", failure={"warm_spares": 0}, until_grown=True)
        exact = kill_raytrainer(spec, work / "exact", failure={"warm_spares": 0, "recovery": "exact"})
        # Synchronous saves: the recovery must find the checkpoint before the kill committed. An
        # async one may commit only after it (seen beside another test session, load 13: the
        # save of step 10 was not committed at the kill at step 15, and the run restarted at 0).
        checkpoint = kill_raytrainer(spec, work / "checkpoint", failure={"snapshot_every_n_steps": 0},
                                     async_save=False)
        on = run_raytrainer(spec, work / "snapshots")
        off = run_raytrainer(spec, work / "no-snapshots", failure={"snapshot_every_n_steps": 0})
    finally:
        ray.shutdown()
    for run, source in ((peers, "peers"), (fast, "peers"), (exact, "peers"), (checkpoint, "checkpoint")):
        if run["recovered_event"].get("state_from") != source:
            raise BenchError(f"expected a recovery from {source}; it was: {run['recovered_event']}")
    if fast["grow_event"] is None:
        raise BenchError(f"the run with no spare did not grow back to {spec['workers']} workers: "
                         f"{fast['recovered_event']}")
    with_, without = rate(on["step_times"], spec["warmup_fraction"]), rate(off["step_times"], spec["warmup_fraction"])
    return {"step_times": peers["step_times"], "phases": peers["phases"],
            "worker_pids": sorted({p for run in (peers, fast, exact, checkpoint, on, off) for p in run["worker_pids"]}),
            "snapshot_every_n_steps": FailureConfig().snapshot_every_n_steps,
            **{f"{name}_snapshot_interval": run["snapshot_interval"] for name, run in (("peers", peers), ("fast", fast),
                                                                                      ("exact", exact))},
            "peers_kill_to_first_step_s": peers["kill_to_first_step_s"], "peers_steps_replayed": peers["steps_lost"],
            "fast_kill_to_first_step_s": fast["kill_to_first_step_s"], "fast_steps_replayed": fast["steps_lost"],
            "fast_grow_pause_s": fast["grow_event"]["seconds"],
            "exact_kill_to_first_step_s": exact["kill_to_first_step_s"], "exact_steps_replayed": exact["steps_lost"],
            "checkpoint_kill_to_first_step_s": checkpoint["kill_to_first_step_s"],
            "checkpoint_steps_lost": checkpoint["steps_lost"],
            "snapshot_steps_per_s": with_, "no_snapshot_steps_per_s": without,
            "snapshot_overhead": 1 - with_ / without,
            "peers_run": peers, "fast_run": fast, "exact_run": exact, "checkpoint_run": checkpoint}


def local_cluster(temp_dir: str | None = None) -> Any:
    """A multi-node Ray on this machine (ray.cluster_utils): a head with no CPUs for workers,
    in `temp_dir` or a short temp dir of its own (Ray's sockets live under it). Cluster
    records its head's address where Ray looks for a `ray start` ($RAY_TMPDIR, else $TMPDIR,
    else /tmp, then ray/), which must exist. Each node it starts, the head's included, gets
    driver._internals.patient_node_start's time to register, not Ray's fixed 30 s. Its
    shutdown removes the temp dir it made (the nodes' logs and sockets: 0.7 MB a run)."""
    from ray.cluster_utils import Cluster

    from ..driver._internals import patient_node_start

    made = None if temp_dir else tempfile.mkdtemp(prefix="rtb-", dir="/tmp")

    class PatientCluster(Cluster):
        def add_node(self, *args: Any, **kwargs: Any) -> Any:
            with patient_node_start():
                return super().add_node(*args, **kwargs)

        def shutdown(self) -> None:
            try:
                super().shutdown()  # its nodes' processes waited for
            finally:
                if made:
                    shutil.rmtree(made, ignore_errors=True)

    os.makedirs(os.path.join(os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp", "ray"),
                exist_ok=True)
    try:
        return PatientCluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                                    "temp_dir": temp_dir or made})
    except BaseException:  # its head did not start: no cluster for a caller to shut down
        if made:
            shutil.rmtree(made, ignore_errors=True)
        raise


def grow_raytrainer(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """raytrainer on a local multi-node Ray of `workers` 1-CPU nodes, max_workers one more:
    a node is added once training runs; the figure is rank 0's gap between its last step
    at the old world size and its first at the new one."""
    import ray

    from ..driver.api import train

    cluster = local_cluster()
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


def stall_hidden(model_mb: int, in_dim: int) -> int:
    """The hidden width of a 2-layer MLP with about `model_mb` MB of fp32 parameters
    (h*h + (in_dim + 3)*h + 1 of them)."""
    n, b = model_mb * 2**20 / 4, in_dim + 3
    return max(1, int((math.sqrt(b * b + 4 * n) - b) / 2))


def stall_raytrainer(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """The checkpoint stall inside training: raytrainer trains a 2-layer MLP of about
    checkpoint_mb MB with Adam (a checkpoint three times the model), saving every
    stall_checkpoint_every steps, once synchronously and once with checkpoint.async, on
    one local Ray. A save's stall is what it costs the steps around it (see save_stalls):
    the whole write when synchronous; the copy of the state, then the writer thread
    competing with training for the same cores, when asynchronous."""
    import ray

    from ..driver.api import init_ray, train
    from ..checkpoint import Checkpoints, Storage
    from ..config import CheckpointConfig

    wide = {**spec, "layers": 2, "hidden": stall_hidden(spec["checkpoint_mb"], spec["in_dim"]), "optimizer": "adam"}
    every = spec["stall_checkpoint_every"]
    init_ray()  # as raytrainer.train would
    try:
        runs = {}
        for mode in ("sync", "async"):
            # Every checkpoint kept: its manifest has the time rank 0 committed it (the
            # driver's event comes later, by as much as a few steps on a busy machine).
            cfg = config(wide, work / mode, "bench-stall", spec["stall_steps"],
                         checkpoint={"every_n_steps": every, "async": mode == "async",
                                     "keep_last": spec["stall_steps"] // every + 1})
            runs[mode] = (train(cfg, progress=False), cfg)
    finally:
        ray.shutdown()
    out: dict[str, Any] = {"hidden": wide["hidden"], "saves": []}
    for mode, (result, cfg) in runs.items():
        rows = [(r["step"], r["time"]) for r in result.history if "loss" in r]
        ckpts = Checkpoints(Storage(cfg["run"]["storage"]), cfg["run"]["name"], CheckpointConfig())
        commits = [(c.step, c.manifest["time"]) for c in ckpts.committed()]
        ordinary, saves = save_stalls(rows, commits, spec["warmup_fraction"])
        if not saves:
            raise BenchError(f"no checkpoint inside the {mode} stall run; events: {result.events}")
        out[f"checkpoint_stall_{mode}_s"] = statistics.median(s["stall_s"] for s in saves)
        out[f"ordinary_step_{mode}_s"] = ordinary
        out["saves"] += [{"mode": mode, **s} for s in saves]
        out[f"{mode}_step_times"] = [t for _, t in rows]
        committed = [e for e in result.events if e["event"] == "checkpoint_committed"]
        out["checkpoint_bytes"] = max(e["bytes"] for e in committed)
        # How long each save held rank 0's training thread (async: the copy of the state),
        # from the commit events; the saves the stall figure counts.
        held = {e["step"]: e["blocked_s"] for e in committed if "blocked_s" in e}
        counted = [held[s["step"]] for s in saves if s["step"] in held]
        if counted:
            out[f"checkpoint_held_{mode}_s"] = statistics.median(counted)
    out.update(step_times=out["sync_step_times"], phases=outcome(runs["async"][0])["phases"],
               worker_pids=sorted({p for result, _ in runs.values() for p in outcome(result)["worker_pids"]}),
               contender_settings=settings(runs["async"][1]))
    return out


def save_stalls(rows: list[tuple[int, float]], commits: list[tuple[int, float]],
                warmup_fraction: float) -> tuple[float, list[dict[str, Any]]]:
    """(an ordinary step's seconds, one entry per save) from rank 0's (step, end time) and
    the saves' (step, committed time). A save after step k blocks the training thread
    before step k+1 (the write, or the copy of the state) and, when asynchronous, its
    writer thread slows the steps until it commits. Its window: steps k+1 to the first
    step that ended once the save was committed; its stall: the window's time less as
    many ordinary steps (the median step outside any window, after the warm-up). A save
    with no step ending after its commit (the run's last) is left out."""
    times = dict(rows)
    last = max(times)
    windows = []
    for step, committed in commits:
        end = next((s for s in range(step + 1, last + 1) if times.get(s, -math.inf) >= committed), None)
        if step in times and end is not None:
            windows.append((step, end, committed))
    inside = {s for k, e, _ in windows for s in range(k + 1, e + 1)}
    skip = int(len(rows) * warmup_fraction)
    gaps = [times[s] - times[s - 1] for s in sorted(times)[skip + 1:] if s - 1 in times and s not in inside]
    ordinary = statistics.median(gaps)
    return ordinary, [{"step": k, "window_steps": e - k, "committed_after_s": committed - times[k],
                       "stall_s": times[e] - times[k] - (e - k) * ordinary} for k, e, committed in windows]
