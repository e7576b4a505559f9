"""The `loggers:` of a run: MLflow and Weights & Biases here, TensorBoard in metrics.py, or a
user's own `Sink` by import path. Each runs behind a BackgroundSink (its own thread).

mlflow and wandb are optional (`pip install 'raytrainer[mlflow]'`, `'raytrainer[wandb]'`)
and imported only on a logger's thread when a run configures them, so neither delays a
run that does not use it, nor the start of one that does.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator

from ..config import LoggerConfig
from ..errors import ConfigError
from .metrics import BackgroundSink, RunInfo, Sink, TensorBoardSink
from ..task import import_object

# mlflow's client retries a failed request 7 times over about 4 minutes and waits 120 s for
# an answer: against a server that is down, every batch would take minutes. These fail in
# seconds; set the variables yourself to choose otherwise (they are read at each request).
MLFLOW_FAIL_FAST = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
_NOT_NOTED = ("checkpoint_committed",)  # too many for a note; log_checkpoints uploads them
_STATUS = {"finished": ("FINISHED", 0), "failed": ("FAILED", 1)}  # by the run's last event


def build_loggers(configs: list[LoggerConfig], *, warn: Callable[[str], None]) -> list[BackgroundSink]:
    """The configured loggers, each on its own thread; a missing package or a user's sink that
    cannot be built is a ConfigError now, before any training."""
    built = []
    for i, cfg in enumerate(configs):
        key = f"loggers[{i}]"
        if cfg.type == "tensorboard":
            sink, name = TensorBoardSink(), "tensorboard"
        elif cfg.type == "mlflow":
            _require("mlflow", "mlflow", key)
            sink = MlflowSink(tracking_uri=cfg.tracking_uri, experiment=cfg.experiment,
                              run_name=cfg.run_name, log_checkpoints=cfg.log_checkpoints)
            name = f"mlflow ({cfg.tracking_uri or os.environ.get('MLFLOW_TRACKING_URI') or 'default URI'})"
        elif cfg.type == "wandb":
            _require("wandb", "wandb", key)
            sink = WandbSink(project=cfg.project, entity=cfg.entity, run_name=cfg.run_name, mode=cfg.mode,
                             log_checkpoints=cfg.log_checkpoints)
            name = f"wandb ({cfg.project or os.environ.get('WANDB_PROJECT') or 'default project'})"
        else:
            klass = import_object(cfg.target, f"{key}.target")
            try:
                sink = klass(**cfg.args)
            except TypeError as exc:
                raise ConfigError(f"{key}.args do not fit {cfg.target!r}: {exc}") from None
            name = cfg.target
        built.append(BackgroundSink(sink, name, warn=warn, close_timeout_s=cfg.close_timeout_s))
    return built


def _require(module: str, extra: str, key: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{key}.type={extra!r} needs the {module} package: "
                          f"pip install 'raytrainer[{extra}]' (or remove the logger)")


def _metrics(row: dict[str, Any]) -> Iterator[tuple[str, float]]:
    for key, value in row.items():
        if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool):
            yield key, float(value)


def _wanted(path: Path, kind: str, log_checkpoints: bool) -> bool:
    """model.pt always; a checkpoint with log_checkpoints, unless retention (keep_last) has
    deleted it before this logger's thread got to it."""
    return kind != "checkpoint" or (log_checkpoints and path.is_dir())


def _note_line(record: dict[str, Any]) -> str:
    fields = ", ".join(f"{k}={v}" for k, v in record.items() if k not in ("event", "time", "step"))
    return f"- step {record.get('step')}: {record['event']}" + (f" ({fields})" if fields else "")


def _flatten(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """`section.key` -> value for every leaf of a nested config dict (lists stay whole)."""
    if isinstance(obj, dict) and obj:
        for key, value in obj.items():
            yield from _flatten(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], obj


class MlflowSink(Sink):
    """One MLflow run per raytrainer run: the config as params, every row as metrics at its
    step (batched, log_batch), lifecycle events in the run's note, model.pt (and with
    log_checkpoints every checkpoint) as artifacts. A resumed run continues the same MLflow
    run: its id is kept in the run directory's loggers.json."""

    def __init__(self, tracking_uri: str | None = None, experiment: str | None = None,
                 run_name: str | None = None, log_checkpoints: bool = False):
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.log_checkpoints = log_checkpoints
        self.client: Any = None
        self.run_id: str | None = None
        self._metrics: list[Any] = []
        self._note: list[str] = []
        self._note_changed = False
        self._status = "KILLED"  # until a finished or failed event says otherwise
        for var, value in MLFLOW_FAIL_FAST.items():
            os.environ.setdefault(var, value)

    def open(self, run: RunInfo) -> None:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(self.tracking_uri)
        experiment = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        key = f"mlflow {self.client.tracking_uri} {experiment or ''}".rstrip()
        saved = run.saved(key).get("run_id")
        if saved:
            try:
                found = self.client.get_run(saved)
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
            else:
                if found.info.lifecycle_stage == "active":
                    self.run_id = saved
                    self._note = found.data.tags.get("mlflow.note.content", "").splitlines()
                    self.client.update_run(saved, status="RUNNING")
        if self.run_id is None:
            created = self.client.create_run(self._experiment_id(experiment), run_name=self.run_name or run.name,
                                             tags={"raytrainer.run_dir": str(run.run_dir)})
            self.run_id = created.info.run_id
            run.remember(key, {"run_id": self.run_id})
            params = [Param(k, (v if isinstance(v, str) else json.dumps(v))[:6000])  # MLflow's limit
                      for k, v in _flatten(run.config)]
            for at in range(0, len(params), 100):  # MLflow's limit per batch
                self.client.log_batch(self.run_id, params=params[at:at + 100], synchronous=True)

    def _experiment_id(self, name: str | None) -> str:
        from mlflow.exceptions import MlflowException

        if not name:
            return os.environ.get("MLFLOW_EXPERIMENT_ID", "0")  # MLflow's Default experiment
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except MlflowException:  # created meanwhile by another run
            return self.client.get_experiment_by_name(name).experiment_id

    def write(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        ms = int(row.get("time", 0) * 1000)
        self._metrics.extend(Metric(k, v, ms, row["step"]) for k, v in _metrics(row))

    def event(self, record: dict[str, Any]) -> None:
        if record["event"] in _STATUS:
            self._status = _STATUS[record["event"]][0]
        if record["event"] not in _NOT_NOTED:
            self._note.append(_note_line(record))
            self._note_changed = True

    def flush(self) -> None:
        from mlflow.entities import RunTag

        metrics, self._metrics = self._metrics, []  # a failed batch is not retried: it is in metrics.jsonl
        tags = []
        if self._note_changed:
            self._note_changed = False
            note = "\n".join(self._note)
            tags = [RunTag("mlflow.note.content", note[-8000:])]  # MLflow's limit: keep the newest
        for at in range(0, max(len(metrics), len(tags)), 1000):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=metrics[at:at + 1000], tags=tags if at == 0 else [],
                                  synchronous=True)

    def artifact(self, path: Path, kind: str) -> None:
        if not _wanted(path, kind, self.log_checkpoints):
            return
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), f"checkpoints/{path.name}")
        else:
            self.client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        if self.run_id is not None:
            self.flush()
            self.client.set_terminated(self.run_id, self._status)


class WandbSink(Sink):
    """One W&B run per raytrainer run: the config as its config, every row logged with a
    `step` field that all metrics are plotted against (W&B's own step must grow, and a
    resumed run redoes the steps after its checkpoint), lifecycle events in the run's
    notes, model.pt (and with log_checkpoints every checkpoint) as artifacts. Its files go
    under $WANDB_DIR, else the run directory. A resumed run continues the same W&B run."""

    def __init__(self, project: str | None = None, entity: str | None = None, run_name: str | None = None,
                 mode: str | None = None, log_checkpoints: bool = False):
        self.project, self.entity, self.run_name, self.mode = project, entity, run_name, mode
        self.log_checkpoints = log_checkpoints
        self.run: Any = None
        self._notes: list[str] = []
        self._exit_code = 1  # until a finished event

    def open(self, run: RunInfo) -> None:
        import wandb

        key = f"wandb {self.entity or ''}/{self.project or os.environ.get('WANDB_PROJECT', '')}"
        saved = run.saved(key).get("id")
        kwargs: dict[str, Any] = {"id": saved, "resume": "allow"} if saved else {"config": run.config}
        self.run = wandb.init(project=self.project, entity=self.entity, name=self.run_name or run.name,
                              mode=self.mode, dir=None if os.environ.get("WANDB_DIR") else str(run.run_dir),
                              reinit="create_new",  # beside any run of the user's, untouched
                              settings=wandb.Settings(console="off"), **kwargs)  # the driver's output is its own
        if not saved:
            run.remember(key, {"id": self.run.id})
        self._notes = (self.run.notes or "").splitlines()
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, row: dict[str, Any]) -> None:
        self.run.log({**dict(_metrics(row)), "step": row["step"]})

    def event(self, record: dict[str, Any]) -> None:
        if record["event"] in _STATUS:
            self._exit_code = _STATUS[record["event"]][1]
        if record["event"] not in _NOT_NOTED:
            self._notes.append(_note_line(record))
            self.run.notes = "\n".join(self._notes)

    def artifact(self, path: Path, kind: str) -> None:
        import wandb

        if not _wanted(path, kind, self.log_checkpoints):
            return
        artifact = wandb.Artifact(f"{kind}-{self.run.id}", type=kind)
        if path.is_dir():
            artifact.add_dir(str(path))
        else:
            artifact.add_file(str(path))
        self.run.log_artifact(artifact, aliases=["latest", path.name])

    def close(self) -> None:
        if self.run is not None:
            self.run.finish(exit_code=self._exit_code)
