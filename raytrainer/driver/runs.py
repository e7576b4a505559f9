"""`raytrainer runs [STORAGE]` and `raytrainer show RUN_DIR`: what run directories hold, read
from their files alone (config.yaml, events.jsonl, metrics.jsonl) through checkpoint.Storage,
so that a URI (s3://bucket/runs) lists as a local path does. Whether a run is running is its
lock's (api.lock_of): held by a live driver on this machine; a driver elsewhere, or a remote
run's, is not seen from here, and such a run shows as unfinished."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import filesystems
from ..checkpoint import Storage
from ..errors import ConfigError
from . import ledger as ledgers, localray
from .api import lock_of
from .identity import last_end, parse_events


@dataclass
class RunFiles:
    """One run directory's files, as read."""

    name: str
    where: str
    """The run directory as shown: a path or a URI."""
    config: dict[str, Any]
    events: list[dict[str, Any]]
    rows: list[dict[str, Any]]
    holder: str | None
    """Who holds the run's lock now ("pid N on HOST, since ..."), None if nobody here does."""

    @property
    def state(self) -> str:
        """running, finished, failed, stopped, or unfinished (no end recorded: its driver was
        lost; its workers may wait for a new one, failure.driver_grace_s)."""
        if self.holder is not None:
            return "running"
        return last_end(self.events)[0] or ("unfinished" if self.events else "not started")

    @property
    def step(self) -> int | None:
        return max((r["step"] for r in self.rows if isinstance(r.get("step"), int)), default=None)

    def ledger(self) -> ledgers.Ledger:
        return ledgers.ledger(self.events, self.rows)


def read(storage: Storage, name: str) -> RunFiles:
    import yaml

    def text(file: str) -> str:
        try:
            return storage.read(f"{name}/{file}").decode(errors="replace") if storage.exists(f"{name}/{file}") else ""
        except OSError:
            return ""

    config = yaml.safe_load(text("config.yaml")) or {}
    return RunFiles(name, storage.uri_of(name),
                    config if isinstance(config, dict) else {}, parse_events(text("events.jsonl")),
                    parse_events(text("metrics.jsonl")), _holder(storage, name))


def _holder(storage: Storage, name: str) -> str | None:
    """Who holds the run's lock: a moment's try (a driver starting in that moment would be
    told the run is in use: it is, by this look)."""
    lock = lock_of(storage, name)[0]
    if not lock.exists():
        return None
    try:
        held = localray.try_lock(lock)
    except (ImportError, OSError):  # not POSIX, or a file system that does not lock
        return None
    if held is None:
        return lock.read_text().strip() or "another process"
    held.close()
    return None


def _open(where: str, what: str) -> Storage:
    filesystems.check(what, where)
    try:
        return Storage(where)
    except OSError as exc:
        raise ConfigError(f"{where!r} could not be opened ({exc})") from None


def list_runs(where: str) -> list[str]:
    """A line a run under storage `where` (a directory with a config.yaml), oldest name first."""
    storage = _open(where, "STORAGE")
    try:
        names = sorted(storage.list_dirs(""))
    except OSError:
        names = []
    runs = [read(storage, n) for n in names if storage.exists(f"{n}/config.yaml")]
    if not runs:
        return [f"no runs in {where}"]
    table = [("NAME", "STATE", "STEP", "GOODPUT", "WHERE")]
    for run in runs:
        goodput = run.ledger()
        table.append((run.name, run.state, "-" if run.step is None else str(run.step),
                      f"{goodput.goodput:.1%}" if goodput.wall_s > 0 else "-",
                      run.where + (f" ({run.holder})" if run.holder else "")))
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    return ["  ".join([*(c.ljust(w) for c, w in zip(row[:4], widths)), row[4]]).rstrip() for row in table]


def show(run_dir: str) -> list[str]:
    """One run's summary: its state, config in short, last metrics, the ledger, failures."""
    storage_uri, name = filesystems.split(run_dir)
    storage = _open(storage_uri or ".", "RUN_DIR")
    if not name or not storage.exists(f"{name}/config.yaml"):
        raise ConfigError(f"{run_dir!r} is not a run directory (it has no config.yaml)")
    run = read(storage, name)
    goodput = run.ledger()
    how = f"running ({run.holder})" if run.holder else last_end(run.events)[1] if run.events else "not started"
    lines = [f"{run.where}: {how}" + (f", {goodput.attempts} attempts" if goodput.attempts > 1 else ""),
             "config: " + _config_line(run.config), "last metrics: " + _metrics_line(run.rows)]
    lines += goodput.lines() if goodput.wall_s > 0 else []
    return lines + _failures_lines(run.events)


def _config_line(config: dict[str, Any]) -> str:
    task, trainer, scaling = (config.get(k) or {} for k in ("task", "trainer", "scaling"))
    length = (f"{trainer['max_steps']} steps" if trainer.get("max_steps")
              else f"{trainer.get('max_epochs')} epochs" if trainer.get("max_epochs") else "")
    parts = [str(task.get("target") or task.get("loop") or task.get("by_value") or "?"),
             f"{scaling.get('num_workers', '?')} workers", length,
             f"global batch {trainer.get('global_batch_size', '?')}", str(trainer.get("strategy") or "")]
    return ", ".join(p for p in parts if p)


def _metrics_line(rows: list[dict[str, Any]]) -> str:
    """The newest value of each metric (the last training row's and the last validation's)."""
    latest: dict[str, Any] = {}
    for row in rows:
        latest.update(row)
    if not latest:
        return "none yet"
    shown = {k: v for k, v in latest.items() if k not in ("step", "epoch", "time", "world_size")}
    values = "  ".join(f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())
    where = f"step {latest.get('step')}, epoch {latest.get('epoch', 0) + 1}, workers {latest.get('world_size')}"
    return f"{where}  {values}"


def _failures_lines(events: list[dict[str, Any]]) -> list[str]:
    """Recoveries by cause: the cluster's losses and the run's own faults (recovered's counts,
    so far in each attempt), and each cause once with how often."""
    recovered = [e for e in events if e.get("event") == "recovered"]
    if not recovered:
        return ["failures: none recovered from"]
    losses = faults = 0
    for i, e in enumerate(recovered):  # the counts restart with each attempt: sum each attempt's last
        last_of_attempt = i + 1 == len(recovered) or recovered[i + 1].get("failures", 0) <= e.get("failures", 0)
        if last_of_attempt:
            losses, faults = losses + e.get("losses", 0), faults + e.get("faults", 0)
    causes: dict[str, int] = {}
    for e in recovered:
        cause = str(e.get("cause") or "?").splitlines()[0]
        causes[cause] = causes.get(cause, 0) + 1
    lines = [f"failures: {len(recovered)} recovered from: {losses} lost worker(s), {faults} fault(s) of the run's own"]
    return lines + [f"  {n} x {cause}" for cause, n in sorted(causes.items(), key=lambda kv: -kv[1])]
