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

from .callbacks import Callbacks, RunContext
from .errors import RaytrainerError, WorkerError
from .metrics import EventLog, MetricsHub


class State(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


class Controller:
    def __init__(self, group: Any, num_workers: int, hub: MetricsHub, events: EventLog,
                 *, poll_interval_s: float = 0.2, progress: Any = None,
                 callbacks: Callbacks | None = None, context: RunContext | None = None,
                 resume: tuple[int, str, bytes] | None = None):
        self.group = group
        self.resume = resume  # (step, checkpoint name, state bytes) to start from
        self.num_workers = num_workers
        self.hub = hub
        self.events = events
        self.poll_interval_s = poll_interval_s
        self.progress = progress
        self.callbacks = callbacks or Callbacks([])
        self.ctx = context or RunContext(run_dir=None, config=None)
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
            info = self.group.setup(self.resume[2] if self.resume else None)
            if self.resume:
                self.step = self.ctx.step = self.resume[0]
                self.events.log("resumed", step=self.step, checkpoint=self.resume[1])
            if self.progress is not None:
                self.progress.total_steps = info.get("total_steps")
            self.events.log("group_formed", step=self.step, world_size=self.num_workers,
                            nodes=[n.get("ip") for n in nodes], seconds=round(time.monotonic() - t0, 3),
                            **info)
            self.group.launch()
            self.state = State.RUNNING
            self.callbacks("on_run_start", self.ctx)
            self.callbacks("on_epoch_start", self.ctx)
            while self.state is State.RUNNING:
                poll = self.group.poll(self.poll_interval_s)
                self._record(poll.rows)
                for event in poll.events:
                    self.events.log(**event)
                    if event["event"] == "checkpoint_committed":
                        self.callbacks("on_checkpoint", self.ctx, event["path"])
                if poll.done:
                    self.result = poll.result
                    self.state = State.FINISHED
            self.callbacks("on_epoch_end", self.ctx)
            self.callbacks("on_run_end", self.ctx)
            reason = self.result.get("stop_reason") if isinstance(self.result, dict) else None
            self.events.log("finished", step=self.step, seconds=round(time.monotonic() - t0, 3),
                            reason=reason)
            return self.result
        except BaseException as exc:
            self.state = State.FAILED
            self.events.log("failed", step=self.step, **_describe(exc))
            raise
        finally:
            self.group.shutdown()

    def _record(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        self.step = max(self.step, rows[-1]["step"])
        self.hub.write(rows)
        for row in rows:  # driver-side callbacks see the same boundaries, from the rows
            if row["epoch"] != self.ctx.epoch:
                self.callbacks("on_epoch_end", self.ctx)
                self.ctx.epoch = row["epoch"]
                self.callbacks("on_epoch_start", self.ctx)
            self.ctx.step = row["step"]
            self.ctx.metrics.update(row)
            val = {k: v for k, v in row.items() if k.startswith("val_")}
            if val:
                self.callbacks("on_validation_end", self.ctx, val)


def _describe(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, WorkerError):
        return {"rank": exc.rank, "cause": exc.message, "error": type(exc).__name__}
    if isinstance(exc, RaytrainerError):
        return {"cause": str(exc), "error": type(exc).__name__}
    if isinstance(exc, KeyboardInterrupt):
        return {"cause": "interrupted", "error": "KeyboardInterrupt"}
    return {"cause": f"{type(exc).__name__}: {exc}", "error": type(exc).__name__}
