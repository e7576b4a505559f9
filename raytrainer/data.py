"""Deterministic sharding by global sample index.

Every epoch has one seeded permutation of the training set, the same on every
rank and at every world size. The data position is a sample offset into it: an
optimizer step starting at offset p consumes positions [p, p+G) (G = global
batch); rank r takes its contiguous 1/W of those and splits them into
micro-batches. So which samples form a step depends only on the seed, the epoch
and the offset, never on the worker count: a resume or a resize continues at the
same global sample index.

Epoch end: an epoch ends when the next global batch no longer fits in what is
left of it, and that rest is dropped (len(dataset) // G steps when G is fixed).
The permutation changes every epoch, so over epochs every sample is used. Under
the per_worker batch policy G changes with the world size: a resize that makes
the batch larger than what is left ends the epoch there.

Any world size up to G works, so an elastic run never meets one it cannot use:
where W does not divide G, the first G % W ranks take one sample more. Every rank
runs the same number of micro-batches (DDP syncs on the last one, on every rank),
so a micro-batch may hold one sample more than micro_batch_size, and the loop
weights each micro-batch's loss by its share of the global batch
(`loss_divisor`): the gradient is the global batch's mean whatever the split.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from .errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    dataset_size: int
    global_batch_size: int
    micro_batch_size: int
    world_size: int
    seed: int
    overfit_batches: int = 0
    """Debug: only the first N global batches, in the same order every epoch."""

    def __post_init__(self):
        if self.dataset_size < self.global_batch_size:
            raise ConfigError(
                f"the training dataset has {self.dataset_size} samples, fewer than one global "
                f"batch of {self.global_batch_size} (trainer.global_batch_size; under "
                "batch_policy per_worker, the per-worker batch times scaling.max_workers); "
                "lower the batch size or use more data"
            )
        if self.world_size > self.global_batch_size:
            raise ConfigError(
                f"{self.world_size} workers cannot share a global batch of {self.global_batch_size} "
                "samples (trainer.global_batch_size): each needs at least one; lower "
                "scaling.max_workers or raise the batch"
            )

    @property
    def accumulation(self) -> int:
        """Micro-batches per rank per optimizer step (the same on every rank)."""
        return max(1, -(-(self.global_batch_size // self.world_size) // self.micro_batch_size))

    @property
    def steps_per_epoch(self) -> int:
        return self.epoch_size // self.global_batch_size

    @property
    def epoch_size(self) -> int:
        """Samples an epoch hands out before its end: the dataset, or overfit_batches batches."""
        if self.overfit_batches:
            return min(self.dataset_size, self.overfit_batches * self.global_batch_size)
        return self.dataset_size

    def fits(self, position: int) -> bool:
        """Whether a global batch starting at sample offset `position` fits in the epoch."""
        return position + self.global_batch_size <= self.epoch_size

    def order(self, epoch: int) -> torch.Tensor:
        return _permutation(self.dataset_size, self.seed, 0 if self.overfit_batches else epoch)

    def shard(self, rank: int) -> tuple[int, int]:
        """(offset, count) of `rank`'s contiguous share of a global batch."""
        base, extra = divmod(self.global_batch_size, self.world_size)
        return rank * base + min(rank, extra), base + (rank < extra)

    def micro_batches(self, epoch: int, position: int, rank: int) -> list[torch.Tensor]:
        """Global sample indices of `rank`'s micro-batches for the optimizer step that
        starts at sample offset `position` of the epoch."""
        offset, count = self.shard(rank)
        start = position + offset
        return list(self.order(epoch)[start : start + count].tensor_split(self.accumulation))

    def micro_batch_sizes(self, rank: int) -> list[int]:
        """The sizes of `rank`'s micro-batches in every step (micro_batches' lengths)."""
        base, extra = divmod(self.shard(rank)[1], self.accumulation)
        return [base + (i < extra) for i in range(self.accumulation)]

    def loss_divisor(self, micro_batch: int) -> float:
        """What a micro-batch's mean loss is divided by so that DDP's average over ranks of
        the summed micro-batch gradients is the mean over the global batch: the global batch
        over (micro-batch size x world size), i.e. the accumulation count when every split
        is even (an exact integer then: the same arithmetic as a plain division by it)."""
        return self.global_batch_size / (micro_batch * self.world_size)


@lru_cache(maxsize=2)
def _permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=gen)


def val_shard(dataset_size: int, rank: int, world_size: int) -> torch.Tensor:
    """Every validation sample exactly once across ranks (shards may differ by one)."""
    return torch.arange(rank, dataset_size, world_size)


def fetch(dataset: Dataset, index: torch.Tensor, collate: Callable[[list[Any]], Any] = default_collate) -> Any:
    """Collate the samples at `index` (data.collate_fn); TensorDatasets are sliced in one go
    where the collate is the default (a task's own sees the samples as it would elsewhere)."""
    if isinstance(dataset, TensorDataset) and collate is default_collate:
        return tuple(t[index] for t in dataset.tensors)
    getitems = getattr(dataset, "__getitems__", None)
    items = getitems(index.tolist()) if getitems else [dataset[i] for i in index.tolist()]
    return collate(items)


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def batch_size_of(batch: Any) -> int:
    """Number of samples in a collated batch: the leading dim of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    values = batch.values() if isinstance(batch, dict) else batch
    for value in values:
        if isinstance(value, (torch.Tensor, dict, list, tuple)):
            return batch_size_of(value)
    raise ValueError("cannot tell the batch size: the batch holds no tensor")
