"""Recovery at the size of real models: where the time of a state hand-over goes, and what
a kill, a fast recovery and a grow cost, against the size of the training state.

    python -m raytrainer.bench.state_size transfer --state-mb 500 [--repeat 2]
    python -m raytrainer.bench.state_size kill --state-mb 500 [--spares 1] [--kill-step 6]
    python -m raytrainer.bench.state_size malloc --state-mb 500 [--repeat 3]

`transfer`: two Ray actors on a local Ray; one holds a model of `layers` x
Linear(width, width) with Adam after a step (training state: weights and Adam's two
moments, `--state-mb` in total), the other builds the same model and takes the state, as a
replacement does in a recovery. Each phase timed where it runs: the holder's serialisation
(and the copy into the object store), the taker's fetch from the object store,
deserialisation and load into its model and optimizer. Two ways: `bytes`, the hand-over
before this bench existed (torch.save to bytes, torch.load), and `packed`, today's
(worker/state/transfer.py: numpy views, one copy in, one copy out). The driver never fetches the
state.

`kill`: a run of that model on 2 CPU workers (default settings, `failure.warm_spares` as
given) SIGKILLs rank 1's process once step `--kill-step` is in metrics.jsonl; read from the
run's events and metrics: the kill to the `worker_failed` event (detection), the recovery
(`recovered` seconds), the kill to the next step's row, the steps' own time, and with no
spare the grow that takes the replacement back in (`resized` seconds: the pause). The
driver's peak RSS is read at the end. Figures depend on the machine's load: name it.

`malloc`: the model's step (one process, on a thread other than the main one, as a Ray
worker runs its calls) with glibc's malloc settings as they are by default and as a Ray
raytrainer starts sets them (driver/localray.py), interleaved, `--repeat` processes each:
each process's median step after the first (the first allocates Adam's moments).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..driver.localray import MALLOC_SETTINGS
from .driver_memory import BigStateTask
from .job import malloc_settings

TASK = "raytrainer.bench.state_size:StackTask"
WIDTH = 4096


class StackTask(BigStateTask):
    """`layers` x Linear(width, width) with Adam, regressing a fixed random map (the data and
    the step are driver_memory's)."""

    def __init__(self, width: int = WIDTH, layers: int = 8, samples: int = 64):
        super().__init__(width, samples)
        self.layers = layers

    def build_model(self):
        import torch

        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(self.width, self.width) for _ in range(self.layers)])

    def build_optimizer(self, model):
        import torch

        return torch.optim.Adam(model.parameters(), lr=1e-5)


def layers_for(state_mb: float, width: int = WIDTH) -> int:
    """Layers whose weights, biases and Adam moments (fp32, 3 copies) make ~`state_mb` MB."""
    return max(1, round(state_mb * 1e6 / (3 * 4 * (width * width + width))))


def state_bytes(layers: int, width: int = WIDTH) -> int:
    return 3 * 4 * layers * (width * width + width)


# ---------------------------------------------------------------------------- transfer


class _Holder:
    def __init__(self, layers: int, width: int):
        import torch

        torch.set_num_threads(1)
        task = StackTask(width, layers)
        self.model = task.build_model()
        self.optimizer = task.build_optimizer(self.model)
        self.model(torch.randn(4, width)).sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def ready(self) -> int:
        return os.getpid()

    def give(self, how: str) -> tuple[dict[str, float], Any]:
        import torch

        t0 = time.perf_counter()
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        if how == "bytes":
            buffer = io.BytesIO()
            torch.save(state, buffer)
            out: Any = buffer.getvalue()
        else:
            from ..worker.state.transfer import pack

            out = pack(state)
        return {"serialise_s": time.perf_counter() - t0, "given_at": time.time()}, out


class _Taker(_Holder):
    def take(self, how: str, state: Any, given_at: float) -> dict[str, float]:
        import torch

        fetched = time.time()  # the argument was fetched from the object store before this call
        t0 = time.perf_counter()
        if how == "bytes":
            loaded = torch.load(io.BytesIO(state), weights_only=True)
        else:
            from ..worker.state.transfer import unpack

            loaded = unpack(state)
        t1 = time.perf_counter()
        self.model.load_state_dict(loaded["model"])
        self.optimizer.load_state_dict(loaded["optimizer"])
        t2 = time.perf_counter()
        return {"deserialise_s": t1 - t0, "load_s": t2 - t1, "called_at": fetched, "given_at": given_at}


def measure_transfer(state_mb: float, repeat: int = 2, width: int = WIDTH) -> dict[str, Any]:
    import ray

    layers = layers_for(state_mb, width)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        holder = ray.remote(num_cpus=1)(_Holder).remote(layers, width)
        taker = ray.remote(num_cpus=1)(_Taker).remote(layers, width)
        ray.get([holder.ready.remote(), taker.ready.remote()])
        rows = []
        for _ in range(repeat):
            for how in ("bytes", "packed"):
                t0 = time.perf_counter()
                info, state = holder.give.options(num_returns=2).remote(how)
                given = ray.get(info)
                ray.wait([state], fetch_local=False)
                t_given = time.perf_counter()
                took = ray.get(taker.take.remote(how, state, time.time()))
                t_done = time.perf_counter()
                del state
                rows.append({
                    "how": how, "serialise_and_put_s": round(t_given - t0, 3),
                    "serialise_s": round(given["serialise_s"], 3),
                    "put_s": round(t_given - t0 - given["serialise_s"], 3),
                    "fetch_s": round(took["called_at"] - took["given_at"], 3),
                    "deserialise_s": round(took["deserialise_s"], 3), "load_s": round(took["load_s"], 3),
                    "total_s": round(t_done - t0, 3),
                })
                print(json.dumps(rows[-1]), flush=True)
    finally:
        ray.shutdown()
    return {"state_bytes": state_bytes(layers, width), "layers": layers, "width": width, "rows": rows,
            "driver_peak_rss_bytes": _peak_rss_bytes()}


# ---------------------------------------------------------------------------- kill


def config(storage: str, layers: int, width: int, steps: int, spares: int) -> dict[str, Any]:
    return {
        "task": {"target": TASK, "args": {"width": width, "layers": layers}},
        "trainer": {"max_steps": steps, "global_batch_size": 8},
        "scaling": {"num_workers": 2},
        "failure": {"warm_spares": spares},
        "loggers": [],
        "run": {"name": "big", "storage": storage},
    }


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def driver_main(config_json: str, result_json: str) -> int:
    import raytrainer

    result = raytrainer.train(json.loads(config_json), progress=False)
    Path(result_json).write_text(json.dumps({"driver_peak_rss_bytes": _peak_rss_bytes(),
                                             "events": result.events}))
    return 0


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def measure_kill(state_mb: float, spares: int, kill_step: int = 6, steps: int = 14, width: int = WIDTH,
                 timeout_s: float = 1800.0) -> dict[str, Any]:
    layers = layers_for(state_mb, width)
    with tempfile.TemporaryDirectory(prefix="rt-statesize-") as work:
        result = Path(work) / "result.json"
        env = dict(os.environ, RAY_ADDRESS="local")
        driver = subprocess.Popen([sys.executable, "-m", "raytrainer.bench.state_size", "_driver",
                                   json.dumps(config(work, layers, width, steps, spares)), str(result)], env=env)
        run_dir = Path(work) / "big"
        killed_at = None
        deadline = time.monotonic() + timeout_s
        try:
            while driver.poll() is None:
                assert time.monotonic() < deadline, f"the run did not end within {timeout_s:g} s"
                if killed_at is None and any(r.get("step", 0) >= kill_step and "loss" in r
                                             for r in _read(run_dir / "metrics.jsonl")):
                    pid = next(e["pids"] for e in reversed(_read(run_dir / "events.jsonl")) if "pids" in e)[1]
                    killed_at = time.time()
                    os.kill(pid, signal.SIGKILL)
                time.sleep(0.05)
        finally:
            if driver.poll() is None:
                driver.kill()
        if driver.returncode != 0:
            raise RuntimeError(f"the driver exited {driver.returncode}")
        out = json.loads(result.read_text())
        rows = [r for r in _read(run_dir / "metrics.jsonl") if "loss" in r]
    events = out.pop("events")
    failed = next(e for e in events if e["event"] == "worker_failed")
    rec = next(e for e in events if e["event"] == "recovered")
    grow = next((e for e in events if e["event"] == "resized" and e["new_world_size"] > e["old_world_size"]), None)
    # The first step after the recovery (a row between the kill and the recovery is a step
    # that ended before the kill reached the process: the kill then cut the next one).
    after = next(r for r in rows if r["time"] > max(killed_at, rec["time"]))
    times = [r["time"] for r in rows]
    step_s = sorted(b - a for a, b in zip(times, times[1:]))
    before = [t for t in times if t <= killed_at][-4:]  # the last steps before the kill, as the run went then
    before_s = sorted(b - a for a, b in zip(before, before[1:]))
    return {
        "state_bytes": state_bytes(layers, width), "layers": layers, "width": width, "warm_spares": spares,
        "kill_to_failed_event_s": round(failed["time"] - killed_at, 3), "failed_cause": failed["cause"],
        "recovered_s": rec["seconds"], "steps_lost": rec["steps_lost"], "state_from": rec.get("state_from"),
        "secured": rec.get("secured"),
        "spares": rec.get("spares"), "dropped": rec.get("dropped"),
        "kill_to_next_step_s": round(after["time"] - killed_at, 3),
        "step_median_s": round(step_s[len(step_s) // 2], 3) if step_s else None,
        "steps_before_kill_median_s": round(before_s[len(before_s) // 2], 3) if before_s else None,
        "recovered_to_next_step_s": round(after["time"] - rec["time"], 3),
        "grow_pause_s": grow["seconds"] if grow else None,
        "driver_peak_rss_gb": round(out["driver_peak_rss_bytes"] / 1e9, 3),
    }


# ---------------------------------------------------------------------------- malloc


def steps_main(layers: int, width: int, steps: int) -> int:
    """Train the model `steps` steps on a thread; print the steps' seconds, their page faults
    (memory the step got fresh from the kernel) and the malloc settings this process ran
    with, as JSON."""
    import resource
    import threading

    import torch

    torch.set_num_threads(1)
    task = StackTask(width, layers)
    model = task.build_model()
    optimizer = task.build_optimizer(model)
    x, times, faults = torch.randn(8, width), [], []

    def train() -> None:
        for _ in range(steps):
            started, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            optimizer.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            optimizer.step()
            times.append(time.perf_counter() - started)
            faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

    thread = threading.Thread(target=train)
    thread.start()
    thread.join()
    print(json.dumps({"step_s": times, "faults": faults, "malloc": malloc_settings(os.environ)}))
    return 0


def measure_malloc(state_mb: float, repeat: int = 3, steps: int = 6, width: int = WIDTH) -> dict[str, Any]:
    layers = layers_for(state_mb, width)
    shell = malloc_settings(os.environ)
    defaults = {k: v for k, v in os.environ.items() if k not in shell}
    ways = {"glibc_defaults": defaults, "raytrainer": {**defaults, **MALLOC_SETTINGS}}
    out: dict[str, Any] = {"state_bytes": state_bytes(layers, width), "layers": layers, "width": width}
    for _ in range(repeat):
        for way, env in ways.items():  # interleaved: a drift of the machine's speed hits both
            proc = subprocess.run([sys.executable, "-m", "raytrainer.bench.state_size", "_steps", str(layers),
                                   str(width), str(steps)], env=env, capture_output=True, text=True, check=True)
            seen = json.loads(proc.stdout.splitlines()[-1])
            entry = out.setdefault(way, {"malloc": seen["malloc"], "first_step_s": [], "step_median_s": [],
                                         "faults_per_step": []})
            # Microseconds, not milliseconds: a small model's step rounded to 0 at 3 decimals.
            entry["first_step_s"].append(round(seen["step_s"][0], 6))
            entry["step_median_s"].append(round(statistics.median(seen["step_s"][1:]), 6))
            entry["faults_per_step"].append(round(statistics.mean(seen["faults"][1:])))  # 4 KB pages, after the first
    out["defaults_over_raytrainer"] = round(statistics.median(out["glibc_defaults"]["step_median_s"])
                                            / statistics.median(out["raytrainer"]["step_median_s"]), 2)
    return out


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if len(argv) == 3 and argv[0] == "_driver":
        return driver_main(argv[1], argv[2])
    if len(argv) == 4 and argv[0] == "_steps":
        return steps_main(*map(int, argv[1:]))
    parser = argparse.ArgumentParser(prog="python -m raytrainer.bench.state_size", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["transfer", "kill", "malloc"])
    parser.add_argument("--state-mb", type=float, default=500.0)
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--spares", type=int, default=1)
    parser.add_argument("--kill-step", type=int, default=6)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.what == "transfer":
        out = measure_transfer(args.state_mb, args.repeat, args.width)
    elif args.what == "malloc":
        out = measure_malloc(args.state_mb, args.repeat, args.steps, args.width)
    else:
        out = measure_kill(args.state_mb, args.spares, args.kill_step, args.steps, args.width)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
