"""A worker whose driver is gone: paused, kept for a new driver of its run, then ended.

The workers are detached Ray actors (failure.driver_grace_s > 0), so a driver's death
(SIGKILL, an OOM kill, a lost head process) does not take their state with it. Each
watches its driver's Ray job; once the job is dead it asks its loop to pause at the next
step boundary the ranks agree on (the same pause a resize uses: every rank sees the flag
in the step's reduction), keeps the state in memory, and waits for a new driver of the run
to take it over (`adopt`). When none comes within the grace, it removes the run's placement
groups and ends its process. A process that holds no training state (kept for the next run,
a warm spare, one still in setup) ends at once, and leaves the groups to the holders.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Protocol


class Watched(Protocol):
    def request_pause(self) -> None: ...
    def holds_state(self) -> bool:
        """Whether it holds a training state (a loop): what a new driver takes over."""
        ...
    def placement_group_prefix(self) -> str | None:
        """The names of its run's placement groups start with this; None where the process
        holds nothing of a run."""
        ...


class DriverWatch:
    CHECK_S = 1.0
    """How often the driver's job is looked up in the GCS (a table read, about a ms)."""

    def __init__(self, job_id: str, grace_s: float, worker: Watched):
        self.job_id, self.grace_s, self.worker = job_id, grace_s, worker
        self._lock = threading.Lock()
        self.lost_at: float | None = None  # time.monotonic() when the driver's death was seen
        self._thread = threading.Thread(target=self._watch, name="raytrainer-driver-watch", daemon=True)
        self._thread.start()

    @property
    def orphaned(self) -> bool:
        return self.lost_at is not None

    def adopt(self, job_id: str) -> bool:
        """A new driver takes this worker over; False where it is ending already."""
        with self._lock:
            if self.lost_at is not None and time.monotonic() - self.lost_at > self.grace_s:
                return False
            self.job_id, self.lost_at = job_id, None
            return True

    def _watch(self) -> None:
        from .. import _internals  # torch's gateway: imported here, not with the actor (a spare imports it later)

        while True:
            time.sleep(self.CHECK_S)
            if self.lost_at is None:
                if _internals.job_alive(self.job_id) is False:
                    with self._lock:
                        self.lost_at = time.monotonic()
                    if self._holding():
                        self.worker.request_pause()
                continue
            prefix, holding = self._prefix(), self._holding()
            with self._lock:
                if self.lost_at is None:  # adopted meanwhile
                    continue
                over = time.monotonic() - self.lost_at > self.grace_s
            # Nothing a new driver would take (a process kept for the next run, a spare, one
            # still in setup): it ends now, and leaves the run's groups to the holders, which
            # a new driver may be taking over.
            if prefix is None or not holding:
                os._exit(0)
            if over:
                _internals.remove_placement_groups(prefix)
                os._exit(0)

    def _holding(self) -> bool:
        try:
            return self.worker.holds_state()
        except Exception:  # noqa: BLE001 - a process released for the next run has no state left
            return False

    def _prefix(self) -> str | None:
        try:
            return self.worker.placement_group_prefix()
        except Exception:  # noqa: BLE001 - likewise
            return None


_WATCH: DriverWatch | None = None


def watch_driver(worker: Watched, grace_s: float) -> DriverWatch | None:
    """The process's watch of its driver, started once and bound to `worker` (a kept
    process is a new Worker for each run); None outside a detached actor (grace 0: Ray
    ends the actor with its driver)."""
    global _WATCH
    import ray

    context = ray.get_runtime_context() if ray.is_initialized() else None
    if context is None or context.get_actor_id() is None:
        return None
    if _WATCH is None:
        if grace_s <= 0:  # not detached: Ray ends it with its driver
            return None
        _WATCH = DriverWatch(context.get_job_id(), grace_s, worker)
    _WATCH.worker, _WATCH.grace_s = worker, grace_s
    return _WATCH
