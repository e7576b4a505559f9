"""A step's metrics on their way through DDP's gradient all-reduce (Carrier), and the pause
and save requests folded into one number that rides with them (encode_flags).

The strategy owns the carrier (strategy.DDP's communication hook fills it); the loop's
metrics window (loop/window.py) sends and receives through it.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def encode_flags(pause: bool, save: bool, world_size: int) -> float:
    """A rank's requests as one number whose sum over the ranks keeps both: a pause counts
    1, a save world_size + 1 (more than every rank's pause together)."""
    return float(bool(pause)) + float(bool(save)) * (world_size + 1)


def decode_flags(mean: float, world_size: int) -> tuple[bool, bool]:
    """(some rank asked to pause, some rank asked to save) from the flags' mean over ranks."""
    total = round(mean * world_size)
    return total % (world_size + 1) > 0, total >= world_size + 1


class Carrier:
    """A step's metrics on their way through the gradient all-reduce (see strategy.DDP).

    The loop sets `outgoing` (this rank's metrics, then its pause flag) before the step's
    last backward; the strategy's communication hook sends them with the gradients and
    leaves their sums over ranks in `reduced`.

    Between the metrics and the flag, one column per rank for its compute time: `send`
    leaves them zero, and the hook writes this rank's own just before the last bucket's
    all-reduce (`stamp`), when every gradient is computed; so the time holds the step's
    data, forward and backward, and none of the last all-reduce's wait for slower peers."""

    def __init__(self, device: torch.device, group: Any = None):
        self.outgoing: torch.Tensor | None = None
        self.reduced: torch.Tensor | None = None
        self.device = device
        # DDP's process group, asked directly: torch.distributed.all_reduce's Python checks
        # and logging cost a tenth of a small model's step on a CPU.
        self.group = group
        self.scale = 1.0 / group.size() if group is not None else 1.0  # hookless DDP's 1 / world size
        # The flags, each made once: no host-to-device copy per step on a GPU.
        self._flags: dict[float, torch.Tensor] = {}
        self._times: dict[int, torch.Tensor] = {}  # zero time columns by world size, each made once
        self._slot, self._started = 0, None

    def send(self, values: torch.Tensor, pause_requested: bool, save_requested: bool = False,
             world_size: int = 1, rank: int = 0, started: float | None = None) -> None:
        """`started`: the step's start (time.perf_counter), for this rank's compute time."""
        flag = encode_flags(pause_requested, save_requested, world_size)
        if flag not in self._flags:
            self._flags[flag] = torch.full((1,), flag, device=self.device)
        if world_size not in self._times:
            self._times[world_size] = torch.zeros(world_size, device=self.device)
        self.outgoing = torch.cat([values, self._times[world_size], self._flags[flag]])
        self._slot = values.numel() + rank  # this rank's time column
        self._started = started
        self.reduced = None

    def stamp(self) -> None:
        """Write this rank's compute time so far into its column of `outgoing` (the hook calls
        it as the last bucket is ready). Earlier buckets' all-reduces run asynchronously
        (the backward does not wait for them), so only the compute is in the time."""
        if self._started is None or self.outgoing is None:
            return
        seconds = time.perf_counter() - self._started
        if self.outgoing.device.type == "cpu":
            self.outgoing.numpy()[self._slot] = seconds  # a plain store: a tensor's item assignment costs ~8 us
        else:
            self.outgoing[self._slot] = seconds

    def all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Sum `tensor` over the group in place; the future of [tensor]."""
        if tensor.is_complex():  # as torch.distributed.all_reduce does for it
            tensor = torch.view_as_real(tensor)
        return self.group.allreduce([tensor]).get_future()

    def receive(self) -> torch.Tensor:
        reduced, self.outgoing, self.reduced = self.reduced, None, None
        if reduced is None:
            raise RuntimeError("the step's gradient all-reduce did not carry its metrics: DDP's "
                               "communication hook never saw the last bucket")
        return reduced

    def clear(self) -> None:
        self.outgoing = self.reduced = None
