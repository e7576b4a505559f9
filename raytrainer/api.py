"""`raytrainer.train(...)`: the one entry point behind the CLI and the Python API."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .config import Config, dump_config, load_config
from .controller import Controller
from .errors import ConfigError
from .metrics import EventLog, JsonlWriter, MetricsHub, ProgressBar, TensorBoardSink


@dataclass
class Result:
    run_dir: Path
    metrics: dict[str, Any]
    """The latest value of every metric (last training step and last validation)."""
    history: list[dict[str, Any]] = field(repr=False)
    """Every row written to metrics.jsonl, in order."""
    events: list[dict[str, Any]] = field(repr=False)


def train(config: str | Path | dict[str, Any] | Config, overrides: Iterable[str] = (), *,
          address: str | None = None, progress: bool = True) -> Result:
    """Train the task a config describes; return its metrics and run directory.

    Uses the Ray this process is connected to; otherwise connects to `address`
    (or $RAY_ADDRESS); otherwise starts a local Ray for the run and stops it after.
    """
    import ray

    if not isinstance(config, Config):
        config = load_config(config, overrides)
    elif overrides:
        raise ConfigError("overrides apply to a YAML path or a dict, not to a built Config")
    if config.run.name is None:
        stem = config.task.target.partition(":")[0].rsplit(".", 1)[-1]
        config.run.name = f"{stem}-" + datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    run_dir = Path(config.run.storage.removeprefix("file://")) / config.run.name
    if (run_dir / "metrics.jsonl").exists():
        raise ConfigError(
            f"run directory {str(run_dir)!r} already holds a run; choose another run.name "
            "(e.g. --set run.name=NEW) or remove that directory"
        )

    started_ray = False
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, logging_level="WARNING")
        else:
            ray.init(include_dashboard=False, logging_level="WARNING")
            started_ray = True
    try:
        return _run(config, run_dir, progress=progress, cluster_can_grow=not started_ray)
    finally:
        if started_ray:
            ray.shutdown()


def _run(config: Config, run_dir: Path, *, progress: bool, cluster_can_grow: bool) -> Result:
    import ray

    from .group import RayWorkerGroup

    use_gpu = config.scaling.use_gpu
    if use_gpu == "auto":
        use_gpu = ray.cluster_resources().get("GPU", 0) > 0

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(config))
    events = EventLog(run_dir / "events.jsonl")
    bar = ProgressBar() if progress else None
    sinks = [JsonlWriter(run_dir / "metrics.jsonl"), TensorBoardSink(run_dir)] + ([bar] if bar else [])
    hub = MetricsHub(sinks)
    group = RayWorkerGroup(config, use_gpu, cluster_can_grow=cluster_can_grow, run_dir=run_dir)
    controller = Controller(group, config.scaling.num_workers, hub, events, progress=bar)
    try:
        weights = controller.run()  # torch.save bytes: the driver never imports torch
        tmp = run_dir / "model.pt.tmp"
        tmp.write_bytes(weights)
        os.replace(tmp, run_dir / "model.pt")  # never a half-written model.pt
    finally:
        hub.close()
        events.close()
    return Result(run_dir=run_dir, metrics=dict(hub.latest), history=hub.history, events=events.events)
