"""Spot nodes on one machine: a run on a local multi-node Ray (ray.cluster_utils: a head with
no CPUs and 1-CPU nodes, as on a cloud cluster) whose nodes are lost and come back later.

    python -m examples.spot_nodes                          # a node away 3 min, then 10 losses
    python -m examples.spot_nodes --away-s 20 --losses 3   # shorter

A fixed-size run (scaling.num_workers 3, every other key its default) loses a node: it trains
on with 2 workers while the cluster has no room (a `waiting_for_capacity` event, the progress
line's `workers 2/3, waiting for room`), and grows back to 3 when a node starts. Then nodes are
lost and replaced `--losses` times. None of it fails the run (failure.max_losses: null) and no
step is lost; the summary says so from the run's events.jsonl and metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

from examples.linear import LinearTask


class PacedLinear(LinearTask):
    """The linear task, each step slowed by `pace_s` while the file `pace_while` exists, so
    that the run outlasts the show and then finishes at full speed."""

    def __init__(self, pace_while: str = "", pace_s: float = 0.05, **args):
        super().__init__(**args)
        self.pace_while, self.pace_s = pace_while, pace_s

    def train_step(self, model, batch):
        if self.pace_while and Path(self.pace_while).exists():
            time.sleep(self.pace_s)
        return super().train_step(model, batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--away-s", type=float, default=180.0, help="how long the lost node stays away")
    parser.add_argument("--losses", type=int, default=10, help="node losses after it, each replaced")
    args = parser.parse_args()

    import raytrainer
    from raytrainer.bench.rt import local_cluster

    work = Path(tempfile.mkdtemp(prefix="spot-nodes-"))
    pace = work / "pace"
    pace.touch()
    cluster = local_cluster()
    nodes = [cluster.add_node(num_cpus=1) for _ in range(3)]
    cluster.wait_for_nodes()
    import ray

    ray.init(address=cluster.address, logging_level="WARNING")
    config = {
        "task": {"target": "examples.spot_nodes:PacedLinear", "args": {"pace_while": str(pace)}},
        "trainer": {"max_steps": 20000, "max_epochs": 1000, "global_batch_size": 64, "log_every_n_steps": 1},
        "scaling": {"num_workers": 3},
        "run": {"name": "spot", "storage": str(work)},
    }
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(result=_train(raytrainer, config, out)), daemon=True)
    thread.start()
    run_dir = work / "spot"
    try:
        _wait(lambda: _worlds(run_dir)[-1:] == [3], thread, "3 workers training")
        t0 = time.monotonic()
        cluster.remove_node(nodes.pop(0))
        print(f"node lost; away for {args.away_s:g} s", flush=True)
        time.sleep(args.away_s)
        print(f"away {time.monotonic() - t0:.0f} s: the run trained on, at {_worlds(run_dir)[-1]} workers", flush=True)
        nodes.append(cluster.add_node(num_cpus=1))
        _wait(lambda: _regrown(run_dir) >= 1, thread, "the run back at 3 workers")
        for i in range(args.losses):
            cluster.remove_node(nodes.pop(0))
            nodes.append(cluster.add_node(num_cpus=1))
            _wait(lambda: _regrown(run_dir) >= i + 2, thread, f"loss {i + 1} recovered and regrown")
            print(f"loss {i + 1} of {args.losses}: recovered, back at 3 workers", flush=True)
    finally:
        pace.unlink()
        thread.join()
        ray.shutdown()
        cluster.shutdown()
    _summary(run_dir, out)


def _train(raytrainer, config, out):
    try:
        return raytrainer.train(config, progress=True)
    except BaseException as exc:  # noqa: BLE001 - shown in the summary
        out["error"] = exc


def _wait(predicate, thread, what: str, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if not thread.is_alive():
            raise SystemExit(f"the run ended while waiting for {what}")
        if time.monotonic() > deadline:
            raise SystemExit(f"no {what} within {timeout_s:g} s")
        time.sleep(0.5)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _worlds(run_dir: Path) -> list[int]:
    return [r["world_size"] for r in _lines(run_dir / "metrics.jsonl") if "loss" in r]


def _regrown(run_dir: Path) -> int:
    """How many times the run grew back to 3 workers."""
    return sum(e["event"] == "resized" and e["new_world_size"] == 3 and e["old_world_size"] < 3
               for e in _lines(run_dir / "events.jsonl"))


def _summary(run_dir: Path, out: dict) -> None:
    events = _lines(run_dir / "events.jsonl")
    steps = [r["step"] for r in _lines(run_dir / "metrics.jsonl") if "loss" in r]
    recovered = [e for e in events if e["event"] == "recovered"]
    waits = [e for e in events if e["event"] == "waiting_for_capacity"]
    waited = [e["capacity_waited_s"] for e in events if e["event"] == "resized" and "capacity_waited_s" in e]
    print(json.dumps({
        "ended": "error: " + repr(out["error"]) if "error" in out else events[-1]["event"],
        "steps": len(steps), "distinct_steps": len(set(steps)), "last_step": max(steps, default=0),
        "steps_lost": sum(e["steps_lost"] for e in recovered), "recoveries": len(recovered),
        "losses": recovered[-1]["losses"] if recovered else 0, "faults": recovered[-1]["faults"] if recovered else 0,
        "recovery_s": sorted(e["seconds"] for e in recovered), "waiting_for_capacity": len(waits),
        "capacity_waited_s": waited, "run_dir": str(run_dir)}, indent=1))


if __name__ == "__main__":
    main()
