"""What the actor's control calls answer, on their own concurrency group while `run` trains
or is blocked in a collective: the progress the driver's hang check reads, every thread's
stack and a SIGKILL for a worker judged hung, and the rows and events the driver drains.

None of it waits for the training thread: status reads what that thread last wrote and where
its stack is now, and the outbox is shared under a lock with the training thread and the
checkpoint writer thread that fill it.
"""

from __future__ import annotations

import sys
import threading
import traceback
from typing import TYPE_CHECKING, Any

from ...contract import Status
from ..pids import running

if TYPE_CHECKING:
    from .forming import Forming


def status(loop: Any, forming: Forming, run_thread: int | None) -> Status:
    """Worker.status, of the worker's loop (None before its first setup), where it stands
    in forming a group, and its training thread (None while it does not train): the phase
    is "collective" where the loop waits for its peers, or where the training thread is
    anywhere inside torch.distributed."""
    busy = forming.busy_s()
    if loop is None:
        return Status(0, 0, "setup", forming=forming.phase, busy_s=busy)
    phase = loop.phase
    if phase != "collective" and _in_collective(sys._current_frames().get(run_thread)):
        phase = "collective"
    return Status(loop.step, loop.progress, phase, loop.after_pending, forming=forming.phase, busy_s=busy)


def _in_collective(frame: Any) -> bool:
    """Whether a thread's stack (its innermost frame) is inside torch.distributed or
    DDP's own communication."""
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/torch/distributed/" in path or path.endswith("/torch/nn/parallel/distributed.py"):
            return True
        frame = frame.f_back
    return False


def stacks() -> str:
    """Every thread's Python stack."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"Thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def kill(pid: int) -> bool:
    """SIGKILL `pid`, gone already or not; whether it was still running (frozen, say) as it
    was killed."""
    import os
    import signal

    there = running(pid)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return there


class Outbox:
    """Rank 0's metric rows and this worker's lifecycle events, until the driver drains them."""

    def __init__(self):
        self._rows: list[dict[str, Any]] = []
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def push(self, rows: list[dict[str, Any]]) -> None:
        with self._lock:
            self._rows.extend(rows)

    def notify(self, event: dict[str, Any]) -> None:
        with self._lock:  # also called from the checkpoint writer thread
            self._events.append(event)

    def drain(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        with self._lock:
            rows, self._rows = self._rows, []
            events, self._events = self._events, []
        return rows, events
