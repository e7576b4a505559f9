"""Running the bench: each contender run in a fresh process (`python -m raytrainer.bench
_contender NAME SPEC_JSON RESULT_JSON`, stopped with everything it started if it runs
past its timeout), the repetitions interleaved, and the report put together."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator

from .cpu import Sampler
from .faults import faults_raytrainer
from .raw import input_raw, run_raw
from .ray_train import kill_ray_train, run_ray_train
from .report import (contender_settings, cpu_summary, cpu_windows, input_steps_per_s, notes, recovery_lines,
                     start_to_first_step, steady_steps_per_s, summarize)
from .rt import grow_raytrainer, input_raytrainer, kill_raytrainer, peers_raytrainer, run_raytrainer, stall_raytrainer
from .spec import CONTENDERS, PACKAGE_ROOT, BenchError, BenchSpec

Runner = Callable[[dict[str, Any], Path], dict[str, Any]]
RUNNERS: dict[str, dict[str, Runner]] = {
    "train": {"raw": run_raw, "ray_train": run_ray_train, "raytrainer": run_raytrainer},
    "join": {"raytrainer": run_raytrainer},  # launched with RAY_ADDRESS: the bench's running Ray
    "kill": {"ray_train": kill_ray_train, "raytrainer": kill_raytrainer},
    "stall": {"raytrainer": stall_raytrainer},
    "grow": {"raytrainer": grow_raytrainer},
    "input": {"raw": input_raw, "raytrainer": input_raytrainer},
    "faults": {"raytrainer": faults_raytrainer},
    "peers": {"raytrainer": peers_raytrainer},
}
"""scenario -> contender -> what its process runs; a scenario runs the contenders it names."""


def exit_on_sigterm(*_: Any) -> None:
    """A SIGTERM handler: exit 143 through every `finally` on the way out, as Ctrl-C does
    (Python's default ends the process there and then)."""
    sys.exit(128 + signal.SIGTERM)


def contender_main(name: str, spec_json: str, result_path: str) -> int:
    # SIGTERM from the parent (timeout, Ctrl-C) unwinds through the contenders' finally
    # blocks, so the Ray this process started is shut down.
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    entered = time.time()  # the interpreter is up and raytrainer imported
    spec = json.loads(spec_json)
    work = Path(result_path).parent / f"{name}-work"
    work.mkdir(parents=True, exist_ok=True)
    out = RUNNERS[spec.get("scenario", "train")][name](spec, work)
    out["phases"]["contender_main"] = entered
    Path(result_path).write_text(json.dumps(out))
    return 0


def launch(name: str, spec: BenchSpec, rep: int, tmp: Path, scenario: str = "train",
           cancel: threading.Event | None = None, kept_ray: str | None = None) -> dict[str, Any]:
    """Run one contender in a fresh process; return its result with the launch time. It is
    stopped past spec.timeout_s, or once `cancel` is set (another run of the bench failed).
    It starts a Ray of its own, or with `kept_ray` (a RAYTRAINER_RAY_DIR), joins the local
    Ray kept there, as a run after the first does."""
    result_path = tmp / (f"{name}-{rep}" if scenario == "train" else f"{name}-{scenario}-{rep}") / "result.json"
    result_path.parent.mkdir(parents=True)
    log_path = result_path.parent / "log.txt"
    env = dict(os.environ)
    # Workers (spawned or Ray actors) must import this raytrainer, whatever else is installed.
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Each contender starts a Ray of its own (what the start-up figure measures), never one
    # it finds running on the machine, unless it is to join the bench's kept Ray (the join
    # scenario); the grow scenario names its cluster's address.
    if kept_ray is None:
        env["RAY_ADDRESS"] = "local"
    else:
        # RAY_TMPDIR: Ray's own lookup of a Ray that `ray start` left on this machine (its temp
        # dir's ray_current_cluster, joined before any kept Ray) finds none; another Ray on
        # this machine is not the one measured.
        env.pop("RAY_ADDRESS", None)
        env.update(RAYTRAINER_RAY_DIR=kept_ray, RAYTRAINER_KEEP_RAY="10", RAY_TMPDIR=kept_ray)
    cmd = [sys.executable, "-m", "raytrainer.bench", "_contender", name,
           json.dumps({**asdict(spec), "scenario": scenario}), str(result_path)]
    # Other work on the machine skews every figure: keep the load next to each run.
    load_before = os.getloadavg()[0]
    with open(log_path, "w") as log:
        launched = time.time()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=str(result_path.parent), start_new_session=True)
        # Its session holds every process it starts: their CPU, read as it runs (bench.cpu).
        sampler = Sampler(proc.pid, spec.cpu_sample_s).start() if spec.cpu_sample_s else None
        try:
            rc = _wait(proc, launched + spec.timeout_s, cancel)
        finally:  # also on Ctrl-C: stop it and everything it started
            if sampler is not None:
                sampler.stop()
            stop(proc)
    if rc != 0 or not result_path.exists():
        why = ("stopped: another contender run failed" if rc is None and cancel is not None and cancel.is_set()
               else f"timed out after {spec.timeout_s:g} s" if rc is None else f"exited with status {rc}")
        tail = log_path.read_text()[-3000:]
        raise BenchError(f"bench contender {spec.labels[name]} {why}; the end of its log "
                         f"({log_path}):\n{tail}")
    result = json.loads(result_path.read_text())
    if not result.get("step_times"):
        raise BenchError(f"bench contender {spec.labels[name]} recorded no step")
    result.update(contender=name, scenario=scenario, repetition=rep, launched=launched,
                  load_before=load_before, warmup_fraction=spec.warmup_fraction, steady_from=spec.steady_from,
                  window_steps=spec.window_steps)
    if sampler is not None:
        pids = set(result.get("worker_pids") or ()) or None
        for key, (t0, t1, steps) in cpu_windows(result).items():
            result[key] = {**sampler.window(t0, t1, pids), "steps": steps}
    return result


def _wait(proc: subprocess.Popen, deadline: float, cancel: threading.Event | None) -> int | None:
    """The process's exit status, or None at the deadline (wall clock) or once `cancel` is set."""
    while (left := deadline - time.time()) > 0 and not (cancel is not None and cancel.is_set()):
        try:
            return proc.wait(timeout=min(left, 0.5) if cancel is not None else left)
        except subprocess.TimeoutExpired:
            pass
    return None


def stop(proc: subprocess.Popen) -> None:
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


RUN_ORDER = ("train", "join", "kill", "stall", "grow", "input", "faults", "peers")
"""The order the scenarios run in, in each repetition."""


ALONE = ("kill", "faults", "peers")
"""Scenarios whose runs never share the machine with another run of the bench (--parallel)."""


def _intro(spec: BenchSpec, scenario: str, name: str) -> str:
    label = spec.labels[name]
    return {
        "train": label,
        "join": f"{label}, a later run, joining the local Ray the first one kept",
        "kill": f"{label}, worker SIGKILL at step {spec.kill_step} of {spec.kill_steps}",
        "stall": f"{label}, a {spec.checkpoint_mb} MB model, a checkpoint every {spec.stall_checkpoint_every} "
                 f"of {spec.stall_steps} steps, sync then async",
        "grow": f"{label}, a node joins, {spec.workers} -> {spec.workers + 1} workers",
        "input": f"{label}, a slow dataset, {spec.input_workers} loader processes per rank",
        "faults": f"{label}, {spec.faults_workers} workers, an undisturbed run, then one with "
                  f"{spec.faults_count} faults at random moments; then a node lost from an elastic run",
        "peers": f"{label}, fsdp, worker SIGKILL at step {spec.kill_step} of {spec.kill_steps}, recovered from "
                 "peer snapshots (a spare, none fast, none exact), then from a checkpoint; steps/s with snapshots "
                 "and without",
    }[scenario]


def _outcome(scenario: str, run: dict[str, Any]) -> list[str]:
    if scenario == "train":
        return [f"first step after {start_to_first_step(run):.2f} s, {steady_steps_per_s(run):.1f} steps/s"]
    if scenario == "join":
        return [f"first step after {start_to_first_step(run, 'join'):.2f} s"]
    if scenario == "kill":
        return [f"step {run['step_at_kill']} reached, resumed from {run['resumed_from']}, "
                f"first step {run['kill_to_first_step_s']:.2f} s after the kill"]
    if scenario == "stall":
        return [f"{mode}: a save cost {run[f'checkpoint_stall_{mode}_s']:.3f} s over ordinary steps of "
                f"{run[f'ordinary_step_{mode}_s']:.3f} s (median of "
                f"{sum(s['mode'] == mode for s in run['saves'])} saves)" for mode in ("sync", "async")]
    if scenario == "grow":
        return [f"training paused {run['grow_pause_s']:.2f} s, "
                f"{run['node_added_to_resized_s']:.1f} s after the node was added"]
    if scenario == "peers":
        return [f"recovered from peers in {run['peers_kill_to_first_step_s']:.2f} s ({run['peers_steps_replayed']} "
                f"steps replayed, snapshots every {run['peers_snapshot_interval']}), from a checkpoint in "
                f"{run['checkpoint_kill_to_first_step_s']:.2f} s "
                f"({run['checkpoint_steps_lost']} lost); snapshots cost {100 * run['snapshot_overhead']:.1f}% "
                "of steps/s",
                f"no spare: went on re-sharded in {run['fast_kill_to_first_step_s']:.2f} s "
                f"({run['fast_steps_replayed']} steps replayed), the grow back paused "
                f"{run['fast_grow_pause_s']:.2f} s; recovery exact: {run['exact_kill_to_first_step_s']:.2f} s "
                f"({run['exact_steps_replayed']} steps replayed)"]
    if scenario == "input":
        extra = (f" ({run['no_loaders_steps_per_s']:.1f} with data.num_workers 0)"
                 if "no_loaders_steps_per_s" in run else "")
        return [f"{input_steps_per_s(run):.1f} steps/s{extra}"]
    return recovery_lines(run)


def run_bench(spec: BenchSpec, *, out: str | Path | None = None, log: Callable[[str], None] = print,
              keep_in: str | Path | None = None) -> dict[str, Any]:
    """Run every contender `spec.repetitions` times, interleaved; return (and write) the report.

    The contenders' logs and run directories go to a temporary directory, or are
    kept in `keep_in` (raytrainer's run directory is then in each run's "run_dir")."""
    started = time.time()
    scenarios = spec.scenario_list
    cancel = threading.Event()  # set on the way out: contender runs still going stop
    with (contextlib.nullcontext(str(keep_in)) if keep_in is not None
          else tempfile.TemporaryDirectory(prefix="raytrainer-bench-")) as tmp, \
            running_ray("join" in scenarios) as kept:
        runs = []
        for rep in range(spec.repetitions):
            order = CONTENDERS[rep % 3:] + CONTENDERS[:rep % 3]  # rotate: no contender always first
            plan = [(scenario, name) for scenario in RUN_ORDER if scenario in scenarios
                    for name in order if name in RUNNERS[scenario] and name in spec.labels]

            def one(scenario: str, name: str) -> dict[str, Any]:
                log(f"bench: repetition {rep + 1}/{spec.repetitions}: {_intro(spec, scenario, name)} ...")
                run = launch(name, spec, rep, Path(tmp), scenario=scenario, cancel=cancel,
                             kept_ray=kept if scenario == "join" else None)
                for line in _outcome(scenario, run):
                    log(f"bench:   {line}")
                if keep_in is None:  # about to be deleted
                    run.pop("run_dir", None)
                    run.pop("undisturbed_run_dir", None)
                return run

            # The kill and faults runs run alone, after the others: their faults must land
            # on time. Beside other runs, the faults run's recoveries took 20 s and it timed
            # out, and raytrainer's kill came after its last step (load 10, 2 cores).
            together = [p for p in plan if p[0] not in ALONE] if spec.parallel > 1 else []
            done = dict(zip(together, _in_parallel(one, together, spec.parallel, cancel)))
            runs += [done[p] if p in done else one(*p) for p in plan]
    report = {
        "command": " ".join(["raytrainer bench", *_spec_args(spec)]),
        "machine": machine(),
        "settings": asdict(spec),
        "contenders": spec.labels,
        "contender_settings": contender_settings(runs),
        "figures": summarize(runs, scenarios),
        "cpu": cpu_summary(runs),
        "notes": notes(spec),
        "runs": runs,
        "seconds": round(time.time() - started, 1),
    }
    if out is not None:
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
    return report


@contextlib.contextmanager
def running_ray(needed: bool) -> Iterator[str | None]:
    """The local Ray a first `raytrainer train` leaves up for the next runs (driver/localray),
    for the join runs, started before them and stopped after, in a folder of its own (its
    RAYTRAINER_RAY_DIR); None if not `needed`."""
    if not needed:
        yield None
        return
    from ..driver import localray

    folder = Path(tempfile.mkdtemp(prefix="rtk-", dir="/tmp"))  # short: Ray's sockets live under it
    try:
        localray.up(folder, minutes=10)
        yield str(folder)
    finally:
        localray.down(folder, force=True)  # its contenders are stopped: what is left goes
        shutil.rmtree(folder, ignore_errors=True)


def _in_parallel(one: Callable[..., dict[str, Any]], plan: list[tuple[str, str]], workers: int,
                 cancel: threading.Event) -> list[dict[str, Any]]:
    """one(*p) for each p of plan, `workers` at a time; the results in plan order. The
    first error stops the rest (and the runs still going) and is raised."""
    if not plan:
        return []
    pool = ThreadPoolExecutor(workers, thread_name_prefix="bench-run")
    try:
        futures = [pool.submit(one, *p) for p in plan]
        wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in futures if f.done() and not f.cancelled() and f.exception() is not None]
        if failed:
            raise failed[0].exception()
        return [f.result() for f in futures]
    except BaseException:  # an error, or Ctrl-C here
        cancel.set()
        raise
    finally:
        pool.shutdown(cancel_futures=True)


def _spec_args(spec: BenchSpec) -> list[str]:
    default = BenchSpec()
    return [f"--{k.replace('_', '-')} {v}" for k, v in asdict(spec).items()
            if v != getattr(default, k) and k != "warmup_fraction"]
