"""The run section and the loggers: where a run lives, what it is called, where it reports."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from .. import filesystems
from ..errors import ConfigError
from .task import Component

if TYPE_CHECKING:
    from . import Config


@dataclass(kw_only=True)
class RunConfig:
    name: str | None = None
    """Run directory name under storage; default: <task module>-<UTC timestamp>."""
    storage: str = "runs"
    """Where run directories live: a local path, or a URI of a filesystem pyarrow or fsspec
    opens (file://, s3://, gs://, abfs://, hdfs://, az:// with adlfs, ...; see filesystems.py)."""
    resume: str = "auto"
    """auto: continue from the newest committed checkpoint of this run directory, if any;
    never: always start fresh (an existing run directory is an error); or a checkpoint
    directory to start from."""
    cwd: str | None = field(default=None, repr=False, metadata={"internal": True})
    """Not a config key: the directory the run was started from (resolve_paths), where the
    workers work when it exists on their node."""

    def __post_init__(self):
        if self.name is not None and (not self.name or "/" in self.name or self.name in (".", "..")):
            raise ConfigError(f"run.name={self.name!r} must be a plain directory name")
        filesystems.check("run.storage", self.storage)
        if self.resume not in ("auto", "never"):
            filesystems.check("run.resume", self.resume)


def resolve_paths(config: Config, cwd: str) -> None:
    """The config's relative local paths (run.storage, a run.resume path) made absolute against
    `cwd`, the directory the user ran from, on the driver before any worker sees them: a
    worker's own working directory is its Ray's (a kept local Ray started from elsewhere, a
    cluster's), and the run directory is one place, the one the run prints. URIs stay."""
    def absolute(path: str) -> str:
        return path if "://" in path else os.path.normpath(os.path.join(cwd, os.path.expanduser(path)))

    config.run.cwd = cwd
    config.run.storage = absolute(config.run.storage)
    if config.run.resume not in ("auto", "never"):
        config.run.resume = absolute(config.run.resume)


LOGGER_KEYS = {
    "tensorboard": ("type", "close_timeout_s"),
    "mlflow": ("type", "tracking_uri", "experiment", "run_name", "log_checkpoints", "close_timeout_s"),
    "wandb": ("type", "project", "entity", "run_name", "mode", "log_checkpoints", "close_timeout_s"),
    None: ("target", "args", "close_timeout_s"),  # a user's own sink
}


@dataclass(kw_only=True)
class LoggerConfig:
    """An experiment tracker the driver sends the run to (metric rows, the config, lifecycle
    events, model.pt): a built-in `type`, or a user's own sink class (`target`, `args`).
    Each runs on its own thread, so a slow or failed one never holds training up."""

    IN_LISTS: ClassVar[bool] = True  # loggers: a list (schema.build)

    type: Literal["tensorboard", "mlflow", "wandb"] | None = None
    target: str | None = None
    """A user's sink, `package.module:ClassName` (see raytrainer.Sink), built with `args`."""
    args: dict[str, Any] = field(default_factory=dict)
    tracking_uri: str | None = None
    """mlflow: the tracking server (or store) URI; default $MLFLOW_TRACKING_URI, else MLflow's."""
    experiment: str | None = None
    """mlflow: experiment name, created if missing; default $MLFLOW_EXPERIMENT_NAME, else
    MLflow's Default experiment."""
    project: str | None = None
    """wandb: default $WANDB_PROJECT, else W&B's."""
    entity: str | None = None
    """wandb: user or team; default W&B's."""
    mode: Literal["online", "offline"] | None = None
    """wandb: default $WANDB_MODE, else online. Offline runs are uploaded by `wandb sync`."""
    run_name: str | None = None
    """mlflow, wandb: the tracker's run name; default run.name."""
    log_checkpoints: bool = False
    """mlflow, wandb: upload every committed checkpoint too (model.pt always is)."""
    close_timeout_s: float = 60.0
    """How long the end of the run waits for this logger to send what it has left."""

    def __post_init__(self):
        if (self.type is None) == (self.target is None):
            raise ConfigError(
                "type/target: give exactly one: type (one of 'tensorboard', 'mlflow', 'wandb') "
                "or target (your own sink, 'package.module:ClassName')"
            )
        if self.target is not None:
            Component(target=self.target)  # the same import-path check as callbacks
        allowed = LOGGER_KEYS[self.type]
        for f in dataclasses.fields(self):
            given = getattr(self, f.name) != (f.default_factory() if f.default_factory is not dataclasses.MISSING
                                              else f.default)
            if given and f.name not in allowed:
                kind = f"type {self.type!r}" if self.type else "a target sink"
                raise ConfigError(f"{f.name} does not apply to {kind}; its keys: {', '.join(allowed)}")
        if self.close_timeout_s <= 0:
            raise ConfigError(f"close_timeout_s={self.close_timeout_s} must be > 0")
