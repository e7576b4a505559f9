"""Per-step training metrics, reduced over ranks, and the pause agreement that rides along.

Each step's metrics stay on the device until a flush (every log_every_n_steps, before
validation, at the end), and `report` then receives one row per step. They are reduced
over ranks in one of two ways:
- carried: where the strategy has a Carrier (state/carrier.py: DDP on more than one rank), each step's
  metrics ride on the step's own gradient all-reduce (appended to its last bucket), so
  metrics cost no collective of their own; a flush only reports what is already reduced;
- by window: otherwise (one rank, FSDP), one all-reduce covers a whole window, started at
  one flush and collected at the next, so training never waits for it (rows reach the
  driver one window later).

Carried steps also hold each rank's compute time for the step (one column per rank, the
others' zero, so the sum is every rank's own time): the driver finds slow workers in them
(driver/stragglers.py) at no collective of its own.

Either way the reduction carries one more column: whether this rank was asked to pause
(for a resize), and whether it asks for a checkpoint (rank 0, when checkpoint.every_n_minutes
has passed on its clock), both in one number (encode_flags). What a flush collects is the
same on every rank (the same steps, the same sums), so all ranks agree to pause, or to save,
at the same step boundary with no extra message.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Any, Callable

import torch

from ...contract import COMPUTE_KEY
from ..dist import all_reduce_sum
from ..state.carrier import decode_flags, encode_flags

Report = Callable[[list[dict[str, Any]]], None]


RECENT_ROWS = 256
"""The rows a rank keeps for a new rank 0 to send again (a few seconds of training at the
driver's polls, at hundreds of steps a second)."""


class MetricsWindow:
    def __init__(self, sink: Report, waiting: Callable[[], contextlib.AbstractContextManager]):
        self.sink = sink  # where reduced rows go (rank 0: the driver; others: nowhere)
        # The newest rows reported, on every rank (reduced: the same on all) and in the state a
        # survivor gives: rank 0 may die holding rows the driver has not read yet, and after a
        # recovery the new rank 0 (a survivor, or a replacement that took a survivor's state)
        # sends them again (Loop.fit; the driver keeps the first row of each step). Your own
        # loop keeps its rows the same way (userloop.py).
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_ROWS)
        self._waiting = waiting  # marks the wait for peers (the driver's hang check)
        # (host fields, metrics on the device, their carried sums or None), a step each
        self._window: list[tuple[dict[str, Any], torch.Tensor | None, Any]] = []
        self._pending: list[tuple[Any, torch.Tensor, list]] = []  # windows being all-reduced
        self.latest: dict[str, float] = {}  # the newest reduced values (what keep_best ranks by)
        self.save_agreed = False  # some rank asked for a checkpoint in what a flush collected

    def add(self, info: dict[str, Any], values: torch.Tensor | None,
            carried: torch.Tensor | list[float] | None = None) -> None:
        """A step's row: its host-side fields and its metrics on the device. Either `values`
        is this rank's share, reduced at a flush; or `carried` holds the sums over ranks (the
        pause flags' last; on the device, or on the host where the step read them already)
        and `values` only the columns the same on every rank (the gradient norm of
        all-reduced gradients), or None."""
        self._window.append((info, values, carried))

    def flush(self, keys: list[str], world_size: int, *, pause_requested: bool, wait: bool = False,
              save_requested: bool = False) -> bool:
        """Start reducing the buffered steps, report those reduced since the last flush (all
        of them with `wait`); return whether some rank asked to pause in what was collected
        (and set `save_agreed` where some rank asked for a checkpoint)."""
        agreed = False
        ready = None
        if self._window:
            window, self._window = self._window, []
            if window[0][2] is not None:  # reduced already, in the steps' gradient all-reduce
                ready = window
            else:  # the pause flag as one more column
                values = torch.nn.functional.pad(torch.stack([v for _, v, _ in window]), (0, 1),
                                                 value=encode_flags(pause_requested, save_requested, world_size))
                self._pending.append((all_reduce_sum(values, async_op=True), values, window))
        # Each reduced window comes to the host in one copy (a sync on a GPU); the means
        # and the pause flags are read from that copy.
        while self._pending and (wait or ready is not None or len(self._pending) > 1):
            work, values, window = self._pending.pop(0)
            if work is not None:
                with self._waiting():
                    work.wait()
            means = [[v / world_size for v in sums] for sums in values.tolist()]
            pause, save = decode_flags(means[-1][-1], world_size)
            agreed |= pause
            self.save_agreed |= save
            self._report(keys, window, [m[:-1] for m in means])
        if ready is not None:
            pause, save = self._report_carried(keys, ready, world_size)
            agreed |= pause
            self.save_agreed |= save
        return agreed

    def _report_carried(self, keys: list[str], window: list, world_size: int) -> tuple[bool, bool]:
        """Report steps whose sums over ranks came with their gradients; return whether some
        rank asked to pause, and to save, in them."""
        means, pause, save = [], False, False
        times = []
        for _, same, sums in window:  # sums: on the host already where the step checked its loss
            sums = sums if isinstance(sums, list) else sums.tolist()
            m = [v / world_size for v in sums[:-1 - world_size]]
            asked = decode_flags(sums[-1] / world_size, world_size)
            pause, save = pause or asked[0], save or asked[1]
            means.append(m + (same.tolist() if same is not None else []))
            times.append(sums[-1 - world_size:-1])  # each rank's own: the others sent zero
        self._report(keys, window, means, times)
        return pause, save

    def _report(self, keys: list[str], window: list, means: list[list[float]],
                times: list[list[float]] | None = None) -> None:
        rows = [{**info, **dict(zip(keys, v))} for (info, _, _), v in zip(window, means)]
        for row, t in zip(rows, times or ()):
            row[COMPUTE_KEY] = [round(x, 6) for x in t]
        self.latest.update({k: v for k, v in rows[-1].items() if isinstance(v, float)})
        self.report(rows)

    def report(self, rows: list[dict[str, Any]]) -> None:
        """Rows to the sink, kept among the recent ones."""
        self.recent.extend(rows)
        self.sink(rows)

    def clear(self, keys: list[str], world_size: int) -> None:
        """Drop what a step abandoned half-way buffered (its peers never reduced it). The
        steps before it whose sums came with their gradients are whole: reported first (with
        log_every_n_steps above 1 they wait for a flush), their asks to pause or save
        dropped (the group re-forms; a pause is asked again, a save falls due again)."""
        window, self._window, self._pending = self._window, [], []
        if window and window[0][2] is not None:
            self._report_carried(keys, window, world_size)
        self.save_agreed = False
