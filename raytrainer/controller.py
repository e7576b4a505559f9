"""The driver's state machine. It owns the run; a worker group does the work.

    STARTING -> RUNNING -> FINISHED
         \\          \\-> FAILED
          \\-> FAILED

The controller knows no torch and no Ray: it drives any worker group with
start/check_storage/setup/launch/poll/shutdown (group.RayWorkerGroup in production, a fake in
tests), writes every lifecycle change to the event log and every metric row to
the sinks, and always shuts the group down, whatever happened.
"""

from __future__ import annotations

import enum
import time
from typing import Any

from .errors import RaytrainerError, WorkerError
from .metrics import EventLog, MetricsHub


class State(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


class Controller:
    def __init__(self, group: Any, num_workers: int, hub: MetricsHub, events: EventLog,
                 *, poll_interval_s: float = 0.2, progress: Any = None):
        self.group = group
        self.num_workers = num_workers
        self.hub = hub
        self.events = events
        self.poll_interval_s = poll_interval_s
        self.progress = progress
        self.state = State.STARTING
        self.step = 0
        self.result: Any = None

    def run(self) -> Any:
        """Train to the end and return rank 0's final state; raise what stopped the run."""
        t0 = time.monotonic()
        self.events.log("run_started", step=0, num_workers=self.num_workers)
        try:
            nodes = self.group.start(self.num_workers)
            checked = self.group.check_storage(nodes)  # before any work that storage would lose
            if checked:
                self.events.log("storage_checked", step=self.step, **checked)
            info = self.group.setup()
            if self.progress is not None:
                self.progress.total_steps = info.get("total_steps")
            self.events.log("group_formed", step=self.step, world_size=self.num_workers,
                            nodes=[n.get("ip") for n in nodes], seconds=round(time.monotonic() - t0, 3),
                            **info)
            self.group.launch()
            self.state = State.RUNNING
            while self.state is State.RUNNING:
                poll = self.group.poll(self.poll_interval_s)
                self._record(poll.rows)
                if poll.done:
                    self.result = poll.result
                    self.state = State.FINISHED
            self.events.log("finished", step=self.step, seconds=round(time.monotonic() - t0, 3))
            return self.result
        except BaseException as exc:
            self.state = State.FAILED
            self.events.log("failed", step=self.step, **_describe(exc))
            raise
        finally:
            self.group.shutdown()

    def _record(self, rows: list[dict[str, Any]]) -> None:
        if rows:
            self.step = max(self.step, rows[-1]["step"])
            self.hub.write(rows)


def _describe(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, WorkerError):
        return {"rank": exc.rank, "cause": exc.message, "error": type(exc).__name__}
    if isinstance(exc, RaytrainerError):
        return {"cause": str(exc), "error": type(exc).__name__}
    if isinstance(exc, KeyboardInterrupt):
        return {"cause": "interrupted", "error": "KeyboardInterrupt"}
    return {"cause": f"{type(exc).__name__}: {exc}", "error": type(exc).__name__}
