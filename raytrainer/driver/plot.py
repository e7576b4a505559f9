"""`raytrainer plot RUN_DIR [RUN_DIR ...]`: a run (or several, overlaid) as PNG charts.
A RUN_DIR may be a URI (s3://, gs://, ...): its files are read through its filesystem.

Panels, in order: one per metric the task logs (training line and its `val_`
counterpart together, `loss` first), the learning rate, throughput (samples/s)
against step, the world size against seconds since the run started, with the
driver's lifecycle events (failures, recoveries, resizes, ...) as vertical
markers, and the goodput ledger's timeline (ledger.py: starting, recovering,
checkpoints, ... over training) on the same axis. Failures, recoveries and resizes
are also marked on the step panels.

matplotlib is imported here only, and without pyplot (no global backend, no
display needed): `raytrainer train` never pays for it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..errors import ConfigError, RaytrainerError
from .ledger import LOST, ledger

# Events drawn as vertical markers: name -> (line style, label). Colour is the run's.
KNOWN_EVENTS = {
    "group_formed": ((0, (1, 1)), "group formed"),
    "worker_failed": ((0, (6, 2)), "worker failed"),
    "recovered": ("-.", "recovered"),
    "resized": ("-", "resized"),
    "failed": ((0, (2, 2, 6, 2, 2, 2)), "run failed"),
    "finished": ((0, (1, 5)), "finished"),
}
# The ones that matter when reading a loss curve.
STEP_EVENTS = ("worker_failed", "recovered", "resized", "failed")
NOT_METRICS = {"step", "epoch", "world_size", "time", "lr", "samples_per_s"}
COLUMNS, PANEL_W, PANEL_H, DPI = 2, 6.0, 3.2, 100


@dataclass
class Run:
    name: str
    rows: list[dict[str, Any]]
    events: list[dict[str, Any]]
    start: float = field(init=False)

    def __post_init__(self):
        started = [e["time"] for e in self.events if e.get("event") == "run_started" and "time" in e]
        times = started or [r["time"] for r in self.rows if "time" in r] or [e["time"] for e in self.events if "time" in e]
        self.start = min(times) if times else 0.0


@dataclass
class PlotResult:
    path: Path
    panels: list[str]
    """Panel titles, in drawing order."""


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return _parse_jsonl(path.read_text(), str(path)) if path.exists() else []


def _parse_jsonl(text: str, where: str) -> list[dict[str, Any]]:
    lines = text.splitlines()
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if n == len(lines):  # a run killed mid-write leaves a partial last line
                break
            raise RaytrainerError(f"{where}:{n} is not valid JSON ({exc})") from None
    return out


def load_run(run_dir: str | Path) -> Run:
    if "://" in str(run_dir):
        return _load_remote(str(run_dir))
    path = Path(run_dir)
    if not path.is_dir():
        raise ConfigError(f"RUN_DIR {str(path)!r} is not a directory; give a run directory such as runs/digits-...")
    if not (path / "metrics.jsonl").exists() and not (path / "events.jsonl").exists():
        raise ConfigError(f"RUN_DIR {str(path)!r} holds no metrics.jsonl or events.jsonl: not a run directory")
    return Run(path.name, _read_jsonl(path / "metrics.jsonl"), _read_jsonl(path / "events.jsonl"))


def _load_remote(uri: str) -> Run:
    """A run directory at a URI, its files read through its filesystem (filesystems.py)."""
    from .. import filesystems
    from ..checkpoint import Storage

    filesystems.check("RUN_DIR", uri)
    parent, name = filesystems.split(uri)
    try:
        storage = Storage(parent)
        texts = {f: storage.read(f"{name}/{f}").decode() if storage.exists(f"{name}/{f}") else None
                 for f in ("metrics.jsonl", "events.jsonl")}
    except OSError as exc:
        raise RaytrainerError(f"RUN_DIR {uri!r} could not be read ({exc})") from None
    if not any(texts.values()):
        raise ConfigError(f"RUN_DIR {uri!r} holds no metrics.jsonl or events.jsonl: not a run directory")
    return Run(name, *(_parse_jsonl(texts[f] or "", filesystems.join(uri, f))
                       for f in ("metrics.jsonl", "events.jsonl")))


def metric_names(runs: Iterable[Run]) -> list[str]:
    """Base names of the metric panels: `loss` first, then the rest sorted ('val_x' joins 'x')."""
    names = set()
    for run in runs:
        for row in run.rows:
            for key, value in row.items():
                if key not in NOT_METRICS and isinstance(value, (int, float)):
                    names.add(key.removeprefix("val_"))
    return sorted(names, key=lambda n: (n != "loss", n))


def plot_runs(run_dirs: Iterable[str | Path], out: str | Path | None = None) -> PlotResult:
    """Draw the runs into one PNG; return its path and the panels drawn."""
    run_dirs = list(run_dirs)
    if not run_dirs:
        raise ConfigError("give at least one RUN_DIR")
    runs = [load_run(d) for d in run_dirs]
    if out is None:
        out = _default_out(str(run_dirs[0]), runs)
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise ConfigError(f"--out {str(out)!r}: the plot is a PNG; give a path ending in .png")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise RaytrainerError("raytrainer plot needs matplotlib: pip install matplotlib") from None

    metrics = metric_names(runs)
    panels = metrics + ["learning rate", "throughput", "world size", "where the time went"]
    rows = math.ceil(len(panels) / COLUMNS)
    fig = Figure(figsize=(PANEL_W * COLUMNS, PANEL_H * rows), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, COLUMNS, squeeze=False).flatten()
    for ax in axes[len(panels):]:
        fig.delaxes(ax)
    colors = [f"C{i % 10}" for i in range(len(runs))]
    label = (lambda run, what: f"{run.name} {what}") if len(runs) > 1 else (lambda run, what: what)

    for ax, name in zip(axes, metrics):
        for run, color in zip(runs, colors):
            _line(ax, run.rows, name, color, "-", label(run, "train"))
            _line(ax, run.rows, "val_" + name, color, "--", label(run, "val"), marker="o")
        _mark_steps(ax, runs, colors)
        _finish(ax, name, "step")
    ax = axes[len(metrics)]
    for run, color in zip(runs, colors):
        _line(ax, run.rows, "lr", color, "-", label(run, "lr") if len(runs) > 1 else None)
    _mark_steps(ax, runs, colors)
    _finish(ax, "learning rate", "step")
    ax = axes[len(metrics) + 1]
    for run, color in zip(runs, colors):
        _line(ax, run.rows, "samples_per_s", color, "-", label(run, "samples/s") if len(runs) > 1 else None)
    _mark_steps(ax, runs, colors)
    _finish(ax, "throughput (samples/s)", "step")
    _world_size(axes[len(metrics) + 2], runs, colors)
    _timeline(axes[len(metrics) + 3], runs)

    fig.suptitle(", ".join(r.name for r in runs))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return PlotResult(out, panels)


def _default_out(first: str, runs: list[Run]) -> Path:
    """RUN_DIR/plot.png for one local run; for one at a URI, <run name>.png here (the plot is
    for the person who asked, not for the run's storage); plot.png here for several."""
    if len(runs) > 1:
        return Path("plot.png")
    return Path(f"{runs[0].name}.png") if "://" in first else Path(first) / "plot.png"


def _line(ax, rows, key, color, style, label, marker=None) -> None:
    points = [(r["step"], r[key]) for r in rows
              if isinstance(r.get(key), (int, float)) and isinstance(r.get("step"), (int, float))]
    if points:
        xs, ys = zip(*points)
        ax.plot(xs, ys, color=color, linestyle=style, marker=marker, markersize=3, label=label)


def _mark_steps(ax, runs, colors) -> None:
    for run, color in zip(runs, colors):
        for e in run.events:
            if e.get("event") in STEP_EVENTS and isinstance(e.get("step"), (int, float)):
                ax.axvline(e["step"], color=color, linestyle=KNOWN_EVENTS[e["event"]][0], linewidth=1, alpha=0.8)


def _world_size(ax, runs, colors) -> None:
    seen = set()
    for run, color in zip(runs, colors):
        # Rows say the size at each step; events say it where no step ran (formation,
        # a failure, a resize): together they are the size over time.
        points = [(r["time"], r["world_size"]) for r in run.rows if "time" in r and "world_size" in r]
        for e in run.events:
            size = e.get("new_world_size", e.get("world_size"))
            if isinstance(size, (int, float)) and "time" in e:
                points.append((e["time"], size))
        points.sort()
        if points:
            xs = [t - run.start for t, _ in points]
            ax.step(xs, [s for _, s in points], where="post", color=color,
                    label=run.name if len(runs) > 1 else None)
        for e in run.events:
            if e.get("event") in KNOWN_EVENTS and "time" in e:
                style, text = KNOWN_EVENTS[e["event"]]
                ax.axvline(e["time"] - run.start, color=color, linestyle=style, linewidth=1,
                           label=None if text in seen else text)
                seen.add(text)
    ax.yaxis.get_major_locator().set_params(integer=True)
    _finish(ax, "world size", "seconds since run start")


def _timeline(ax, runs) -> None:
    """A lane a run: training (green) under the ledger's spans of other time, a colour each."""
    colors = dict(zip(LOST, ("tab:gray", "tab:orange", "tab:red", "tab:purple", "tab:blue", "tab:cyan", "tab:brown")))
    seen, labels = set(), []
    for lane, run in enumerate(runs):
        account = ledger(run.events, run.rows)
        labels.append(f"{run.name}\n{account.goodput:.1%}" if account.wall_s > 0 else run.name)
        if account.wall_s <= 0:
            continue
        ends = [t for span in account.spans for t in span[:2]]
        ax.broken_barh([(min(ends) - run.start, max(ends) - min(ends))], (lane - 0.4, 0.8), color="tab:green",
                       label=None if "training" in seen else "training")
        seen.add("training")
        for bucket in LOST:
            bars = [(a - run.start, b - a) for a, b, kind in account.spans if kind == bucket and b > a]
            if bars:
                ax.broken_barh(bars, (lane - 0.4, 0.8), color=colors[bucket], label=None if bucket in seen else bucket)
                seen.add(bucket)
    # The run's goodput beside its lane (a lone run's in the title), the legend in a band above.
    ax.set_yticks(range(len(runs)), labels if len(runs) > 1 else [""])
    ax.set_ylim(-0.6, len(runs) + 0.5)
    ax.set_title("where the time went" + (f" (goodput {labels[0].split(chr(10))[-1]})" if len(runs) == 1
                                           and "\n" in labels[0] else ""))
    ax.set_xlabel("seconds since run start")
    ax.grid(alpha=0.3)
    if seen:
        ax.legend(fontsize="small", ncols=4, loc="upper center")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")


def _finish(ax, title, xlabel) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    if not ax.lines:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    elif any(line.get_label() and not line.get_label().startswith("_") for line in ax.lines):
        ax.legend(fontsize="small")
