"""Callbacks at lifecycle boundaries only: never inside a step or a micro-step.

Subclass `Callback`, override the hooks you need, and list the class in the
config's `callbacks:` section. A callback runs on every worker, where `ctx` is
the rank's Loop (rank, world_size, step, epoch, module, optimizer, ...), or,
when its class sets `on_driver = True`, once on the driver, where `ctx` is a
`RunContext` (run_dir, config, step, epoch, metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import Component
from .errors import ConfigError
from .task import import_object

HOOKS = ("on_run_start", "on_epoch_start", "on_epoch_end", "on_validation_end",
         "on_checkpoint", "on_run_end", "on_metrics")


class Callback:
    on_driver: bool = False

    def on_run_start(self, ctx) -> None: ...
    def on_epoch_start(self, ctx) -> None: ...
    def on_epoch_end(self, ctx) -> None: ...
    def on_validation_end(self, ctx, metrics: dict[str, float]) -> None: ...
    def on_checkpoint(self, ctx, path: str) -> None: ...
    def on_run_end(self, ctx) -> None: ...
    def on_metrics(self, ctx, row: dict[str, Any]) -> None:
        """Driver only: every metric row, as metrics.jsonl gets it (training and validation)."""


@dataclass
class RunContext:
    """What a driver-side callback sees."""

    run_dir: Path
    config: Any
    step: int = 0
    epoch: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)


class Callbacks:
    def __init__(self, callbacks: list[Any]):
        self.callbacks = callbacks

    @classmethod
    def build(cls, components: list[Component], *, on_driver: bool) -> Callbacks:
        built = []
        for i, comp in enumerate(components):
            klass = import_object(comp.target, f"callbacks[{i}].target")
            if getattr(klass, "on_driver", False) == on_driver:
                try:
                    built.append(klass(**comp.args))
                except TypeError as exc:
                    raise ConfigError(f"callbacks[{i}].args do not fit {comp.target!r}: {exc}") from None
        return cls(built)

    def __call__(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            method = getattr(cb, hook, None)
            if method is not None:
                method(*args)
