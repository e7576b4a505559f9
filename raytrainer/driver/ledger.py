"""The goodput ledger: where a run's wall time went, every second in one bucket, from its
events.jsonl and metrics.jsonl alone (`ledger` is a pure function of them; `write` puts it
in the run directory as goodput.json, at the end of every attempt).

An attempt runs from `raytrainer.train` being called (run_started's `launched`) to its end
event. Its first training row ends `starting` (Ray, actors, imports, the model built, the
first step) and its last begins `stopping` (the final save, model.pt, the workers' exit).
Between them the time is training, less what the events say was spent otherwise:
- a recovery, from the last row before the failure to the first row after `recovered`,
  less that row's step (a step that counts): `steps_lost` steps of it `recomputed`, the
  rest `recovering`;
- `resized` and `left_node` pauses (`resizing`), a save's hold on the training thread
  (`checkpoint_committed`'s `blocked_s`), a validation's (`validated`'s `held_s` for the
  validation actors; a validation in the loop, from its step's row to its own row).
A hold is taken from the part of the timeline its step's after-step work falls in: the last
step's saves are in stopping's time, a save right before a failure in the recovery's.

Training below the run's size (waiting for capacity) is training: the ledger says how long
(`below_size_s`), not a bucket; so is training held back by a slow worker (`slowed_s`, from
`slow_worker` events). The time between attempts (a driver killed, a job requeued,
a run resumed a week later) is `down_s`, left out of the wall time: whether the run was
meant to be running then is not in its files.
"""

from __future__ import annotations

import bisect
import json
import os
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .identity import ENDS, parse_events

FILE = "goodput.json"
LOST = ("starting", "recomputed", "recovering", "resizing", "checkpoint", "validation", "stopping")
BUCKETS = ("training", *LOST)


@dataclass
class Ledger:
    buckets: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0.0))
    """Seconds per bucket; they sum to wall_s."""
    wall_s: float = 0.0
    """The attempts' wall time together (down_s left out)."""
    attempts: int = 0
    down_s: float = 0.0
    """Between attempts: no driver ran the run."""
    below_size_s: float = 0.0
    """Training time spent below the run's size, waiting for capacity."""
    failures: dict[str, int] = field(default_factory=dict)
    """Failures by kind (worker_failed's: died, hung, error; preempted: left_node), peers only
    interrupted by one not counted."""
    slowed_s: dict[str, float] = field(default_factory=dict)
    """Training time lost to a slow rank, by rank (see _slowed)."""
    step_s: float | None = None
    """The median training step: what a lost step costs to do again."""
    spans: list[tuple[float, float, str]] = field(default_factory=list, repr=False)
    """(from, to, bucket) in time.time() seconds, what is not training: for a timeline (plot.py),
    the holds placed right after their step's row. Not in goodput.json."""

    @property
    def goodput(self) -> float:
        return self.buckets["training"] / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        fields = {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items() if k != "spans"}
        buckets = {k: round(v, 4) for k, v in self.buckets.items()}
        return {"goodput": round(self.goodput, 4), **fields, "buckets": buckets}

    def lines(self) -> list[str]:
        """Two lines at most: the goodput and what took the rest, largest first; then the
        notes (below size, attempts)."""
        lost = sorted(((v, k) for k, v in self.buckets.items() if k != "training"), reverse=True)
        parts = [f"{v / self.wall_s:.1%} {k}{self._why(k)}" for v, k in lost if self.wall_s and v / self.wall_s >= 5e-4]
        lines = [f"goodput {self.goodput:.1%} of {_duration(self.wall_s)}" + (": " + ", ".join(parts) if parts else "")]
        notes = []
        if self.below_size_s > 0:
            notes.append(f"trained below its size for {_duration(self.below_size_s)}")
        for rank, seconds in sorted(self.slowed_s.items()):
            if self.wall_s:
                notes.append(f"slowed by rank {rank}: {seconds / self.wall_s:.1%}")
        if self.attempts > 1:
            notes.append(f"{self.attempts} attempts, down {_duration(self.down_s)} between them (not counted)")
        return lines + (["  " + "; ".join(notes)] if notes else [])

    def _why(self, bucket: str) -> str:
        if bucket != "recovering" or not self.failures:
            return ""
        total = sum(self.failures.values())
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(self.failures.items(), key=lambda kv: -kv[1]))
        return f" ({total} failure{'s' if total > 1 else ''}: {kinds})"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes = seconds / 60
    return f"{minutes:.1f} min" if minutes < 120 else f"{minutes / 60:.1f} h"


def ledger(events: list[dict[str, Any]], rows: list[dict[str, Any]]) -> Ledger:
    """The ledger of a run from its events and metric rows (every attempt's)."""
    timed = [r for r in rows if isinstance(r.get("time"), (int, float)) and isinstance(r.get("step"), int)]
    train = sorted((r for r in timed if not any(k.startswith("val_") for k in r)), key=lambda r: r["time"])
    val = [r for r in timed if any(k.startswith("val_") for k in r)]
    out = Ledger(step_s=_step_time(train))
    attempts = _attempts(events)
    out.attempts = len(attempts)
    last_step = None
    for i, attempt in enumerate(attempts):
        after = _start(attempts[i + 1]) if i + 1 < len(attempts) else float("inf")
        start, end = _start(attempt), _end(attempt, train, after)
        out.down_s += max(0.0, after - end) if after < float("inf") else 0.0
        mine = [r for r in train if start <= r["time"] <= end]
        part = _Attempt(attempt, mine, [r for r in val if start <= r["time"] <= end], out.step_s or 0.0)
        part.account(start, end, last_step)
        for k, v in part.buckets.items():
            out.buckets[k] += v
        out.wall_s += end - start
        out.below_size_s += _below_size(attempt, end)
        for rank, seconds in _slowed(attempt, mine, end).items():
            out.slowed_s[rank] = out.slowed_s.get(rank, 0.0) + seconds
        out.failures.update(part.failures)
        out.spans += part.spans
        last_step = mine[-1]["step"] if mine else last_step
    out.failures = dict(out.failures)
    return out


def _step_time(train: list[dict[str, Any]]) -> float | None:
    gaps = [(b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(train, train[1:])
            if b["step"] > a["step"] and b["time"] > a["time"]]
    return statistics.median(gaps) if gaps else None


def _attempts(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The events split at each run_started (a resume appends to the same events.jsonl)."""
    attempts: list[list[dict[str, Any]]] = []
    for e in events:
        if e.get("event") == "run_started" or not attempts:
            attempts.append([])
        attempts[-1].append(e)
    return [a for a in attempts if isinstance(a[0].get("time"), (int, float))]


def _start(attempt: list[dict[str, Any]]) -> float:
    first = attempt[0]
    return min(first.get("launched") or first["time"], first["time"])


def _end(attempt: list[dict[str, Any]], train: list[dict[str, Any]], before: float) -> float:
    """The end event's time; for an attempt whose driver was lost, its last event or row
    (rows come from the workers, which may outlive the driver's last event)."""
    end = next((e for e in reversed(attempt) if e.get("event") in ENDS), None)
    if end is not None:
        return end["time"]
    rows = [r["time"] for r in train if attempt[0]["time"] <= r["time"] < before]
    return max([attempt[-1]["time"], *rows])


class _Attempt:
    """One attempt's buckets: the timeline cut at its first and last rows, recoveries cut
    out of the span between, then each hold taken from the part its step falls in."""

    def __init__(self, events: list[dict[str, Any]], train: list[dict[str, Any]], val: list[dict[str, Any]],
                 step_s: float):
        self.events, self.train, self.val, self.step_s = events, train, val, step_s
        self.times = [r["time"] for r in train]
        self.buckets: dict[str, float] = dict.fromkeys(BUCKETS, 0.0)
        self.failures: Counter[str] = Counter()
        self.recovery_steps: set[int] = set()  # rows whose after-step work fell in a recovery
        self.recovery_spans: list[tuple[float, float]] = []
        self.spans: list[tuple[float, float, str]] = []

    def account(self, start: float, end: float, previous_last_step: int | None) -> None:
        if not self.train:  # never reached a step: all of it starting (or stopping after a failure)
            self.buckets["starting"] = end - start
            self.spans.append((start, end, "starting"))
            return
        first, last = self.train[0], self.train[-1]
        self.buckets["starting"] = first["time"] - start
        self.buckets["stopping"] = max(0.0, end - last["time"])
        self.buckets["training"] = last["time"] - first["time"]
        self.spans += [(start, first["time"], "starting"), (last["time"], end, "stopping")]
        self._recoveries()
        self._resumed(previous_last_step, first["time"])
        at = {r["step"]: r["time"] for r in self.train}
        for step, seconds, bucket in self._holds():
            taken = self._take(self._part(step, first["step"], last["step"]), bucket, seconds)
            if taken > 0 and step in at:
                self.spans.append((at[step], at[step] + taken, bucket))

    def _recoveries(self) -> None:
        failed_at: float | None = None
        for e in self.events:
            kind = e.get("event")
            if kind == "worker_failed":
                failed_at = e["time"] if failed_at is None else failed_at
                if e.get("kind") != "interrupted":
                    self.failures[e.get("kind", "failed")] += 1
            elif kind == "left_node":
                self.failures["preempted"] += 1
            elif kind == "recovered":
                at = failed_at if failed_at is not None else e["time"] - float(e.get("seconds") or 0)
                self._recovery(at, e["time"], int(e.get("steps_lost") or 0))
                failed_at = None

    def _recovery(self, failed_at: float, recovered_at: float, steps_lost: int) -> None:
        # rows are in time order: the last at or before the failure, the first after the recovery
        i, j = bisect.bisect_right(self.times, failed_at) - 1, bisect.bisect_right(self.times, recovered_at)
        if i < 0 or j >= len(self.train):  # before the first step (starting's) or the run ended on it (stopping's)
            return
        before, after = self.train[i], self.train[j]
        length = max(0.0, after["time"] - before["time"] - self.step_s)
        length = min(length, self.buckets["training"])
        redone = min(length, steps_lost * self.step_s)
        self.buckets["training"] -= length
        self.buckets["recomputed"] += redone
        self.buckets["recovering"] += length - redone
        self.recovery_steps.add(before["step"])
        self.recovery_spans.append((before["time"], after["time"]))
        began, redone_from = before["time"], before["time"] + length - redone
        self.spans += [(began, redone_from, "recovering"), (redone_from, redone_from + redone, "recomputed")]

    def _resumed(self, previous_last_step: int | None, first: float) -> None:
        """A resume from a checkpoint does again the steps the last attempt did after it."""
        resumed = next((e for e in self.events if e.get("event") == "resumed"), None)
        if resumed is None or previous_last_step is None or not isinstance(resumed.get("step"), int):
            return
        taken = self._take("training", "recomputed", max(0, previous_last_step - resumed["step"]) * self.step_s)
        self.spans.append((first, first + taken, "recomputed"))

    def _holds(self) -> list[tuple[int, float, str]]:
        """(step, seconds, bucket) of every pause the events and rows measure."""
        holds: list[tuple[int, float, str]] = []
        saves: dict[int, float] = {}
        for e in self.events:
            kind, step = e.get("event"), e.get("step")
            if not isinstance(step, int):
                continue
            if kind == "checkpoint_committed":  # one a step: sharded saves may say it per rank
                saves[step] = max(saves.get(step, 0.0), float(e.get("blocked_s") or 0))
            elif kind == "validated" and "held_s" in e:
                holds.append((e.get("at_step", step), float(e["held_s"]), "validation"))
            elif kind in ("resized", "left_node") and not self._in_recovery(e["time"]):
                holds.append((step, float(e.get("seconds") or 0), "resizing"))
        holds += [(step, s, "checkpoint") for step, s in saves.items()]
        return holds + self._validations_here()

    def _in_recovery(self, at: float) -> bool:
        """A shrink a recovery went on with is the recovery's own time, already counted."""
        return any(start <= at <= end for start, end in self.recovery_spans)

    def _validations_here(self) -> list[tuple[int, float, str]]:
        """A validation in the loop starts once its step's row is out and ends with its own
        row: the gap between them held training (the validation actors' say so themselves)."""
        actors = {e["step"] for e in self.events if e.get("event") == "validated"}
        at = {r["step"]: r["time"] for r in self.train}
        return [(r["step"], r["time"] - at[r["step"]], "validation") for r in self.val
                if r["step"] not in actors and r["step"] in at and r["time"] > at[r["step"]]]

    def _part(self, step: int, first: int, last: int) -> str:
        if step >= last:
            return "stopping"
        if step < first:
            return "starting"
        return "recovering" if step in self.recovery_steps else "training"

    def _take(self, source: str, bucket: str, seconds: float) -> float:
        taken = max(0.0, min(seconds, self.buckets[source]))
        self.buckets[source] -= taken
        self.buckets[bucket] += taken
        return taken


def _below_size(attempt: list[dict[str, Any]], end: float) -> float:
    """Time below the run's size for want of room: from `waiting_for_capacity` to the
    `resized` that says how long it waited (or to the attempt's end)."""
    total, since = 0.0, None
    for e in attempt:
        if e.get("event") == "waiting_for_capacity" and since is None:
            since = e["time"]
        elif e.get("event") == "resized" and "capacity_waited_s" in e:
            total += float(e["capacity_waited_s"])
            since = None
    return total + (end - since if since is not None else 0.0)


REFORMS = ("slow_worker_replaced", "recovered", "resized", "left_node", "group_formed")
"""Events after which the ranks are other workers, or numbered anew."""


def _slowed(attempt: list[dict[str, Any]], train: list[dict[str, Any]], end: float) -> dict[str, float]:
    """Training time lost to each slow rank (`slow_worker`): from the first step it was
    judged slow over to the next re-form (its replacement) or the attempt's end, the share
    a group at the others' pace would not have taken (1 - 1 / ratio)."""
    at = {r["step"]: r["time"] for r in train}
    slowed: dict[str, float] = {}
    open_: dict[str, tuple[float, float]] = {}  # rank -> (since, ratio)

    def close(until: float) -> None:
        for rank, (since, ratio) in open_.items():
            slowed[rank] = slowed.get(rank, 0.0) + max(0.0, until - since) * (1 - 1 / max(ratio, 1.0))
        open_.clear()

    for e in attempt:
        if e.get("event") == "slow_worker" and isinstance(e.get("ratio"), (int, float)):
            open_[str(e.get("rank"))] = (at.get(e.get("since_step"), e["time"]), float(e["ratio"]))
        elif e.get("event") in REFORMS:
            close(e["time"])
    close(end)
    return slowed


def of_dir(run_dir: Path) -> Ledger:
    def read(name: str) -> list[dict[str, Any]]:
        try:
            return parse_events((run_dir / name).read_text(errors="replace"))
        except OSError:
            return []

    return ledger(read("events.jsonl"), read("metrics.jsonl"))


def write(run_dir: Path) -> Ledger:
    """goodput.json in the run directory, for every attempt so far."""
    result = of_dir(run_dir)
    tmp = run_dir / (FILE + ".tmp")
    tmp.write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    os.replace(tmp, run_dir / FILE)
    return result
