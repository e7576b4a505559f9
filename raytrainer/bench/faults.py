"""The faults runs: raytrainer in the field, not in the best case.

1. Many faults in one run (faults_count, 20 by default), from outside, by pid, each at a
   random moment (0.5 to 2.5 s after training went on from the one before, so anywhere in a
   step: forward, backward, a collective, the optimizer): a SIGKILL of a random rank, a
   SIGKILL right after the previous recovery (its warm spare used up, none re-warmed yet),
   two SIGKILLs DOUBLE_KILL_GAP_S apart, a SIGKILL of rank 0 (the group's store and the
   driver's metrics come from it), a SIGSTOP (a freeze, found after step_timeout_s), in
   turn. The run has raytrainer's defaults (failure.recovery fast, one warm spare) on a
   local Ray with a CPU per worker; its steps are paced (kill_pace_s) while faults are due,
   then it finishes unpaced. An undisturbed run of the same config (same seed and world
   size, unpaced: pacing is a sleep) says whether the final weights are bit-identical or
   within float tolerance.
2. A node lost from an elastic run, on a local multi-node Ray (ray.cluster_utils, a head
   with no CPUs and 1-CPU nodes, Ray's default worker niceness, as on a cluster raytrainer
   did not start): min_workers 2, max_workers 3; it trains on 2 nodes (an unpaced window of
   node_window_steps: the steps/s before), a node joins (it grows to 3), the node of its
   last rank is removed (its raylet and the processes on it), and once Ray holds that node
   dead another unpaced window at 2 workers (the steps/s after, and the CPU seconds of the
   GCS, the raylets and the dashboard agents in both windows); then a node joins again and
   it grows back: the pause.

Each fault's time: from the fault (the os.kill, the node's removal) to the end of rank 0's
first step after the last `recovered` event it caused; for a freeze also from its detection
(the controller starting to recover). Steps lost: the `recovered` events'."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

from . import rt
from .kill import KillThread
from .spec import BenchError

FAULT_KINDS = ("kill", "kill_after_recovery", "double_kill", "kill_rank_0", "freeze")
"""The faults of the faults run, in turn."""
FAULT_TITLES = {"kill": "SIGKILL of a random rank",
                "kill_after_recovery": "SIGKILL right after a recovery (no warm spare up)",
                "double_kill": "SIGKILL of two ranks 0.3 s apart",
                "kill_rank_0": "SIGKILL of rank 0",
                "freeze": "SIGSTOP of a random rank (from its detection)",
                "node_lost": "a node lost from an elastic run"}
DOUBLE_KILL_GAP_S = 0.3
FAULTS_COLLECTIVE_TIMEOUT_S = 30.0
"""failure.collective_timeout_s of the faults runs (default 600 s): it bounds whatever else
nothing catches, so that such a stall shows as a slow recovery in the figures instead of
timing the contender out."""
RECOVERY_GOAL_S = 2.0
"""Every recovery: fault (a freeze: its detection) to the first step after it."""
RANDOM_DELAY_S = (0.5, 2.5)
"""A fault comes this long (uniform, seeded) after training went on from the previous one."""
WAIT_S = 120.0
"""The longest the injector waits for a recovery, or for the group to be back to size."""
NODE_PACE_S = 0.05
"""The node run's steps take at least this long but in its two measured windows: what
happens meanwhile (a node joining, another lost and found dead) takes seconds."""


def fault_plan(spec: dict[str, Any]) -> list[str]:
    """The kinds of the faults run's faults, in order."""
    return [FAULT_KINDS[i % len(FAULT_KINDS)] for i in range(spec["faults_count"])]


class RunWatch:
    """What a running raytrainer run's files say: its events, rank 0's last training step,
    the workers' pids and the world size (the newest event that gives them)."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self._offset, self._tail, self.step, self.rows_at = 0, "", 0, 0.0

    def events(self) -> list[dict[str, Any]]:
        path = self.run_dir / "events.jsonl"
        text = path.read_text() if path.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.endswith("}")]

    def refresh(self) -> None:
        """Read the training rows written since the last call."""
        with contextlib.suppress(FileNotFoundError):
            with open(self.run_dir / "metrics.jsonl") as f:
                f.seek(self._offset)
                chunk = f.read()
                self._offset = f.tell()
            *lines, self._tail = (self._tail + chunk).split("\n")
            rows = [row for row in map(json.loads, lines) if "loss" in row]
            if rows:
                self.step, self.rows_at = max(self.step, rows[-1]["step"]), rows[-1]["time"]

    @staticmethod
    def pids(events: list[dict[str, Any]]) -> list[int]:
        return next((e["pids"] for e in reversed(events) if "pids" in e), [])

    @staticmethod
    def world(events: list[dict[str, Any]]) -> int:
        size = 0
        for e in events:
            if e["event"] == "group_formed":
                size = e["world_size"]
            elif e["event"] == "resized":
                size = e["new_world_size"]
        return size


class FaultInjector(KillThread):
    """Injects the planned faults into the run writing `run_dir`, from outside by pid, each
    once training went on from the one before (a random delay later, but a kill right
    after a recovery), with enough workers left that one survives it; removes `pace` once
    done, so the run finishes unpaced. Stops early, the rest not injected, once the run is
    past `last_step`. `self.killed`: the faults injected (kind, ranks, pids, time)."""

    def __init__(self, run_dir: Path, plan: list[str], pace: Path, last_step: int, seed: int):
        super().__init__("bench-fault-injector")
        self.watch, self.plan, self.pace, self.last_step = RunWatch(run_dir), plan, pace, last_step
        self.rng = random.Random(seed)
        self.injected: list[dict[str, Any]] = []
        self.frozen: list[int] = []
        self.error: str | None = None

    def run(self) -> None:
        try:
            self._inject()
        except Exception as exc:  # noqa: BLE001 - reported with the figures
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.killed = {"faults": self.injected, "error": self.error}
            self.pace.unlink(missing_ok=True)

    def _inject(self) -> None:
        for kind in self.plan:
            killing = 2 if kind == "double_kill" else 1
            if kind != "kill_after_recovery":
                self._wait_for(lambda events: self._went_on(events) and RunWatch.world(events) > killing,
                               "training to go on from the previous fault with a worker to survive")
                time.sleep(self.rng.uniform(*RANDOM_DELAY_S))
            else:
                self._wait_for(lambda events: self._recovered(events) and RunWatch.world(events) > killing,
                               "the previous fault's recovery")
            self.watch.refresh()
            if self.done.is_set() or self.watch.step >= self.last_step:
                return
            events = self.watch.events()
            pids = RunWatch.pids(events)
            ranks = [0] if kind == "kill_rank_0" else self.rng.sample(range(len(pids)), killing)
            times = []
            for i, rank in enumerate(ranks):
                if i:
                    time.sleep(DOUBLE_KILL_GAP_S)
                times.append(time.time())
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pids[rank], signal.SIGSTOP if kind == "freeze" else signal.SIGKILL)
                if kind == "freeze":
                    self.frozen.append(pids[rank])
            self.injected.append({"fault": kind, "ranks": ranks, "pids": [pids[r] for r in ranks],
                                  "at": times[0], "times": times, "step_seen": self.watch.step,
                                  "world": RunWatch.world(events), "events_before": len(events)})
        self._wait_for(lambda events: self._went_on(events) and RunWatch.world(events) == self._full(events),
                       "the last recovery and the group back to size")

    def _recovered(self, events: list[dict[str, Any]]) -> bool:
        """The last fault injected has its `recovered` event."""
        if not self.injected:
            return True
        return any(e["event"] == "recovered" for e in events[self.injected[-1]["events_before"]:])

    def _went_on(self, events: list[dict[str, Any]]) -> bool:
        """Recovered from the last fault, and a training step ended since the last event."""
        self.watch.refresh()
        return self._recovered(events) and bool(events) and self.watch.rows_at > events[-1]["time"]

    @staticmethod
    def _full(events: list[dict[str, Any]]) -> int:
        return next(e["world_size"] for e in events if e["event"] == "group_formed")

    def _wait_for(self, ready, what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not self.done.is_set() and not ready(self.watch.events()):
            if time.monotonic() > deadline:
                raise BenchError(f"waited {WAIT_S:g} s for {what}")
            self.watch.refresh()
            if self.watch.step >= self.last_step:
                return
            time.sleep(0.02)

    def result(self) -> dict[str, Any] | None:
        out = super().result()
        for pid in self.frozen:  # the driver kills a frozen worker; one it did not, this does
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return out


def _faults_config(spec: dict[str, Any], work: Path, name: str, pace: Path | None) -> dict[str, Any]:
    return rt.config(
        spec, work, name, spec["faults_steps"], workers=spec["faults_workers"],
        task_args={"pace_while": str(pace), "pace_s": spec["kill_pace_s"]} if pace else None,
        failure={"step_timeout_s": spec["faults_step_timeout_s"], "max_failures": 2 * spec["faults_count"] + 4,
                 "collective_timeout_s": FAULTS_COLLECTIVE_TIMEOUT_S})


def faults_raytrainer(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """The faults run and its undisturbed twin on one local Ray, then the node run on a
    local multi-node Ray; the figures of every fault."""
    import ray

    from ..driver.api import init_ray, train

    plan = fault_plan(spec)
    loads: list[tuple[float, float]] = []  # (time, 1-minute load average): the machine is shared
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(1.0):
            loads.append((time.time(), os.getloadavg()[0]))

    threading.Thread(target=sample, daemon=True, name="bench-load").start()
    init_ray(num_cpus=spec["faults_workers"])  # as raytrainer.train would, with a CPU per worker
    try:
        base = train(_faults_config(spec, work, "bench-undisturbed", None), progress=False)
        run_dir = work / "bench-faults"
        pace = work / "faults-pace"
        pace.touch()
        injector = FaultInjector(run_dir, plan, pace, last_step=int(0.9 * spec["faults_steps"]), seed=spec["seed"])
        injector.start()
        try:
            result = train(_faults_config(spec, work, run_dir.name, pace), progress=False)
        finally:
            injected = injector.result() or {"faults": [], "error": "the injector did not start"}
    finally:
        ray.shutdown()
    node = node_loss_raytrainer(spec, work)
    sampling.set()
    if any(e["event"] == "worker_failed" for e in base.events):
        raise BenchError(f"the undisturbed run had a failure; events: {base.events}")
    rows = [(r["step"], r["time"]) for r in result.history if "loss" in r]
    faults = recoveries(injected["faults"], result.events, rows, loads) + [node["fault"]]
    out = {**rt.outcome(result), "faults": faults, "plan": plan, "injector_error": injected["error"],
           "step_timeout_s": spec["faults_step_timeout_s"], "load_samples": loads,
           "failures": sum(e["event"] == "worker_failed" for e in result.events),
           **compare_weights(base.run_dir / "model.pt", result.run_dir / "model.pt"),
           **compare_losses(base.history, result.history),
           **summary(faults), "node": node, "undisturbed_run_dir": str(base.run_dir)}
    if injected["error"] or len(injected["faults"]) < len(plan):
        out["incomplete"] = (f"{len(injected['faults'])} of {len(plan)} faults injected"
                             + (f": {injected['error']}" if injected["error"] else ""))
    return out


def compare_weights(a_path: Path, b_path: Path) -> dict[str, Any]:
    """Whether two model.pt are bit-identical, else within float tolerance (rtol 1e-4,
    atol 1e-5, as the tests check resizes), and their largest difference."""
    import torch

    a, b = (torch.load(p, weights_only=True) for p in (a_path, b_path))
    identical = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    close = a.keys() == b.keys() and all(torch.allclose(a[k].float(), b[k].float(), rtol=1e-4, atol=1e-5) for k in a)
    diff = max((float((a[k].float() - b[k].float()).abs().max()) for k in a if k in b), default=float("nan"))
    return {"bit_identical": identical, "within_tolerance": close, "max_abs_diff": 0.0 if identical else diff}


def compare_losses(base: list[dict[str, Any]], faulted: list[dict[str, Any]]) -> dict[str, Any]:
    """The training losses of the two runs: the first step where they differ (None: never),
    the largest relative difference there, and the mean loss over the last tenth of the
    steps, faulted over undisturbed. A resize changes sums' order only, but over thousands
    of steps such rounding grows (a chaotic trajectory): the losses say whether the runs
    still train alike."""
    a, b = ({r["step"]: r["loss"] for r in rows if "loss" in r} for rows in (base, faulted))
    steps = sorted(set(a) & set(b))
    first = next((s for s in steps if a[s] != b[s]), None)
    tail = steps[-max(1, len(steps) // 10):]
    return {"identical_until_step": None if first is None else first - 1,
            "first_difference_rel": abs(a[first] - b[first]) / abs(a[first]) if first is not None and a[first] else 0.0,
            "loss_ratio_last_tenth": sum(b[s] for s in tail) / sum(a[s] for s in tail) if tail else None}


def recoveries(injected: list[dict[str, Any]], events: list[dict[str, Any]], rows: list[tuple[int, float]],
               loads: list[tuple[float, float]] = ()) -> list[dict[str, Any]]:
    """One entry per fault injected: the `recovered` events between it and the next fault,
    and times from the fault to the end of rank 0's first step after the last of them."""
    out = []
    for i, fault in enumerate(injected):
        until = injected[i + 1]["at"] if i + 1 < len(injected) else math.inf
        window = [e for e in events if fault["at"] <= e["time"] < until]
        out.append(fault_entry(fault, window, rows, loads))
    return out


def fault_entry(fault: dict[str, Any], window: list[dict[str, Any]], rows: list[tuple[int, float]],
                loads: list[tuple[float, float]] = ()) -> dict[str, Any]:
    """The figures of one fault from the events it caused (`window`) and rank 0's (step,
    time) rows."""
    recovered = [e for e in window if e["event"] == "recovered"]
    back = recovered[-1]["time"] if recovered else None
    first_after = min((t for _, t in rows if back is not None and t > back), default=None)
    detected = recovered[0]["time"] - recovered[0]["seconds"] if recovered else None
    to_first = first_after - fault["at"] if first_after is not None else None
    from_detection = first_after - detected if first_after is not None else None
    measured = from_detection if fault["fault"] == "freeze" else to_first
    regrown = [e for e in window if e["event"] == "resized" and e["cause"] in ("lost workers replaced", "room to grow")]
    entry = {
        **fault, "recoveries": len(recovered),
        "failed": [{k: f.get(k) for k in ("rank", "kind", "step", "time")} for f in window
                   if f["event"] == "worker_failed"],
        "detect_s": detected - fault["at"] if detected is not None else None,
        "fault_to_first_step_s": to_first, "detection_to_first_step_s": from_detection, "recovery_s": measured,
        "steps_lost": sum(e["steps_lost"] for e in recovered), "attempts": sum(e["attempts"] for e in recovered),
        "spares": [r for e in recovered for r in e.get("spares", [])],
        "dropped": [r for e in recovered for r in e.get("dropped", [])],
        "regrow_pauses_s": [e["seconds"] for e in regrown],
        "regrown_after_s": [e["time"] - fault["at"] for e in regrown],
        "load": min(loads, key=lambda tl: abs(tl[0] - fault["at"]))[1] if loads else None,
        "goal_s": RECOVERY_GOAL_S,
    }
    entry["goal_met"] = measured is not None and measured <= RECOVERY_GOAL_S and entry["steps_lost"] == 0
    return entry


def summary(faults: list[dict[str, Any]]) -> dict[str, Any]:
    """p50, p95 (nearest rank) and max of the recovery times, steps lost, goals met."""
    times = sorted(f["recovery_s"] for f in faults if f["recovery_s"] is not None)
    pauses = sorted(p for f in faults for p in f["regrow_pauses_s"])

    def pct(values: list[float], q: float) -> float | None:
        return values[max(0, math.ceil(q * len(values)) - 1)] if values else None

    return {"faults_injected": len(faults), "faults_recovered": len(times),
            "recovery_p50_s": pct(times, 0.5), "recovery_p95_s": pct(times, 0.95),
            "recovery_max_s": times[-1] if times else None,
            "steps_lost_total": sum(f["steps_lost"] for f in faults),
            "regrow_pause_p50_s": pct(pauses, 0.5), "regrow_pause_max_s": pauses[-1] if pauses else None,
            "goals_met": sum(f["goal_met"] for f in faults)}


# ---------------------------------------------------------------------- the node run


def _cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds of live processes, by pid (/proc/PID/stat)."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for pid in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _ray_daemons(cluster: Any) -> dict[str, list[int]]:
    """The pids of the GCS, the raylets and the dashboard agents of a cluster_utils Ray."""
    nodes = [cluster.head_node, *cluster.worker_nodes]
    raylets = [n.all_processes["raylet"][0].process.pid for n in nodes if "raylet" in n.all_processes]
    agents = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid in raylets and b"DashboardAgent" in Path(f"/proc/{pid}/cmdline").read_bytes():
                agents.append(int(pid))
    return {"gcs": [cluster.head_node.all_processes["gcs_server"][0].process.pid], "raylets": raylets,
            "agents": agents}


def node_loss_raytrainer(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """See the module's docstring, 2."""
    import ray

    from ..driver.api import train

    cluster = rt.local_cluster()
    pace = work / "node-pace"
    pace.touch()
    run_dir = work / "bench-node"
    cfg = rt.config(spec, work, run_dir.name, spec["node_steps"], workers=2,
                    task_args={"pace_while": str(pace), "pace_s": NODE_PACE_S},
                    scaling={"min_workers": 2, "max_workers": 3},
                    failure={"step_timeout_s": spec["faults_step_timeout_s"], "max_failures": 4,
                             "collective_timeout_s": FAULTS_COLLECTIVE_TIMEOUT_S})
    out: dict[str, Any] = {}
    watch = RunWatch(run_dir)

    def target() -> None:
        try:
            out["result"] = train(cfg, progress=False)
        except BaseException as exc:  # noqa: BLE001 - raised below, in this thread
            out["error"] = exc

    def wait(ready, what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not ready():
            if not thread.is_alive():
                raise BenchError(f"the node run ended while waiting for {what}: {out.get('error')}")
            if time.monotonic() > deadline:
                raise BenchError(f"waited {WAIT_S:g} s for {what}; events: {watch.events()}")
            time.sleep(0.02)

    def unpaced_window() -> dict[str, Any]:
        """node_window_steps unpaced steps: their rate, and the daemons' CPU seconds per second."""
        daemons = _ray_daemons(cluster)
        watch.refresh()
        start_step, t0 = watch.step, time.time()
        cpu0 = {k: _cpu_seconds(v) for k, v in daemons.items()}
        pace.unlink()
        wait(lambda: (watch.refresh(), watch.step >= start_step + spec["node_window_steps"])[1], "a window of steps")
        pace.touch()
        seconds = time.time() - t0
        return {"steps": watch.step - start_step, "seconds": seconds, "world": RunWatch.world(watch.events()),
                "cpu_per_s": {k: (_cpu_seconds(v) - cpu0[k]) / seconds for k, v in daemons.items()},
                "from_step": start_step}

    thread = threading.Thread(target=target, daemon=True, name="bench-node-run")
    try:
        first, second = (cluster.add_node(num_cpus=1) for _ in range(2))
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING")
        thread.start()
        wait(lambda: (watch.refresh(), watch.step > 10)[1], "training at 2 workers")
        before = unpaced_window()
        cluster.add_node(num_cpus=1)
        wait(lambda: RunWatch.world(watch.events()) == 3, "the group to grow to 3")
        wait(lambda: (watch.refresh(), watch.rows_at > watch.events()[-1]["time"])[1], "steps at 3 workers")
        events = watch.events()
        last = RunWatch.pids(events)[-1]
        from ..driver.group.actors import alive_nodes

        raylets = {n.all_processes["raylet"][0].process.pid: n for n in cluster.worker_nodes}
        with open(f"/proc/{last}/stat") as f:
            node = raylets[int(f.read().rsplit(")", 1)[1].split()[1])]  # the last rank's raylet is its parent
        lost_at = time.time()
        cluster.remove_node(node, allow_graceful=False)
        with contextlib.suppress(ProcessLookupError):  # on one machine a node's workers outlive its raylet
            os.kill(last, signal.SIGKILL)
        wait(lambda: RunWatch.world(watch.events()) == 2, "the group to go on at 2")
        wait(lambda: node.node_id not in alive_nodes(), "Ray to hold the node dead")
        dead_at = time.time()
        time.sleep(2.0)  # its placement group rescheduling, if anything was left there
        after = unpaced_window()
        regrow_from = len(watch.events())
        cluster.add_node(num_cpus=1)
        wait(lambda: RunWatch.world(watch.events()) == 3, "the group to grow back to 3")
        pace.unlink()
        thread.join()
    finally:
        pace.unlink(missing_ok=True)
        ray.shutdown()
        cluster.shutdown()
    if "error" in out:
        raise out["error"]
    result = out["result"]
    rows = [(r["step"], r["time"]) for r in result.history if "loss" in r]
    window = [e for e in result.events if lost_at <= e["time"] < dead_at]
    fault = fault_entry({"fault": "node_lost", "ranks": [2], "pids": [last], "at": lost_at, "times": [lost_at]},
                        window, rows)
    regrow = [e for e in result.events[regrow_from:] if e["event"] == "resized"][:1]
    before_rate, after_rate = before["steps"] / before["seconds"], after["steps"] / after["seconds"]
    return {"fault": fault, "before": before, "after": after, "steps_per_s_before": before_rate,
            "steps_per_s_after": after_rate, "after_over_before": after_rate / before_rate,
            "dead_after_s": dead_at - lost_at, "regrow_pause_s": regrow[0]["seconds"] if regrow else None,
            "step_times": [t for _, t in rows], "events": result.events}
