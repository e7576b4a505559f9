"""Typed run configuration: YAML in, validated dataclasses out.

Each section is a small kw_only dataclass that checks its own values in
__post_init__; `Config.validate` checks what spans sections. Unknown keys and
wrong types are errors that name the key and what is allowed, because a typo
in a config silently ignored costs a whole training run.

One module a section (task.py, trainer.py, scaling.py, checkpoint.py, failure.py,
data.py, run.py: the run and the loggers); schema.py checks YAML values against the
sections' annotations; this module has the whole Config, its cross-section checks, and
loading with --set overrides.
"""

from __future__ import annotations

import dataclasses
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from .checkpoint import CheckpointConfig, KeepBestConfig
from .data import DataConfig
from .failure import ChaosFault, FailureConfig
from .run import LOGGER_KEYS, LoggerConfig, RunConfig, resolve_paths
from .scaling import ScalingConfig
from .schema import build, copy_tree, to_dict, yaml_key
from .task import Component, TaskConfig
from .trainer import CompileConfig, EarlyStoppingConfig, FSDPConfig, LRScheduleConfig, TrainerConfig, ValidationConfig

__all__ = ["CheckpointConfig", "ChaosFault", "Component", "Config", "DataConfig", "EarlyStoppingConfig",
           "CompileConfig", "FSDPConfig", "FailureConfig", "KeepBestConfig", "LOGGER_KEYS", "LRScheduleConfig", "LoggerConfig",
           "RunConfig", "ScalingConfig", "TaskConfig", "TrainerConfig", "ValidationConfig", "apply_overrides",
           "dump_config", "load_config", "resolve_paths"]


@dataclass(kw_only=True)
class Config:
    task: TaskConfig
    trainer: TrainerConfig | None = None
    """Required with a Task; your own loop (task.loop) may leave it out."""
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)
    data: DataConfig = field(default_factory=DataConfig)
    callbacks: list[Component] = field(default_factory=list)
    """raytrainer.Callback classes; each runs on every worker, or on the driver when its
    class sets on_driver = True."""
    loggers: list[LoggerConfig] = field(default_factory=lambda: [LoggerConfig(type="tensorboard")])
    """Where the driver sends the run besides metrics.jsonl: TensorBoard, MLflow, W&B, or
    a user's sink. [] for none."""

    def __post_init__(self):
        if self.trainer is None:
            if not self.task.is_loop:
                raise ConfigError("missing required key 'trainer'")
            self.trainer = TrainerConfig()
        self.scaling.settle(global_batch_fixed=self.trainer.batch_policy == "fixed_global" and not self.task.is_loop)
        if self.task.is_loop:
            _check_loop_config(self)
        elif self.trainer.max_epochs is None and self.trainer.max_steps is None:
            raise ConfigError("set trainer.max_epochs or trainer.max_steps (or both)")
        batch, workers = self.trainer.global_batch_size, self.scaling.max_workers
        if self.trainer.batch_policy == "per_worker" and batch % self.scaling.num_workers:
            raise ConfigError(
                f"trainer.batch_policy=per_worker keeps each worker's batch, "
                f"trainer.global_batch_size / scaling.num_workers, but {batch} does not split "
                f"evenly over {self.scaling.num_workers} workers; make the batch a multiple of "
                "num_workers"
            )
        if workers > batch and self.trainer.batch_policy == "fixed_global":
            raise ConfigError(
                f"up to {workers} workers (scaling.max_workers, default num_workers) cannot share "
                f"trainer.global_batch_size={batch}: each needs at least one sample; raise the "
                "batch or lower the worker count"
            )
        for fault in self.failure.chaos:
            if fault.rank is not None and fault.rank >= workers:
                raise ConfigError(
                    f"failure.chaos ({fault.action}): rank={fault.rank} but there are at most "
                    f"{workers} workers (scaling.max_workers, default num_workers); use a rank "
                    f"below {workers} or null for a random one"
                )

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


# What a run of your own loop (task.loop) takes from the config: the loop does its own
# steps, so the keys that configure the Task loop's step do not apply; a key set anyway is
# an error, never silently ignored. The rest (scaling, failure, checkpoint retention, run,
# loggers, driver callbacks) works as for a Task.
LOOP_TRAINER_KEYS = ("max_epochs", "max_steps", "global_batch_size", "seed", "strategy", "fsdp", "sync_batchnorm",
                     "validation")
LOOP_VALIDATION_KEYS = ("resources",)
"""What ctx.report(validate=fn) takes of trainer.validation: the Ray task's resources."""


def _check_loop_config(config: Config) -> None:
    """Keys that a run of your own loop cannot honour, with what to do instead."""
    for section, allowed, instead in (
        (config.trainer, LOOP_TRAINER_KEYS, "do it in your loop (e.g. torch.autocast, "
         "clip_grad_norm_, your scheduler), or write a raytrainer.Task"),
        (config.data, (), "build your DataLoader in your loop (ctx.sampler gives its sample order)"),
    ):
        name = "trainer" if section is config.trainer else "data"
        default = type(section)()
        for f in dataclasses.fields(section):
            if f.name not in allowed and getattr(section, f.name) != getattr(default, f.name):
                raise ConfigError(
                    f"{name}.{yaml_key(f)} applies to a Task's loop, not to your own (task.loop); "
                    f"remove it and {instead}. A loop takes trainer.{', trainer.'.join(allowed)}"
                    if name == "trainer" else
                    f"{name}.{yaml_key(f)} applies to a Task's loop, not to your own (task.loop); {instead}"
                )
    _check_loop_validation(config.trainer.validation)
    if config.failure.chaos:
        raise ConfigError("failure.chaos injects faults at a Task loop's steps; your own loop (task.loop) has "
                          "none to act at: remove failure.chaos and kill a worker from outside instead")


def _check_loop_validation(validation: ValidationConfig) -> None:
    default = type(validation)()
    for f in dataclasses.fields(validation):
        if f.name not in LOOP_VALIDATION_KEYS and getattr(validation, f.name) != getattr(default, f.name):
            raise ConfigError(f"trainer.validation.{yaml_key(f)} applies to a Task's loop, not to your own "
                              "(task.loop), which validates when it asks, ctx.report(state=..., validate=fn): remove it; a loop "
                              "takes trainer.validation.resources (what fn's Ray task asks)")


def apply_overrides(raw: dict[str, Any], overrides: typing.Iterable[str]) -> dict[str, Any]:
    """Apply `section.key=value` strings (values parsed as YAML) to a raw config dict."""
    overrides = list(overrides)
    _num_workers_sets_the_size(raw, overrides)
    _one_val_every(raw, overrides)
    for item in overrides:
        path, sep, text = item.partition("=")
        if not sep or not path.strip():
            raise ConfigError(f"--set {item!r}: write overrides as section.key=value")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML ({exc})") from None
        node = raw
        parts = path.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: '{part}' is not a section")
            node = child
        node[parts[-1]] = value
    return raw


def _one_val_every(raw: dict[str, Any], overrides: list[str]) -> None:
    """A run's config.yaml holds trainer.val_every_n_steps and trainer.validation.every_n_steps
    alike (one setting, two names): `--set` of either replaces both."""
    keys = {item.partition("=")[0].strip() for item in overrides}
    trainer = raw.get("trainer")
    if not isinstance(trainer, dict):
        return
    validation = trainer.get("validation")
    if "trainer.val_every_n_steps" in keys and isinstance(validation, dict):
        validation.pop("every_n_steps", None)
    if "trainer.validation.every_n_steps" in keys:
        trainer.pop("val_every_n_steps", None)


def _num_workers_sets_the_size(raw: dict[str, Any], overrides: list[str]) -> None:
    """`--set scaling.num_workers=N` alone makes a fixed-size config N workers: its
    min_workers and max_workers follow, as they would had they been left out. A run's
    config.yaml holds them resolved from its num_workers (`raytrainer resume RUN --set
    scaling.num_workers=1` of a 2-worker run trained on 2, silently). An elastic config
    (bounds other than its num_workers) says nothing that N could replace: an error."""
    keys = {item.partition("=")[0].strip() for item in overrides}
    if "scaling.num_workers" not in keys or keys & {"scaling.min_workers", "scaling.max_workers"}:
        return
    scaling = raw.get("scaling")
    if not isinstance(scaling, dict):
        return
    size = scaling.get("num_workers", 1)
    bounds = {k: scaling[k] for k in ("min_workers", "max_workers") if scaling.get(k) is not None}
    # The defaults a run's config.yaml holds resolved: max_workers its size, min_workers 1 or it.
    if bounds.get("max_workers", size) != size or bounds.get("min_workers", size) not in (1, size):
        raise ConfigError(
            "--set scaling.num_workers does not resize this config: it is elastic ("
            + ", ".join(f"scaling.{k}={v}" for k, v in bounds.items())
            + "); set scaling.min_workers and scaling.max_workers instead")
    for key in bounds:
        del scaling[key]


def load_config(source: str | Path | dict[str, Any], overrides: typing.Iterable[str] = ()) -> Config:
    """Build a validated Config from a YAML path or a dict, then apply --set overrides."""
    if isinstance(source, dict):
        raw = copy_tree(source)
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return build(Config, apply_overrides(_renamed(raw), overrides), "")


def _renamed(raw: dict[str, Any]) -> dict[str, Any]:
    """Keys an earlier raytrainer wrote, read as their new names, so that its run
    directories (config.yaml) still resume: failure.warm_spare (true/false) is now
    failure.warm_spares (a count)."""
    failure = raw.get("failure")
    if isinstance(failure, dict) and isinstance(failure.get("warm_spare"), bool):
        if "warm_spares" in failure:
            raise ConfigError("failure.warm_spare and failure.warm_spares are both set: "
                              "keep warm_spares (a count), the newer name")
        old = failure.pop("warm_spare")
        failure["warm_spares"] = int(old)
        warnings.warn(f"failure.warm_spare: {str(old).lower()} is now failure.warm_spares: "
                      f"{int(old)} (a count of spares); read as such", FutureWarning, stacklevel=3)
    return raw


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)

