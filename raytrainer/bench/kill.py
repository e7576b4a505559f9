"""The kill runs' kill, shared by Ray Train and raytrainer.

The worker that is to die says so when it starts step `kill_step` (its pid, in a
marker file); a thread in the contender's own process SIGKILLs it from outside at
once, so the kill lands wherever the worker happens to be (mid-step, mid-collective),
not at a clean step boundary as raytrainer's failure.chaos kill would."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

from .spec import BenchError

GROW_PACE_S = 1.0
"""Least time of each step of a kill run from the kill until the group grew back (a kill
run `until_grown`): at 1 s, a replacement that takes half a minute to start still joins
before the smoke bench's last step."""


def arm_kill(spec: dict[str, Any], step: int, rank: int) -> None:
    """Called as each step of a kill run starts: pace it (kill_pace_s), and on the rank
    to die, at kill_step, write the marker the Killer waits for."""
    time.sleep(spec.get("kill_pace_s", 0.0))
    marker = Path(spec["kill_marker"])
    if step != spec["kill_step"] or rank != spec["workers"] - 1 or marker.exists():
        return  # a replacement worker counts from 0 again: the marker makes it once per run
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "step": step, "rank": rank}))
    os.replace(tmp, marker)


class KillThread(threading.Thread):
    """A daemon thread that kills once what it watches says so; result() stops it and
    says what it killed (None: nothing)."""

    def __init__(self, name: str):
        super().__init__(daemon=True, name=name)
        self.done = threading.Event()
        self.killed: dict[str, Any] | None = None

    def result(self) -> dict[str, Any] | None:
        self.done.set()
        self.join()
        return self.killed


class Killer(KillThread):
    """SIGKILLs the worker that armed the marker file, as soon as it does. With `pace` and
    `run_dir`: then, from the first step after the recovery (so the recovery and its replayed
    steps are timed unpaced) until the run's events say the group grew back, touches `pace`
    (the bench task sleeps each step while it exists), so that a replacement started after
    the kill joins before the last step, however long it takes to start."""

    def __init__(self, marker: Path, pace: Path | None = None, run_dir: Path | None = None):
        super().__init__("bench-killer")
        self.marker, self.pace, self.run_dir = marker, pace, run_dir

    def run(self) -> None:
        while not self.done.is_set():
            try:
                armed = json.loads(self.marker.read_text())
            except FileNotFoundError:
                time.sleep(0.001)
                continue
            at = time.time()
            os.kill(armed["pid"], signal.SIGKILL)
            self.killed = dict(armed, killed_at=at)
            if self.pace is not None:
                self._pace_until_grown()
            return

    def _pace_until_grown(self) -> None:
        while not self.done.is_set() and not _went_on(self.run_dir):
            time.sleep(0.02)
        self.pace.touch()
        try:
            while not self.done.is_set() and not _events(self.run_dir, "resized", lambda e: e["added"]):
                time.sleep(0.05)
        finally:
            self.pace.unlink(missing_ok=True)

    def result(self) -> dict[str, Any]:
        if (killed := super().result()) is None:
            raise BenchError(f"the worker to kill never said it reached the kill step (no {self.marker})")
        return killed


def kill_figures(killed: dict[str, Any], before: list[tuple[int, float]], after: list[tuple[int, float]],
                 resumed_from: int, reached: int = 0) -> dict[str, Any]:
    """The same arithmetic for both contenders: `before` and `after` are rank 0's (step, time)
    before the failure was handled and after training restarted; `reached`, a step known
    to have been finished before the failure though it has no row."""
    if not after:
        raise BenchError("no step finished after the kill")
    reached = max([reached] + [s for s, _ in before])
    return {"killed_at": killed["killed_at"], "kill_armed_step": killed["step"], "killed_pid": killed["pid"],
            "killed_rank": killed["rank"], "step_at_kill": reached, "resumed_from": resumed_from,
            "first_step_after": after[0][0],
            "kill_to_first_step_s": after[0][1] - killed["killed_at"],
            "steps_lost": max(0, reached - resumed_from)}


def _events(run_dir: Path, name: str, keep: Callable[[dict[str, Any]], Any] = bool) -> list[dict[str, Any]]:
    """The run's events called `name` that `keep` keeps."""
    with contextlib.suppress(FileNotFoundError):
        lines = (run_dir / "events.jsonl").read_text().splitlines()
        return [e for e in map(json.loads, (x for x in lines if x.endswith("}"))) if e["event"] == name and keep(e)]
    return []


def _went_on(run_dir: Path) -> bool:
    """A training row is newer than the run's first recovery."""
    if not (recovered := _events(run_dir, "recovered")):
        return False
    with contextlib.suppress(FileNotFoundError):
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return any(row.get("time", 0) > recovered[0]["time"] and "loss" in row
                   for row in map(json.loads, (x for x in lines[-5:] if x.endswith("}"))))
    return False
