"""The task section: what to train (a Task class or your own loop), and the import paths it names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import ConfigError
from .taskargs import annotations_from_source, typed_args


@dataclass(kw_only=True)
class Component:
    """A class named by import path and the keyword arguments to build it with."""

    IN_LISTS: ClassVar[bool] = True  # callbacks: a list (schema.build)

    target: str
    """Import path of the class, `package.module:ClassName`."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments the class is constructed with (on every worker, for a task)."""

    def __post_init__(self):
        module, sep, name = self.target.partition(":")
        if not (module and sep and name):
            raise ConfigError(
                f"target={self.target!r} is not an import path; "
                "write it as 'package.module:ClassName', e.g. 'examples.digits:DigitsTask'"
            )


@dataclass(kw_only=True)
class TaskConfig:
    """What to train: a Task class (`target`) or your own loop function (`loop`), named by
    import path and built on every worker with `args`; or either passed as a Python object
    to raytrainer.train / raytrainer.train_loop, which ships it to the workers by value."""

    target: str | None = None
    """A raytrainer.Task subclass, `package.module:ClassName`."""
    loop: str | None = None
    """Your own training loop instead of a Task: a function `fn(ctx, **args)` run on every
    worker, `package.module:function` (see raytrainer.train_loop)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments the class (or the loop function) is called with, on every worker."""
    by_value: str | None = None
    """Written by raytrainer, never by hand: the task or loop was passed as a Python object
    and shipped to the workers pickled (cloudpickle); this says what it was. A YAML file
    cannot carry the object, so such a config.yaml is a record: resume that run from
    Python, passing the same object again."""
    payload: Any = field(default=None, repr=False, metadata={"internal": True})
    """Not a config key: the object passed by value, pickled (bytes), or on the driver the
    reference to those bytes in Ray's object store, which every worker's constructor gets."""

    def __post_init__(self):
        if (self.target is None) == (self.loop is None):
            raise ConfigError(
                "task: give exactly one of target (a raytrainer.Task class, 'package.module:ClassName') "
                "or loop (your own loop function fn(ctx), 'package.module:function')"
            )
        key = "target" if self.loop is None else "loop"
        module, sep, name = getattr(self, key).partition(":")
        if not (module and sep and name):
            raise ConfigError(
                f"task.{key}={getattr(self, key)!r} is not an import path; write it as "
                f"'package.module:{'ClassName' if key == 'target' else 'function'}', e.g. "
                f"'{'examples.digits:DigitsTask' if key == 'target' else 'examples.hf_trainer:train_func'}'"
            )
        if self.by_value is None:  # by value: the driver checks with the object (driver/api.py)
            self.args = typed_args(self.args, annotations_from_source(self.path, self.is_loop), self.annotated)

    @property
    def is_loop(self) -> bool:
        return self.loop is not None

    @property
    def annotated(self) -> str:
        """What task.args are checked against, as errors name it."""
        return self.path if self.is_loop else f"{self.path}.__init__"

    @property
    def path(self) -> str:
        """Its import path (the class's or the function's)."""
        return self.loop if self.loop is not None else self.target
