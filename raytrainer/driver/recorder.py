"""What the workers send the driver, on its way into the run's records (Records):
metric rows, each recorded once (a worker that redoes steps after a recovery, replayed from
a snapshot or a checkpoint, sends their rows again: the first ones stand), the driver
callbacks at the boundaries the rows mark, and the workers' lifecycle events (a committed
checkpoint; a save that failed, said with what is kept). How far apart the rows come says
how long the workers take to agree on a pause."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..callbacks import Callbacks, RunContext
from ..errors import warn
from .metrics import EventLog, MetricsHub


@dataclass(kw_only=True)
class Records:
    """Where the controller writes what happens: metric rows (the hub: metrics.jsonl, the
    loggers), lifecycle events, the progress line, and driver callbacks with their context."""

    hub: MetricsHub
    events: EventLog
    progress: Any = None
    callbacks: Callbacks = field(default_factory=lambda: Callbacks([]))
    context: RunContext = field(default_factory=lambda: RunContext(run_dir=None, config=None))


class Recorder:
    def __init__(self, records: Records):
        self.hub, self.events = records.hub, records.events
        self.callbacks, self.ctx = records.callbacks, records.context
        self.train_step, self.val_step = 0, -1  # the last training and validation rows recorded
        self.kept_step: int | None = None  # the newest committed checkpoint's step, for a failed save's warning
        self._rows_at: list[tuple[float, int]] = []  # (when, step) of the last training rows

    def fresh(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The rows not recorded before, counted as recorded now. A row at or before the last
        one of its kind recorded was sent again: by a worker that redid a step after a
        recovery, or by a new rank 0 with the rows the lost one may not have delivered
        (window.py), in the same batch as the originals where rank 0 survived. The first
        one stands."""
        fresh = []
        for row in rows:
            if _is_val(row) and row["step"] > self.val_step:
                self.val_step = row["step"]
                fresh.append(row)
            elif not _is_val(row) and row["step"] > self.train_step:
                self.train_step = row["step"]
                fresh.append(row)
        if fresh:
            self._rows_at = self._rows_at[-1:] + [(time.monotonic(), self.train_step)]
        return fresh

    def write(self, rows: list[dict[str, Any]]) -> None:
        """Fresh rows to the sinks, and to the driver callbacks, which see the same
        boundaries, from the rows."""
        self.hub.write(rows)
        for row in rows:
            late = _is_val(row) and row["step"] < self.train_step  # an async validation's
            if row["epoch"] != self.ctx.epoch and not late:
                self.callbacks("on_epoch_end", self.ctx)
                self.ctx.epoch = row["epoch"]
                self.callbacks("on_epoch_start", self.ctx)
            self.ctx.step = max(self.ctx.step, row["step"]) if late else row["step"]
            self.ctx.metrics.update(row)
            self.callbacks("on_metrics", self.ctx, row)
            val = {k: v for k, v in row.items() if k.startswith("val_")}
            if val:
                self.callbacks("on_validation_end", self.ctx, val)

    def worker_events(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            self.events.log(**event)
            if event["event"] == "checkpoint_committed":
                self.kept(event["step"])
                self.callbacks("on_checkpoint", self.ctx, event["path"])
            elif event["event"] == "checkpoint_failed":
                _warn_save_failed(event, self.kept_step)

    def kept(self, step: int) -> None:
        """A checkpoint of `step` is committed."""
        self.kept_step = max(step, self.kept_step or 0)

    def pause_estimate(self) -> float:
        """How long the workers take to reach a common step boundary once asked: the pause
        is agreed in a metrics reduction and seen one reduction later, so about two
        intervals between the batches of rows the driver receives."""
        if len(self._rows_at) < 2:
            return 10.0
        (t0, _), (t1, _) = self._rows_at[-2:]
        return 2 * (t1 - t0)


def _is_val(row: dict[str, Any]) -> bool:
    return any(k.startswith("val_") for k in row)


def _warn_save_failed(event: dict[str, Any], kept: int | None) -> None:
    """One line per failed save: training goes on, and the user learns what is kept."""
    warn(f"the checkpoint of step {event['step']} could not be written to {event['path']} ({event['cause']}); "
         "training goes on, nothing of it is committed, "
         + (f"the checkpoint of step {kept} stays the newest" if kept is not None else
            "no checkpoint is committed yet") + "; the next save tries again")
