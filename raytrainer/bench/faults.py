"""The faults run: one raytrainer run with five faults, `faults_every` steps apart so that
each recovery (and the warm spare it uses up) is done before the next, beside an
undisturbed run of the same config (same seed, same world size) in the same contender
process, on the same Ray: the faulted run must end with bit-identical weights. The
single kills and the freeze are failure.chaos faults with at=random: a timer thread in
the worker fires at a seeded random moment of the step (forward, backward, a collective,
the optimizer), and the worker's own code does not know. The double kill comes from
outside: a thread here SIGKILLs two workers by pid, DOUBLE_KILL_GAP_S apart, once
metrics.jsonl shows the step, so the second lands while the first recovery is under way."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from . import rt
from .kill import KillThread
from .spec import BenchError

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
    return rt.config(
        spec, work, name, (len(FAULTS) + 1) * spec["faults_every"], workers=spec["faults_workers"],
        # Room for every fault's failures and two more: an extra one is reported, not fatal.
        failure={"chaos": chaos, "step_timeout_s": spec["faults_step_timeout_s"],
                 "max_failures": sum(len(r) for _, r in FAULTS) + 2,
                 "collective_timeout_s": FAULTS_COLLECTIVE_TIMEOUT_S})


class _DoubleKiller(KillThread):
    """SIGKILLs the workers of `ranks`, `gap_s` apart, once a training row at or after
    `step` is in the run's metrics.jsonl (pids: the newest event that lists them)."""

    def __init__(self, run_dir: Path, step: int, ranks: list[int], gap_s: float):
        super().__init__("bench-double-killer")
        self.run_dir, self.step, self.ranks, self.gap_s = run_dir, step, ranks, gap_s

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


def faults_raytrainer(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """The undisturbed run, then the faulted one, on one local Ray; the figures of each
    recovery and whether the two runs' final weights are bit-identical."""
    import ray
    import torch

    from ..driver.api import init_ray, train

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
    init_ray(num_cpus=spec["faults_workers"])  # as raytrainer.train would, with a CPU per worker
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
    return {**rt.outcome(result),
            "faults": plan, "step_timeout_s": spec["faults_step_timeout_s"],
            "recoveries": recoveries(plan, result.events, rows, spec["faults_step_timeout_s"], loads),
            "load_samples": loads,
            "failures": sum(e["event"] == "worker_failed" for e in result.events),
            "bit_identical": identical,
            "max_abs_diff": 0.0 if identical else max(
                (float((a[k].float() - b[k].float()).abs().max()) for k in a if k in b), default=float("nan")),
            "undisturbed_run_dir": str(base.run_dir)}


def recoveries(plan: list[dict[str, Any]], events: list[dict[str, Any]], rows: list[tuple[int, float]],
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
