"""The user contract: what a task defines, and how workers build one.

A task says what to train; the library does the rest (DDP wrapping, sharding,
accumulation, reduction, checkpoints). Configs name the task by import path and
every worker constructs it itself, so nothing large is pickled from the driver.

    class MyTask(raytrainer.Task):
        def __init__(self, hidden=64): ...
        def build_model(self): ...
        def build_optimizer(self, model): ...
        def train_dataset(self): ...
        def train_step(self, model, batch): return {"loss": ...}
"""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, TaskError

if TYPE_CHECKING:  # the driver never needs torch; only workers import it
    import torch


class Task:
    """Base class for tasks. Override the methods marked 'required'."""

    def build_model(self) -> torch.nn.Module:
        """Required. The model, on CPU; the library moves and wraps it."""
        raise NotImplementedError

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """Required. An optimizer over `model.parameters()`."""
        raise NotImplementedError

    def build_scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int):
        """Optional. An LR scheduler stepped once per optimizer step; `total_steps`
        is the number of optimizer steps the run will take."""
        return None

    def train_dataset(self) -> torch.utils.data.Dataset:
        """Required. A map-style dataset; items are tensors or tuples/dicts of tensors."""
        raise NotImplementedError

    def val_dataset(self) -> torch.utils.data.Dataset | None:
        """Optional. Validated every `trainer.val_every_n_steps` and at each epoch end."""
        return None

    def train_step(self, model: torch.nn.Module, batch: Any) -> dict[str, Any]:
        """Required. Forward one micro-batch; return metrics with a scalar tensor 'loss'
        (the library calls backward on it). Other values are logged, averaged over ranks."""
        raise NotImplementedError

    def val_step(self, model: torch.nn.Module, batch: Any) -> dict[str, Any]:
        """Optional. Metrics of one validation batch (run under no_grad), averaged over
        all validation samples; logged with a 'val_' prefix. Default: train_step's."""
        return self.train_step(model, batch)


    # Optional, for trainer.strategy=fsdp only: define
    #
    #     def shard(self, model, mesh): ...
    #
    # to shard the model yourself: apply torch.distributed.fsdp.fully_shard(unit, mesh=mesh)
    # to each unit, then to the model, and return it (or None). It replaces trainer.fsdp.


REQUIRED = ("build_model", "build_optimizer", "train_dataset", "train_step")


def import_object(target: str, key: str = "task.target") -> Any:
    """The object at `package.module:Name`; `key` names the config setting in errors."""
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{key}={target!r}: module {module_name!r} does not import ({exc}); "
            "check the path and that it is importable from the directory you launch in"
        ) from exc
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ConfigError(f"{key}={target!r}: module {module_name!r} has no {attr!r}") from None
    return obj


def build_task(target: str, args: dict[str, Any]) -> Task:
    cls = import_object(target)
    if not callable(cls):
        raise ConfigError(f"task.target={target!r} is not a class")
    missing = [
        m for m in REQUIRED
        if not callable(getattr(cls, m, None)) or getattr(cls, m) is getattr(Task, m)
    ]
    if missing:
        raise TaskError(f"task {target!r} must define {', '.join(missing)} (see raytrainer.Task)")
    try:
        inspect.signature(cls).bind(**args)
    except TypeError as exc:
        raise ConfigError(f"task.args do not fit {target!r}: {exc}") from None
    return cls(**args)
