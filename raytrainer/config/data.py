"""The data section: how the Task loop reads its datasets."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from . import source


@dataclass(kw_only=True)
class DataConfig:
    """How each rank reads its training and validation micro-batches (see raytrainer/worker/input/input.py).
    Loader processes only fetch what the sample order (data.BatchPlan) names, so the order,
    resume, recovery and resizes are the same with or without them."""

    num_workers: int = 0
    """Loader processes per rank. 0: each micro-batch is read in the training thread when
    the step needs it (no prefetch)."""
    prefetch_factor: int = 2
    """Micro-batches each loader process prepares ahead (with num_workers > 0)."""
    pin_memory: bool = False
    """Put batches in page-locked memory for faster copies to the GPU (GPU workers only;
    ignored on CPU)."""
    persistent_workers: bool = False
    """Keep the loader processes between validations and across re-positioning (a recovery,
    a resize), instead of starting new ones (map-style datasets; streams always restart)."""
    collate_fn: str | None = None
    """What makes a micro-batch of the samples read (in the loader processes where there are
    some): the name of a method of your Task (`collate`, called as task.collate(samples)), or
    an import path `package.module:function`, called with the list of samples. None: torch's
    default_collate (a TensorDataset is sliced in one go). For samples that default_collate
    cannot stack, e.g. variable-length sequences to pad."""

    def __post_init__(self):
        if self.num_workers < 0:
            raise ConfigError(f"data.num_workers={self.num_workers} must be >= 0 (0: no loader processes)")
        if self.prefetch_factor < 1:
            raise ConfigError(f"data.prefetch_factor={self.prefetch_factor} must be >= 1")
        if self.collate_fn is not None:
            _check_collate(self.collate_fn)


def _check_collate(name: str) -> None:
    """What can be told before a worker imports it (config/source.py): a method name is a
    name; an import path names a module that exists and defines the function."""
    key = f"data.collate_fn={name!r}"
    if ":" not in name:
        if not name.isidentifier():
            raise ConfigError(f"{key} is neither a method name of your Task (e.g. 'collate') nor an import path "
                              "('package.module:function')")
        return
    module, _, function = name.partition(":")
    if not (module and function):
        raise ConfigError(f"{key} is not an import path; write it as 'package.module:function'")
    if source.module_found(module) is False:
        raise ConfigError(f"{key}: module {module!r} does not import (not found on sys.path); check the path and "
                          "that it is importable from the directory you launch in, or name a method of your Task")
    if source.defines(name) is False:
        raise ConfigError(f"{key}: module {module!r} defines no {function!r}; check the name")
