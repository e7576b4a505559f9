"""The training state of one rank: model, optimizer, scheduler, gradient scaler and EMA.

Built the same way on every rank and at every world size (the same seed: identical
initial weights), saved and loaded as one state dict (the strategy says what the model
and optimizer parts hold: everything, or this rank's shards), and able to undo what a
step interrupted half-way changed, so that a survivor's state is exactly the state
after its last completed step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ...config import TrainerConfig
from ...errors import ConfigError
from .. import _internals
from .strategy import Strategy
from ...task import Task


@dataclass
class TrainState:
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    strategy: Strategy
    scaler: torch.amp.GradScaler | None = None
    ema: Any = None  # the strategy's: AveragedModel (replicated), sharded.ShardedEMA
    scheduler: Any = None  # set once the run's length is known
    _buffers: list[torch.Tensor] = field(default_factory=list)  # at the start of the step under way

    @classmethod
    def build(cls, task: Task, cfg: TrainerConfig, strategy: Strategy, device: torch.device) -> TrainState:
        torch.manual_seed(cfg.seed)
        module = strategy.prepare(task.build_model(), device)
        optimizer = task.build_optimizer(module)
        ema = strategy.build_ema(module, cfg.ema_decay) if cfg.ema_decay else None
        scaler = strategy.grad_scaler(device) if cfg.precision == "fp16" else None
        return cls(module, optimizer, strategy, scaler, ema)

    @contextlib.contextmanager
    def averaged(self) -> Iterator[torch.nn.Module]:
        """The module with the weights to validate and export: the EMA's when on (a
        sharded EMA is swapped into the model for the block)."""
        if self.ema is None:
            yield self.module
        elif hasattr(self.ema, "swapped_in"):
            with self.ema.swapped_in(self.module) as module:
                yield module
        else:
            yield self.ema.module

    def update_ema(self) -> None:
        if self.ema is not None:
            self.ema.update_parameters(self.module)

    def state_dict(self) -> dict[str, Any]:
        model, optim = self.strategy.model_state(self.module, self.optimizer)
        return {
            "model": model,
            "optimizer": optim,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "ema": self.ema.state_dict() if self.ema is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("scheduler", "scaler", "ema"):
            target = getattr(self, name)
            if (target is None) != (state[name] is None):
                raise ConfigError(f"the checkpoint {'has' if state[name] is not None else 'lacks'} "
                                  f"{name} state but this run {'does not use' if target is None else 'uses'} "
                                  "one; resume with the config the checkpoint was trained with")
        self.strategy.load_model_state(self.module, self.optimizer, state["model"], state["optimizer"])
        for name in ("scheduler", "scaler", "ema"):
            target = getattr(self, name)
            if target is not None:
                target.load_state_dict(state[name])

    def begin_step(self) -> None:
        """Remember what a step changes besides the weights it applies at its end: the
        buffers (BatchNorm running statistics change in every forward)."""
        self._buffers = [b.detach().clone() for b in self.module.buffers()]

    def abandon_step(self) -> None:
        """Undo a step interrupted half-way: gradients, buffers, the scaler's unscale."""
        self.optimizer.zero_grad(set_to_none=True)
        if self._buffers:
            with torch.no_grad():
                for buffer, saved in zip(self.module.buffers(), self._buffers):
                    buffer.copy_(saved)
        if self.scaler is not None:  # an unscale_ without its step would be remembered
            fresh = type(self.scaler)(_internals.grad_scaler_device(self.scaler))
            fresh.load_state_dict(self.scaler.state_dict())
            self.scaler = fresh
        self.module.train()


@dataclass
class Prebuilt:
    """A Task's training state built ahead (process/warm.py): the task, and the training
    state built from it at `most_world_size` (whether BatchNorm is converted for a group
    depends on it), of `nbytes` (weights and optimizer state)."""

    task: Any
    train: TrainState
    most_world_size: int
    nbytes: int


def train_state(prebuilt: Prebuilt | None, task: Any, cfg: Any, strategy: Any, device: Any,
                most_world_size: int) -> TrainState:
    """A loop's training state: `prebuilt`'s, where it was built for this run's largest
    world size (process/warm.py's adopt chose it), else built now."""
    if prebuilt is not None and prebuilt.most_world_size == most_world_size:
        prebuilt.train.strategy = strategy
        return prebuilt.train
    return TrainState.build(task, cfg, strategy, device)
