"""The kill runs' kill, shared by Ray Train and raytrainer.

The worker that is to die says so when it starts step `kill_step` (its pid, in a
marker file); a thread in the contender's own process SIGKILLs it from outside at
once, so the kill lands wherever the worker happens to be (mid-step, mid-collective),
not at a clean step boundary as raytrainer's failure.chaos kill would."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from .spec import BenchError


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
    """SIGKILLs the worker that armed the marker file, as soon as it does."""

    def __init__(self, marker: Path):
        super().__init__("bench-killer")
        self.marker = marker

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
            return

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
