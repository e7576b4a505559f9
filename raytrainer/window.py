"""Per-step training metrics, reduced over ranks a window of steps at a time, and the
pause agreement that rides along.

Each step's metrics stay on the device until a flush (every log_every_n_steps, before
validation, at the end): one all-reduce then covers a whole window, and `report`
receives one row per step. A window's all-reduce is started at one flush and collected
at the next, so training never waits for it (rows reach the driver one window later).

The reduction carries one more column: whether this rank was asked to pause (for a
resize). When a reduction is collected, at the same step on every rank, all ranks see
the same sum, so they agree to pause at the same step boundary with no extra message.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from .dist import all_reduce_sum

Report = Callable[[list[dict[str, Any]]], None]


class MetricsWindow:
    def __init__(self, report: Report, waiting: Callable[[], contextlib.AbstractContextManager]):
        self.report = report  # where reduced rows go (rank 0: the driver; others: nowhere)
        self._waiting = waiting  # marks the wait for peers (the driver's hang check)
        self._window: list[tuple[dict[str, Any], torch.Tensor]] = []  # (host fields, metrics on device)
        self._pending: list[tuple[Any, torch.Tensor, list]] = []  # windows being all-reduced
        self.latest: dict[str, float] = {}  # the newest reduced values (what keep_best ranks by)

    def add(self, info: dict[str, Any], values: torch.Tensor) -> None:
        """A step's row: its host-side fields and its metrics (this rank's share) on the device."""
        self._window.append((info, values))

    def flush(self, keys: list[str], world_size: int, *, pause_requested: bool, wait: bool = False) -> bool:
        """Start reducing the buffered steps, report those reduced since the last flush (all
        of them with `wait`); return whether some rank asked to pause in what was collected."""
        agreed = False
        if self._window:
            window, self._window = self._window, []
            values = torch.stack([v for _, v in window])
            flag = torch.full((len(window), 1), float(pause_requested), device=values.device)
            values = torch.cat([values, flag], dim=1)
            self._pending.append((all_reduce_sum(values, async_op=True), values, window))
        while self._pending and (wait or len(self._pending) > 1):
            work, values, window = self._pending.pop(0)
            if work is not None:
                with self._waiting():
                    work.wait()
            agreed |= bool(values[-1, -1] > 0)
            means = (values[:, :-1] / world_size).tolist()
            rows = [{**info, **dict(zip(keys, v))} for (info, _), v in zip(window, means)]
            self.latest.update({k: v for k, v in rows[-1].items() if isinstance(v, float)})
            self.report(rows)
        return agreed

    def clear(self) -> None:
        """Drop what a step abandoned half-way buffered (its peers never reduced it)."""
        self._window, self._pending = [], []
