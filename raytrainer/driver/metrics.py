"""Driver-side metric sinks: progress line, metrics.jsonl, events.jsonl, and the loggers
(TensorBoard, MLflow, W&B, a user's own).

Workers never print or write these; they ship rows (already reduced over ranks)
and the driver alone fans them out here. Every sink follows one small protocol,
`Sink`. metrics.jsonl and events.jsonl are written on the driver's thread and are
the record; the loggers each run behind a `BackgroundSink`, so a slow or failing
tracker never holds the driver's poll loop up.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TextIO

from ..errors import warn
from .tfevents import EventFile


class Sink:
    """Where the driver sends a run: its metric rows, its lifecycle events and the files
    worth keeping. Subclass it, override what you need, and list the class under
    `loggers:` as `{target: package.module:Class, args: {...}}`. The driver calls, in
    order: open once, then write, event and artifact as the run goes (flush after each
    batch of them), and close once at the end."""

    def open(self, run: RunInfo) -> None:
        """Before anything else: the run directory, the resolved config, and where to keep
        what a resumed run needs to continue this sink's run (`run.remember`)."""

    def write(self, row: dict[str, Any]) -> None:
        """One metric row as in metrics.jsonl: `step`, `epoch`, `time`, `world_size` and the
        metrics (`val_*` in a validation row)."""

    def event(self, record: dict[str, Any]) -> None:
        """One lifecycle event as in events.jsonl: `event`, `time`, `step` and its fields."""

    def artifact(self, path: Path, kind: str) -> None:
        """A file or directory of the run: kind "model" (model.pt, at the end) or
        "checkpoint" (a committed checkpoint directory, on local storage)."""

    def flush(self) -> None:
        """Send what write and event buffered."""

    def close(self) -> None:
        """The run is over (`finished` or `failed` was the last event)."""


@dataclass
class RunInfo:
    """What a sink is told when it opens."""

    run_dir: Path
    name: str
    """run.name."""
    config: dict[str, Any]
    """The resolved config, as in config.yaml."""
    resumed: bool = False
    """The run continues from a checkpoint."""
    states: SinkStates | None = None

    def saved(self, key: str) -> dict[str, Any]:
        """What a sink remembered under `key` in an earlier attempt of this run ({} if none)."""
        return self.states.get(key) if self.states else {}

    def remember(self, key: str, state: dict[str, Any]) -> None:
        """Keep `state` (JSON) in the run directory, for a resumed run's sink to continue from."""
        if self.states:
            self.states.put(key, state)


class SinkStates:
    """`loggers.json` in the run directory: what each logger needs to continue its run when
    the run resumes (an MLflow or W&B run id), by a key the logger chooses."""

    FILE = "loggers.json"

    def __init__(self, run_dir: Path):
        self.path = run_dir / self.FILE
        self._lock = threading.Lock()
        try:
            self._states = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self._states = {}

    def get(self, key: str) -> dict[str, Any]:
        with self._lock:
            return dict(self._states.get(key, {}))

    def put(self, key: str, state: dict[str, Any]) -> None:
        with self._lock:
            self._states[key] = state
            tmp = self.path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self._states, indent=1))
            os.replace(tmp, self.path)


class _NotFromLoggerThreads(logging.Filter):
    """urllib3 logs a warning at every retry of a request; on a logger's thread, where a server
    that is down fails every request, the logger's own report says it once instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.threadName.startswith(BackgroundSink.THREAD_PREFIX)


class BackgroundSink(Sink):
    """Runs a logger on its own thread. The driver's poll loop shares the CPUs with the
    workers and must never wait on a tracking server: every call only queues. Rows beyond
    `max_rows` waiting are dropped (and counted); the first failure is reported, naming
    the logger, and it goes on with the next rows (a server may come back), unless `open`
    failed, which turns it off for the run; close waits at most `close_timeout_s`. Whatever
    it missed is in metrics.jsonl, and close reports how much."""

    THREAD_PREFIX = "raytrainer-logger"

    def __init__(self, sink: Any, name: str, *, warn: Callable[[str], None], max_rows: int = 10_000,
                 close_timeout_s: float = 60.0, batch_rows: int = 1000):
        retries = logging.getLogger("urllib3.connectionpool")
        if not any(isinstance(f, _NotFromLoggerThreads) for f in retries.filters):
            retries.addFilter(_NotFromLoggerThreads())
        self.sink, self.name, self._warn = sink, name, warn
        self.max_rows, self.close_timeout_s, self.batch_rows = max_rows, close_timeout_s, batch_rows
        self._queue: collections.deque[tuple[Any, ...]] = collections.deque()
        self._cond = threading.Condition()
        self._rows_queued = 0
        self.rows_missed = 0  # dropped, failed, or never sent
        self.rows_dropped = 0  # of those, dropped while it was max_rows behind
        self.failures = 0
        self._warned = False
        self._off: str | None = None  # why this logger is off for the run
        self._closing = self._abandoned = False
        self._thread = threading.Thread(target=self._run, name=f"{self.THREAD_PREFIX} {name}", daemon=True)
        self._thread.start()

    def open(self, run: RunInfo) -> None:
        self._put(("open", run))

    def write(self, row: dict[str, Any]) -> None:
        with self._cond:
            full = self._rows_queued >= self.max_rows
            if full:
                self.rows_missed += 1
                self.rows_dropped += 1
            else:  # its thread is woken by flush, once per batch of rows, not per row
                self._rows_queued += 1
                self._queue.append(("write", row))
        if full:
            self._report(f"is {self.max_rows} rows behind; dropping rows until it catches up")

    def event(self, record: dict[str, Any]) -> None:
        self._put(("event", record))

    def artifact(self, path: Path, kind: str) -> None:
        self._put(("artifact", path, kind))

    def flush(self) -> None:
        """Hands the rows written since the last flush to its thread (which flushes the
        logger after each batch it takes)."""
        with self._cond:
            self._cond.notify()

    def begin_close(self) -> None:
        if not self._closing:
            self._closing = True
            self._put(("close",))

    def close(self) -> None:
        """Waits for the logger to send what is queued and close, for close_timeout_s at most;
        then says what it missed, if anything."""
        self.begin_close()
        self._thread.join(self.close_timeout_s)
        with self._cond:
            late = self._thread.is_alive()
            if late:
                self._abandoned = True
                self.rows_missed += self._rows_queued
        if late or (self.rows_missed and not self._off):
            why = [f"{self.failures} calls failed"] if self.failures else []
            why += [f"{self.rows_dropped} rows were dropped while it was behind"] if self.rows_dropped else []
            why += [f"it did not finish within {self.close_timeout_s:g} s (close_timeout_s)"] if late else []
            self._warn(f"logger {self.name}: {'; '.join(why)}; it missed {self.rows_missed} metric rows, "
                       "and every row is in metrics.jsonl")

    def _put(self, item: tuple[Any, ...]) -> None:
        with self._cond:
            self._queue.append(item)
            self._cond.notify()

    def _take(self) -> list[tuple[Any, ...]]:
        with self._cond:
            while not self._queue:
                self._cond.wait()
            batch, rows = [], 0
            while self._queue and rows < self.batch_rows:
                batch.append(self._queue.popleft())
                rows += batch[-1][0] == "write"
            self._rows_queued -= rows
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if self._abandoned:
                return
            sent = 0  # rows written since the last flush
            for method, *args in batch:
                if self._abandoned:
                    return
                if method == "close":
                    self._flush(sent)
                    self._call("close")
                    return
                if self._off:
                    self._missed(method == "write")
                elif self._call(method, *args):
                    sent += method == "write"
                elif method == "open":
                    self._off = "could not start"
                else:
                    self._missed(method == "write")
            self._flush(sent)

    def _flush(self, sent: int) -> None:
        if not self._off and not self._call("flush"):
            self._missed(sent)

    def _missed(self, rows: int) -> None:
        with self._cond:
            self.rows_missed += rows

    def _call(self, method: str, *args: Any) -> bool:
        fn = getattr(self.sink, method, None)  # a user's sink need not have every method
        try:
            if fn is not None:
                fn(*args)
            return True
        except Exception as exc:  # a logger's failure never reaches training
            self.failures += 1
            text = " ".join(f"{type(exc).__name__}: {exc}".split())
            if len(text) > 500:
                text = text[:500] + " ..."
            if method == "open":
                self._report(f"could not start ({text}); it is off for this run", force=True)
            else:
                self._report(f"failed in {method} ({text}); training goes on, and the logger "
                             "with the next rows")
            return False

    def _report(self, what: str, force: bool = False) -> None:
        """The first problem of a logger is reported; later ones are counted for close."""
        with self._cond:  # from its thread, or the driver's when rows are dropped
            first, self._warned = not self._warned, True
        if not (first or force):
            return
        self._warn(f"logger {self.name} {what}; every row is in metrics.jsonl")


class JsonlWriter(Sink):
    """Append-only JSON lines, written through per line so a crash loses nothing written.

    A full disk does not stop the run: what cannot be written yet (from the exact byte
    the disk took last) is kept in memory and written first once there is room again,
    with one warning meanwhile."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._backlog = b""
        self._warned = False

    def write(self, obj: dict[str, Any]) -> None:
        self._backlog += (json.dumps(obj, default=float) + "\n").encode()
        self._drain()

    def _drain(self) -> None:
        try:
            while self._backlog:
                self._backlog = self._backlog[os.write(self._fd, self._backlog):]
        except OSError as exc:
            if not self._warned:
                self._warned = True
                warn(f"cannot write {self.path} ({exc.strerror or exc}); training goes on, its lines are "
                     "kept in memory until they can be written")
        else:
            if self._warned:
                self._warned = False
                warn(f"{self.path} is written again, nothing lost")

    def close(self) -> None:
        self._drain()
        os.close(self._fd)


class EventLog(JsonlWriter):
    """The driver's lifecycle log: one object per event with `event`, `time`, `step`."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.events: list[dict[str, Any]] = []
        self.listeners: list[Callable[[dict[str, Any]], None]] = []  # e.g. MetricsHub.event

    def log(self, event: str, step: int | None = None, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "time": time.time(), "step": step, **fields}
        self.events.append(record)
        self.write(record)
        for listener in self.listeners:
            listener(record)
        return record


class TensorBoardSink(Sink):
    """TensorBoard event files in the run directory (tfevents.py: no tensorboardX, whose
    torch import took the driver's cores from the workers' first steps)."""

    def __init__(self, logdir: Path | None = None):
        self.logdir = logdir  # default: the run directory
        self._file: EventFile | None = None

    def open(self, run: RunInfo) -> None:
        self.logdir = self.logdir or run.run_dir

    def write(self, row: dict[str, Any]) -> None:
        if self._file is None:
            self._file = EventFile(self.logdir)
        # One event per row, not one per scalar: the driver shares the CPU with the workers.
        scalars = {_tb_name(key): float(value) for key, value in row.items()
                   if key not in ("step", "time") and isinstance(value, (int, float))}
        if scalars:
            self._file.add(row["step"], scalars, row.get("time"))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _tb_name(key: str) -> str:
    if key.startswith("val_"):
        return "val/" + key[4:]
    if key in ("epoch", "world_size", "lr", "samples_per_s"):
        return "run/" + key
    return "train/" + key


class ProgressBar(Sink):
    """One status line: step, epoch, loss, samples/s. Redrawn in place on a terminal,
    printed every few seconds otherwise (logs, CI)."""

    def __init__(self, total_steps: int | None = None, stream: TextIO | None = None,
                 interval_s: float | None = None):
        self.total_steps = total_steps
        self.stream = stream or sys.stderr  # this process's now (a test's capture, a notebook's)
        self.tty = self.stream.isatty()
        self.interval_s = interval_s if interval_s is not None else (0.2 if self.tty else 5.0)
        self._last_draw = 0.0
        self._drawn = True  # nothing new to show
        self._state: dict[str, Any] = {}
        self._failures: list[str] = []  # worker_failed notices not yet recovered from
        self._size: int | None = None  # the run's size, while it waits for room for it

    def write(self, row: dict[str, Any]) -> None:
        self._state.update(row)
        self._drawn = False
        now = time.monotonic()
        if any(k.startswith("val_") for k in row) or now - self._last_draw >= self.interval_s:
            self._draw(final=not self.tty)
            self._last_draw = now

    def event(self, record: dict[str, Any]) -> None:
        """A recovery with the failures it recovered from, a resize, a node leaving, a
        checkpoint passed over: a line each, between the status lines (notice). Failures are
        shown once recovered from: one the run ends on is the error the run raises."""
        line = notice(record)
        self._note_capacity(record)
        if record["event"] == "worker_failed":
            self._failures.append(line)
        elif record["event"] in ("failed", "finished", "stopped"):
            self._failures = []
        elif line is not None:
            lines, self._failures = [*self._failures, line], []
            self._put(("\r\x1b[K" if self.tty else "") + "\n".join(lines) + "\n")
            self._drawn = False  # the status line again after them, on a terminal

    def _note_capacity(self, record: dict[str, Any]) -> None:
        kind = record["event"]
        if kind == "waiting_for_capacity":
            self._size = record["size"]
        elif self._size is not None and record.get("new_world_size", record.get("world_size", 0)) >= self._size:
            self._size = None  # resized, or formed again, at its size

    def _draw(self, final: bool) -> None:
        s = self._state
        if "step" not in s:
            return
        total = f"/{self.total_steps}" if self.total_steps else ""
        parts = [f"step {s['step']}{total}", f"epoch {s.get('epoch', 0) + 1}"]
        for key in ("loss", "val_loss", "val_accuracy"):
            if isinstance(s.get(key), float) and math.isfinite(s[key]):
                parts.append(f"{key} {s[key]:.4g}")
        if "samples_per_s" in s:
            parts.append(f"{s['samples_per_s']:,.0f} samples/s")
        workers = s.get("world_size", "?")
        parts.append(f"workers {workers}/{self._size}, waiting for room" if self._size else f"workers {workers}")
        line = " | ".join(parts)
        self._drawn = True
        self._put(("\r" + line + "\x1b[K") if not final else line + "\n")

    def _put(self, text: str) -> None:
        """Training goes on without its console: a terminal hung up (EIO, before the SIGHUP
        that stops the run), a pipe closed (`| head`)."""
        if self.stream is None:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except OSError:
            self.stream = None

    def close(self) -> None:
        if not self._drawn or self.tty:
            self._draw(final=True)


def _so_far(e: dict[str, Any]) -> str:
    """A recovery's counts by budget: lost workers (the cluster's), faults (the run's own)."""
    if "losses" not in e:
        return f"{e['failures']} failure(s) so far"
    return f"so far {e['losses']} lost worker(s), {e['faults']} fault(s)"


def notice(e: dict[str, Any]) -> str | None:
    """The console's line for an event the user should see as it happens; None for the
    others (events.jsonl has them all)."""
    kind, step = e["event"], e.get("step")
    if kind == "worker_failed":
        what = {"died": "died", "hung": "hung", "error": "failed", "interrupted": "was interrupted"}
        cause = (e["cause"].strip().splitlines() or [""])[0]
        return (f"raytrainer: rank {e['rank']} ({e.get('node') or '?'}) {what.get(e['kind'], e['kind'])} at step "
                f"{step}: {cause}" + (" (its traceback: events.jsonl)" if e.get("traceback") else ""))
    if kind == "recovered":
        source = {"memory": f"rank {e.get('source_rank')}'s state in memory",
                  "copy": "the copy of the state kept in memory", "object_store": "the state in Ray's object store",
                  "peers": f"the peers' snapshots of step {e.get('snapshot_step')}",
                  "checkpoint": f"checkpoint {e.get('from_checkpoint')}",
                  "start": "the start (no checkpoint committed yet)"}.get(e.get("state_from"), e.get("state_from"))
        return (f"raytrainer: recovered at step {step} in {e['seconds']:.2f} s from {source}, "
                f"{e['steps_lost']} step(s) lost ({_so_far(e)})")
    if kind == "resized":
        return (f"raytrainer: {e['old_world_size']} -> {e['new_world_size']} workers at step {step} "
                f"(paused {e['seconds']:.2f} s): {e['cause']}")
    if kind == "left_node":
        return f"raytrainer: ranks {e['ranks']} left node {e['node']} at step {step}: {e['reason']}"
    if kind == "waiting_for_capacity":
        return (f"raytrainer: no room for {e['missing']} more worker(s) at step {step}: training goes on with "
                f"{e['world_size']} of {e['size']} and grows back when the cluster has room")
    if kind == "checkpoint_skipped":
        return f"raytrainer: checkpoint {e['checkpoint']} skipped: {e['why']}"
    if kind == "rolled_back":
        return (f"raytrainer: rolled back from step {step} to step {e['to_step']} in memory, past "
                f"{e['skipped_batches']} batch(es): {e['why']}")
    return None


class MetricsHub:
    """Fans rows, events and artifacts out to the sinks; keeps the history and the latest
    value of each metric."""

    def __init__(self, sinks: list[Any], run: RunInfo | None = None):
        self.sinks = sinks
        self.history: list[dict[str, Any]] = []
        self.latest: dict[str, Any] = {}
        if run is not None:
            for sink in sinks:
                sink.open(run)

    def write(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self.history.append(row)
            self.latest.update(row)
            for sink in self.sinks:
                sink.write(row)
        self.flush()

    def event(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.event(record)
        self.flush()

    def artifact(self, path: Path, kind: str) -> None:
        for sink in self.sinks:
            sink.artifact(path, kind)

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        for sink in self.sinks:  # every logger sends its rest at once, then each is waited for
            if isinstance(sink, BackgroundSink):
                sink.begin_close()
        for sink in self.sinks:
            sink.close()
