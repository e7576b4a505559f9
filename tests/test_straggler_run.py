"""A worker slowed from outside the task's code (a SIGSTOP/SIGCONT duty cycle on its pid,
half of each 100 ms stopped: its steps take twice as long; of the stops, those that fall in
its compute count against it, the rest in its waits for its peer: it measures well under 2x) on
a local Ray: the driver reports it (`slow_worker`) within 50 steps, and with
failure.stragglers: replace moves its rank to a new worker at a step boundary, no step lost
and no failure counted (the pace before, slowed and after: printed). The decision itself:
tests/test_stragglers.py."""

import json
import os
import signal
import threading
import time

import raytrainer

from .waits import wait_until

SLOW_FROM_STEP = 30  # the duty cycle starts once training has run this far
STEPS = 400


def config(tmp_path):
    return {
        # Each step sleeps 50 ms in the task: a pace the load on a busy machine barely moves
        # (a busy loop's does: on a loaded 2-core machine it flagged a healthy rank too).
        "task": {"target": "tests.tasks:RegressionTask", "args": {"sleep_s": 0.05}},
        "trainer": {"max_steps": STEPS, "global_batch_size": 32, "log_every_n_steps": 5},
        "scaling": {"num_workers": 2},
        # The duty cycle's ratio swings from window to window (a stop falls in the rank's
        # compute or in its wait by chance, see the module): a margin of 1.2 keeps the check
        # off the edge of the default 1.3, which it crossed within 27 steps in the runs kept.
        "failure": {"stragglers": "replace", "straggler_margin": 1.2},
        "run": {"name": "slow", "storage": str(tmp_path)},
    }


def read(path):
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


class DutyCycle(threading.Thread):
    """Stop rank 1's process for half of every `period_s`, from once the run reached
    SLOW_FROM_STEP until its process is gone (moved away) or `done` is set."""

    def __init__(self, run_dir, period_s=0.1):
        super().__init__(daemon=True)
        self.run_dir, self.period_s = run_dir, period_s
        self.done, self.started_at, self.pid = threading.Event(), None, None

    def run(self):
        events, metrics = self.run_dir / "events.jsonl", self.run_dir / "metrics.jsonl"
        formed = wait_until(lambda: [e for e in read(events) if e["event"] == "group_formed"], timeout_s=120,
                            what="the group to form")
        self.pid = formed[0]["pids"][1]
        wait_until(lambda: self.done.is_set() or any(r["step"] >= SLOW_FROM_STEP for r in read(metrics)),
                   timeout_s=120, what="the first steps")
        self.started_at = time.time()
        try:
            while not self.done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(self.period_s / 2)
                os.kill(self.pid, signal.SIGCONT)
                time.sleep(self.period_s / 2)
        except ProcessLookupError:  # moved to a new worker: this one was ended
            pass
        finally:
            try:
                os.kill(self.pid, signal.SIGCONT)  # never leave it stopped
            except ProcessLookupError:
                pass


def rate(rows):
    """Steps per second over `rows` (in step order), the slowest tenth of the steps left
    out: the machine runs other tests, whose bursts hold a step here and there. A worker
    stopped for 50 ms in every 100 slows a third of the steps: it stays in."""
    gaps = sorted((b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(rows, rows[1:]))
    kept = gaps[:max(1, int(len(gaps) * 0.9))]
    return len(kept) / sum(kept)


def test_a_worker_slowed_from_outside_is_reported_and_replaced_with_no_step_lost(ray_local, tmp_path):
    slower = DutyCycle(tmp_path / "slow")
    slower.start()
    try:
        result = raytrainer.train(config(tmp_path), progress=False)
    finally:
        slower.done.set()
        slower.join()
    events = result.events
    rows = sorted((r for r in read(result.run_dir / "metrics.jsonl") if "loss" in r), key=lambda r: r["step"])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # every step once: none lost, none redone
    assert not [e for e in events if e["event"] in ("worker_failed", "recovered")]
    assert all("rank_compute_s" not in r for r in rows)  # the times are the driver's, not metrics

    slowed_at = next(r["step"] for r in rows if r["time"] >= slower.started_at)
    slow = [e for e in events if e["event"] == "slow_worker"]
    assert slow and slow[0]["rank"] == 1 and slow[0]["ratio"] >= 1.2, slow
    assert slow[0]["step"] - slowed_at <= 50, (slowed_at, slow[0])

    moved = [e for e in events if e["event"] == "slow_worker_replaced"]
    assert moved and moved[0]["rank"] == 1 and moved[0]["moved"] and moved[0]["steps_lost"] == 0, moved
    assert moved[0]["old_pid"] == slower.pid and slower.pid not in moved[0]["pids"]
    assert [e["new_world_size"] for e in events if e["event"] == "resized"] == []  # the same world size

    # The pace before, while slowed and after the move: printed, not asserted (a shared
    # machine's load moves it; the measured figures: docs/results/2026-12-07-slow-workers.md).
    before = [r for r in rows if 5 <= r["step"] < slowed_at]
    slowed = [r for r in rows if slowed_at <= r["step"] <= moved[0]["step"]]
    after = [r for r in rows if moved[0]["step"] + 5 <= r["step"] and r["time"] <= moved[0]["time"] + 60]
    print(f"steps/s undisturbed {rate(before):.1f}, slowed {rate(slowed):.1f}, after the move {rate(after):.1f}; "
          f"reported at step {slow[0]['step']} (slowed from {slowed_at}), ratio {slow[0]['ratio']}, "
          f"moved at step {moved[0]['step']}")
