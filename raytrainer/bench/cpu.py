"""Where the CPU goes: the CPU seconds of every process of a contender run, by role.

On a small machine every CPU-second spent outside the training processes (the driver,
Ray's daemons, a warm spare, loader processes) comes out of training, and CPU seconds,
unlike steps/s, barely move with the machine's load: they drive the overhead work.

A contender runs in a session of its own (run.launch: start_new_session), and every
process it starts inherits it: Ray's daemons (gcs_server, raylet, the dashboard and its
agents, the log monitor, ...), Ray's worker processes, torch.multiprocessing's ranks,
loader processes. `Sampler` (a thread of the bench's own process) reads /proc/PID/stat of
every process of that session every `interval_s`: utime + stime (its own CPU), cutime +
cstime (that of its children that exited and were reaped), its parent, and its command
line (Ray's workers retitle themselves: `ray::IDLE`, `ray::Worker.run`). `window` then
interpolates each process's CPU at the two ends of a window of the run (the steady
state of a train run: two step times) and names each by its role (`role`), from its
command line and its parentage. The machine's busy CPU over the same window (/proc/stat)
says how much the other work on the machine took meanwhile.

Linux only (/proc); elsewhere a run records no CPU figures.
"""

from __future__ import annotations

import os
import re
import statistics
import threading
import time
from pathlib import Path
from typing import Any

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

ROLES = ("training workers", "loader processes", "driver", "warm spare", "idle Ray workers", "raylet",
         "gcs_server", "dashboard", "dashboard agent", "runtime-env agent", "log monitor",
         "autoscaler monitor", "Ray Train's actors", "other")
"""The rows of the CPU table, in order."""
OUTSIDE = tuple(r for r in ROLES if r != "training workers")


def _boot_time() -> float:
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        pass
    return 0.0


def read_stat(pid: int | str) -> tuple[int, int, float, float, float] | None:
    """(ppid, session, own CPU s, reaped children's CPU s, start time as time.time()) of
    a process, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_bytes().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return (int(fields[1]), int(fields[3]), (int(fields[11]) + int(fields[12])) / TICK,
            (int(fields[13]) + int(fields[14])) / TICK, int(fields[19]) / TICK)


def read_cmdline(pid: int | str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (all cores, all processes)."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return (sum(values[:8]) - idle) / TICK  # guest time is already in user time


class Sampler:
    """Samples the CPU of every process of session `session` (a contender's) every
    `interval_s`, on a thread of its own, from start() to stop()."""

    def __init__(self, session: int, interval_s: float = 0.2):
        self.session, self.interval_s = session, interval_s
        self.procs: dict[int, dict[str, Any]] = {}  # pid -> ppid, start, titles seen, samples
        self.machine: list[tuple[float, float]] = []  # (time, machine busy s)
        self.cost_s = 0.0  # this sampler's own CPU (thread time)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-cpu-sampler", daemon=True)
        self._boot = _boot_time()
        self._rounds = 0

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            t0 = time.thread_time()
            self.sample()
            self.cost_s += time.thread_time() - t0
            if self._stop.wait(self.interval_s):
                self.sample()  # the last state: a run's processes may be exiting
                return

    def sample(self) -> None:
        now = time.time()
        busy = machine_busy_s()
        if busy is not None:
            self.machine.append((now, busy))
        self._rounds += 1
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            stat = read_stat(name)
            if stat is None or stat[1] != self.session:
                continue
            pid = int(name)
            ppid, _, own, reaped, started = stat
            proc = self.procs.get(pid)
            if proc is None or proc["start"] != self._boot + started:  # new (or a reused pid)
                proc = self.procs[pid] = {"ppid": ppid, "start": self._boot + started, "titles": [],
                                          "samples": []}
            if not proc["titles"] or self._rounds % 5 == 0:  # Ray's workers retitle themselves
                title = read_cmdline(pid)
                if title and title not in proc["titles"]:
                    proc["titles"].append(title)
            proc["samples"].append((now, own, reaped))

    def window(self, t0: float, t1: float, training_pids: set[int] | None = None) -> dict[str, Any]:
        """The CPU seconds of every process between t0 and t1, by role (see `role`);
        `training_pids`: the training workers' pids where the run knows them."""
        roles = roles_of(self.procs, training_pids)
        processes = []
        for pid, proc in self.procs.items():
            own = _at(proc, t1, 1) - _at(proc, t0, 1)
            reaped = _at(proc, t1, 2) - _at(proc, t0, 2)
            if own <= 0 and reaped <= 0:
                continue
            processes.append({"pid": pid, "ppid": proc["ppid"], "role": roles[pid], "cpu_s": round(own, 3),
                              "children_cpu_s": round(reaped, 3), "title": proc["titles"][-1][:160]
                              if proc["titles"] else ""})
        # A child reaped in the window adds its whole life's CPU to its parent's cutime.
        # Those the samples saw count by their own samples (as their role); what is left
        # (children that lived between two samples, the tail after a last sample) counts
        # for the parent's role.
        by_role = {r: 0.0 for r in ROLES}
        for p in processes:
            by_role[p["role"]] += p["cpu_s"]
        for p in processes:
            seen_dead = sum(c["samples"][-1][1] for c in self.procs.values()
                            if c["ppid"] == p["pid"] and t0 <= c["samples"][-1][0] < t1 - self.interval_s)
            p["unseen_children_cpu_s"] = round(max(0.0, p["children_cpu_s"] - seen_dead), 3)
            by_role[p["role"]] += p["unseen_children_cpu_s"]
        total = sum(by_role.values())
        machine = _machine_delta(self.machine, t0, t1)
        return {"window": [t0, t1], "seconds": t1 - t0,
                "by_role": {r: round(v, 3) for r, v in by_role.items() if v > 0},
                "total_s": round(total, 3),
                "outside_training_s": round(total - by_role["training workers"], 3),
                "machine_busy_s": None if machine is None else round(machine, 3),
                "others_on_machine_s": None if machine is None else round(max(0.0, machine - total), 3),
                "cores": os.cpu_count(), "sampler_cpu_s": round(self.cost_s, 3),
                "processes": sorted(processes, key=lambda p: -p["cpu_s"])}


def _at(proc: dict[str, Any], t: float, field: int) -> float:
    """A process's cumulative CPU (field 1: own, 2: reaped children) at time t: its own,
    linear between samples (it grows as it runs); its reaped children's, as of the last
    sample at or before t (it jumps when a child is reaped: a run's loader processes,
    reaped after its last step, must not count in a window that ends there). 0 at its
    start; its last value after its last sample."""
    samples = proc["samples"]
    if not samples or t <= proc["start"]:
        return 0.0
    prev = (proc["start"], 0.0, 0.0)
    for sample in samples:
        if sample[0] >= t:
            if field == 2:
                return sample[2] if sample[0] == t else prev[2]
            span = sample[0] - prev[0]
            share = (t - prev[0]) / span if span > 0 else 1.0
            return prev[field] + share * (sample[field] - prev[field])
        prev = sample
    return samples[-1][field]


def _machine_delta(series: list[tuple[float, float]], t0: float, t1: float) -> float | None:
    if len(series) < 2 or series[0][0] > t0 or series[-1][0] < t1:
        return None
    proc = {"start": series[0][0] - 1, "samples": [(t, v, 0.0) for t, v in series]}
    return _at(proc, t1, 1) - _at(proc, t0, 1)


def role(title: str) -> str | None:
    """A process's role from its command line alone; None: from its parentage (roles_of)."""
    checks = (
        ("/raylet/raylet", "raylet"), ("/gcs/gcs_server", "gcs_server"),
        ("dashboard/dashboard.py", "dashboard"), ("ray::DashboardAgent", "dashboard agent"),
        ("dashboard/agent.py", "dashboard agent"), ("ray::RuntimeEnvAgent", "runtime-env agent"),
        ("runtime_env/agent/main.py", "runtime-env agent"), ("log_monitor.py", "log monitor"),
        ("autoscaler/_private/monitor.py", "autoscaler monitor"), ("ray::IDLE", "idle Ray workers"),
        ("ray::TrainController", "Ray Train's actors"), ("ray::SynchronizationActor", "Ray Train's actors"),
        ("ray::PlacementGroupCleaner", "Ray Train's actors"), ("ray::PreemptionWatcher", "Ray Train's actors"),
        ("ray::_AutoscalingCoordinatorActor", "Ray Train's actors"), ("raytrainer.bench _contender", "driver"),
    )
    for needle, name in checks:
        if needle in title:
            return name
    return None


def roles_of(procs: dict[int, dict[str, Any]], training_pids: set[int] | None = None) -> dict[int, str]:
    """pid -> role. Training workers: `training_pids`, else Ray workers seen running their
    training call (`ray::Worker.run`, Ray Train's `RayTrainWorker`) and raw DDP's spawned
    ranks; a raytrainer worker actor that never trained is the warm spare; whatever a
    training worker starts (a fork server, loader processes) is its loaders'; a Ray daemon's
    own children (the dashboard's modules) are the daemon's."""
    direct: dict[int, str | None] = {}
    for pid, proc in procs.items():
        # A title its parent has too was read between fork and exec (a Ray worker the
        # raylet is starting): it says nothing of this process.
        parent = procs.get(proc["ppid"])
        titles = [_unnamed(t) for t in proc["titles"] if parent is None or t not in parent["titles"]]
        # Its latest title says most: a Ray worker process is `ray::IDLE` until it hosts an actor.
        named = [r for r in map(role, reversed(titles)) if r is not None]
        found = next((r for r in named if r != "idle Ray workers"), named[0] if named else None)
        if training_pids is not None and pid in training_pids:
            found = "training workers"
        elif found in (None, "idle Ray workers"):
            if any(_trains(t) for t in titles):
                found = "training workers" if training_pids is None else "warm spare"
            elif any(t.startswith("ray::Worker") for t in titles):
                # raytrainer's worker class: without the run's pids a spare cannot be told apart
                found = "warm spare" if training_pids is not None else "training workers"
            elif any("multiprocessing.spawn" in t for t in titles) and _parent_role(procs, pid, direct) == "driver":
                found = "training workers"  # raw DDP's ranks (torch.multiprocessing, spawn)
        direct[pid] = found

    def resolve(pid: int, depth: int = 0) -> str:
        found = direct.get(pid)
        parent = procs[pid]["ppid"]
        if parent in procs and depth < 20:
            above = resolve(parent, depth + 1)
            if above in ("training workers", "loader processes") and found in (None, "idle Ray workers"):
                return "loader processes"  # forked by a rank: DataLoader's processes, a fork server
            if found is None and above not in ("driver", "raylet"):
                return above  # a daemon's helpers count as the daemon
        return found or "other"

    return {pid: resolve(pid) for pid in procs}


def _unnamed(title: str) -> str:
    """A Ray worker's title without its actor's name: raytrainer's workers are named
    (`ray::raytrainer-<hex>:Worker.run`, contract.NAMESPACE) so that a new driver finds them."""
    return re.sub(r"^ray::raytrainer-[0-9a-f]+:", "ray::", title)


def _trains(title: str) -> bool:
    return title.startswith(("ray::Worker.run", "ray::RayTrainWorker")) or "ray::_RayTrainWorker" in title


def _parent_role(procs: dict[int, dict[str, Any]], pid: int, direct: dict[int, str | None]) -> str | None:
    parent = procs.get(procs[pid]["ppid"])
    return next((r for r in map(role, parent["titles"]) if r is not None), None) if parent else None


def per_1000_steps(cpu: dict[str, Any], steps: int) -> dict[str, float]:
    """CPU seconds per 1000 steps, by role, with the totals."""
    scale = 1000 / max(steps, 1)
    out = {r: round(v * scale, 3) for r, v in cpu["by_role"].items()}
    out["total"] = round(cpu["total_s"] * scale, 3)
    out["outside training workers"] = round(cpu["outside_training_s"] * scale, 3)
    if cpu.get("others_on_machine_s") is not None:
        out["others on the machine"] = round(cpu["others_on_machine_s"] * scale, 3)
    return out


def window_rates(times: list[float], size: int = 200) -> list[float]:
    """Steps/s of consecutive `size`-step windows of step end times (fewer steps than a
    window: one window of all of them)."""
    size = max(1, min(size, len(times) - 1))
    return [size / max(times[i + size] - times[i], 1e-9) for i in range(0, len(times) - size, size)]


def spread(values: list[float]) -> dict[str, float] | None:
    """median, min, quartiles and max."""
    if not values:
        return None
    ordered = sorted(values)
    q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else ordered * 3
    return {"median": statistics.median(ordered), "min": ordered[0], "q1": q1, "q3": q3, "max": ordered[-1],
            "windows": len(ordered)}
