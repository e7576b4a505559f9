"""The run as Ray metrics: step, step rate, throughput, loss, world size, failures and
recoveries, tagged with the run's name, so they are in Ray's Prometheus endpoint and its
Grafana dashboards beside Ray's own.

Recorded on the driver, from the rows and events it already receives: nothing is added to
a worker's step. Ray prefixes each name with `ray_` (and a counter's with `_total` after
it), so `raytrainer_loss` is scraped as `ray_raytrainer_loss{run="..."}`. The sink is on
wherever the Ray the driver joined exports metrics, and costs nothing where it does not: a
Ray that raytrainer starts runs with RAY_enable_metrics_collection=0 (localray.py) unless
the environment says otherwise.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any, Callable

from ..errors import warn as _warn
from .metrics import RunInfo, Sink

PREFIX = "raytrainer_"
TAG = "run"
SWITCH = "RAY_enable_metrics_collection"

GAUGES = {
    "step": "The run's last logged step",
    "steps_per_s": "Optimizer steps per second over the last seconds of rows (0 while recovering)",
    "samples_per_s": "Samples per second (the global batch over the last step's time)",
    "loss": "The training loss of the last logged step",
    "val_loss": "The validation loss of the last validation",
    "world_size": "Workers in the group",
    "failures_by_cause": "Recoveries so far by cause: loss (a worker process died) or fault (the run's own)",
    "recovery_seconds": "How long the last recovery took",
}
COUNTERS = {
    "worker_failures": "Workers failed, by kind (died, hung, error, interrupted)",
    "recoveries": "Recoveries from failed workers",
}
ROW_GAUGES = ("step", "samples_per_s", "loss", "val_loss", "world_size")
"""Row keys recorded as they are."""
_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


class RayBackend:
    """Ray's side: whether the joined Ray exports metrics, and its metric objects."""

    def exporting(self) -> bool:
        """Whether the agent on the driver's node serves Prometheus: its node's
        MetricsExportPort is -1 where RAY_enable_metrics_collection=0."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        return any(n.get("NodeID") == node and (n.get("MetricsExportPort") or -1) > 0 for n in ray.nodes())

    def gauge(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Any:
        from ray.util.metrics import Gauge

        return Gauge(name, description, tag_keys=tag_keys)

    def counter(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Any:
        from ray.util.metrics import Counter

        return Counter(name, description, tag_keys=tag_keys)


class RayMetricsSink(Sink):
    """Keeps the newest value of each series from the rows and records them at most every
    `min_interval_s` (Ray exports at most once a second, so recording every row would only
    cost the driver's CPU), and at each event. A failure in Ray's metrics turns the sink off
    for the run, with one warning: training never depends on it. `gauge(name, value)` is
    for other parts of the driver (a goodput figure) to publish a series of their own."""

    def __init__(self, backend: Any = None, *, min_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, warn: Callable[[str], None] = _warn):
        self.backend = backend or RayBackend()
        self.min_interval_s, self.clock, self._warn = min_interval_s, clock, warn
        self.on = False
        self._tags: dict[str, str] = {}
        self._metrics: dict[str, Any] = {}
        self._pending: dict[str, float] = {}
        self._last_record = float("-inf")
        self._mark: tuple[int, float] | None = None  # (step, time) the step rate is measured from
        self._latest: tuple[int, float] | None = None

    def open(self, run: RunInfo) -> None:
        self._tags = {TAG: run.name}
        self.on = self._guard(self.backend.exporting) is True
        if not self.on and os.environ.get(SWITCH, "").lower() in ("1", "true"):
            self._warn(f"{SWITCH}={os.environ[SWITCH]}, but the Ray this run joined exports no metrics: it was "
                       f"started without them (a kept local Ray: `raytrainer down`, then run again; a cluster: "
                       f"set {SWITCH}=1 for `ray start` on every node); the run's metrics are not in Ray's")

    def write(self, row: dict[str, Any]) -> None:
        if not self.on:
            return
        for key in ROW_GAUGES:
            value = row.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._pending[key] = float(value)
        if isinstance(row.get("time"), (int, float)) and "step" in row:
            self._latest = (row["step"], row["time"])

    def event(self, record: dict[str, Any]) -> None:
        if not self.on:
            return
        kind = record["event"]
        if kind == "worker_failed":
            self._count("worker_failures", {"kind": str(record.get("kind"))})
            self._pending["steps_per_s"], self._mark = 0.0, None  # not stepping until it recovers
        elif kind == "recovered":
            self._count("recoveries", {})
            self._pending["recovery_seconds"] = float(record.get("seconds", 0.0))
            for cause, key in (("loss", "losses"), ("fault", "faults")):
                if isinstance(record.get(key), int):
                    self._set("failures_by_cause", float(record[key]), {"cause": cause})
        elif kind in ("finished", "failed", "stopped"):  # the last rates would stand while the driver exits
            self._pending.update(steps_per_s=0.0, samples_per_s=0.0)
        elif kind in ("group_formed", "resized"):
            size = record.get("world_size", record.get("new_world_size"))
            if isinstance(size, int):
                self._pending["world_size"] = float(size)
        self._last_record = float("-inf")  # an event's series go out at this flush

    def flush(self) -> None:
        if self.on and self.clock() - self._last_record >= self.min_interval_s:
            self._record()

    def close(self) -> None:
        if self.on:
            self._record()

    def gauge(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        """Publish `raytrainer_<name>` = value for this run (e.g. the goodput ledger's
        "goodput"); a name Prometheus cannot take is refused."""
        if not _NAME.match(name):
            raise ValueError(f"metric name {name!r}: letters, digits and _ only, not starting with a digit")
        if self.on:
            self._set(name, float(value), tags or {})

    def _record(self) -> None:
        self._last_record = self.clock()
        self._step_rate()
        pending, self._pending = self._pending, {}
        for key, value in pending.items():
            self._set(key, value, {})

    def _step_rate(self) -> None:
        """Steps over seconds since the mark; a step back (a rollback) moves the mark there."""
        if self._latest is None:
            return
        if self._mark is None or self._latest[0] < self._mark[0]:
            self._mark = self._latest
            return
        (s0, t0), (s1, t1) = self._mark, self._latest
        if s1 > s0 and t1 > t0:
            self._pending["steps_per_s"] = (s1 - s0) / (t1 - t0)
            self._mark = self._latest

    def _set(self, name: str, value: float, tags: dict[str, str]) -> None:
        gauge = self._metric("gauge", name, tuple(tags)) if self.on else None
        if gauge is not None:
            self._guard(gauge.set, value, tags={**self._tags, **tags})

    def _count(self, name: str, tags: dict[str, str]) -> None:
        counter = self._metric("counter", name, tuple(tags)) if self.on else None
        if counter is not None:
            self._guard(counter.inc, 1.0, tags={**self._tags, **tags})

    def _metric(self, kind: str, name: str, tag_keys: tuple[str, ...]) -> Any:
        """The metric object, made at its first use (Ray registers each one made)."""
        if name not in self._metrics:
            description = {**GAUGES, **COUNTERS}.get(name, f"{name} (published by the driver)")
            make = self.backend.gauge if kind == "gauge" else self.backend.counter
            self._metrics[name] = self._guard(make, PREFIX + name, description, (TAG, *tag_keys))
        return self._metrics[name]

    def _guard(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # the run's metrics in Ray are a view, never a reason to stop
            if self.on:
                self._warn(f"Ray metrics: {type(exc).__name__}: {exc}; the run's metrics are not sent to Ray "
                           "for the rest of the run (metrics.jsonl has them all)")
            self.on = False
            return None
