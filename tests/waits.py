"""Waits that follow the machine: a test waits for an event (a step reached, a resize, a
recovery, a run's end) up to a limit in seconds of a quiet machine, which a loaded one
stretches. On a slow day (other test sessions, a CPU hog, a shared CI runner) every process
gets a fraction of a core and Ray's workers (nice 15 under a test's Ray) less: a fixed limit
tuned on a quiet day then fails tests whose code is right.

How much slower the machine is now (`slowness`): its 1-minute load average per core (a load of
12 on 2 cores: each runnable process gets about a sixth of a core), at least 1, at most
MAX_LOAD_FACTOR, times RAYTRAINER_TEST_SLOW where set (e.g. 3 on a machine known to be slow
in a way the load does not show). A wait counts its time divided by the slowness of each
moment, so a limit follows the load as it changes during the wait.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

# The load alone stretches a limit at most this much (a machine at 40 runnable processes
# per core would otherwise wait for ever for a test that really is stuck).
MAX_LOAD_FACTOR = 8.0


def slowness() -> float:
    """How many times slower than a quiet machine this one runs a test now."""
    try:
        factor = float(os.environ.get("RAYTRAINER_TEST_SLOW") or 1.0)
    except ValueError:
        raise ValueError(f"RAYTRAINER_TEST_SLOW={os.environ['RAYTRAINER_TEST_SLOW']!r} must be a number "
                         "(how many times slower than a quiet machine this one is), e.g. 3") from None
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        load = 1.0
    return max(1.0, factor) * min(MAX_LOAD_FACTOR, max(1.0, load))


def patience(seconds: float) -> float:
    """`seconds` on a quiet machine, in seconds of this one now (for a join or a
    subprocess timeout, which cannot count as they go)."""
    return seconds * slowness()


class Deadline:
    """A limit of `timeout_s` seconds of a quiet machine, counted as a wait goes: each
    moment's seconds divided by the machine's slowness then."""

    def __init__(self, timeout_s: float):
        self.timeout_s, self.waited, self._last = timeout_s, 0.0, time.monotonic()

    def passed(self) -> bool:
        now = time.monotonic()
        self.waited += (now - self._last) / slowness()
        self._last = now
        return self.waited >= self.timeout_s


def wait_until(ready: Callable[[], Any], what: str, timeout_s: float = 60.0, every_s: float = 0.05,
               alive: Callable[[], bool] | None = None) -> Any:
    """Wait until `ready()` returns something true, and return it; fail naming `what`
    after `timeout_s` seconds of a quiet machine (see the module), or as soon as `alive()`
    (if given: the run waited on is still going) is false."""
    deadline = Deadline(timeout_s)
    while not (value := ready()):
        if alive is not None and not alive():
            raise AssertionError(f"the run ended first: {what}")
        if deadline.passed():
            raise AssertionError(f"timed out waiting for {what} ({timeout_s:g} s of a quiet machine; "
                                 f"slowness now {slowness():.1f}: RAYTRAINER_TEST_SLOW raises it)")
        time.sleep(every_s)
    return value


def join(thread: Any, timeout_s: float) -> None:
    """thread.join for up to `timeout_s` seconds of a quiet machine (as join, it does not
    raise when the thread is still alive: the caller checks)."""
    deadline = Deadline(timeout_s)
    while thread.is_alive() and not deadline.passed():
        thread.join(0.2)
