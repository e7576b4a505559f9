"""How long a thread has been running or ready to run: the clock the driver's hang check
reads a worker's training thread by (Status.busy_s).

A worker that runs its own code, or is ready to and waits for a core on a loaded machine,
is not hung, however slow: a training thread that neither runs nor waits for a core waits on
something else (a stuck read, a hung kernel, a peer). Linux counts both per thread in
/proc/self/task/<tid>/schedstat (nanoseconds on a CPU, nanoseconds in the run queue);
elsewhere, or where the scheduler keeps no such statistics, the thread's CPU time alone
(then a worker scheduled late looks stalled to the driver, as every worker did before).
"""

from __future__ import annotations

import time


def busy_seconds(native_id: int | None, ident: int | None) -> float | None:
    """Seconds thread `native_id` (the kernel's id; `ident`: Python's, for the fallback)
    spent running or waiting in the run queue; None where it cannot be read (the thread is
    gone)."""
    if native_id is not None:
        try:
            with open(f"/proc/self/task/{native_id}/schedstat", "rb") as f:
                on_cpu, queued = f.read().split()[:2]
            return (int(on_cpu) + int(queued)) / 1e9
        except (OSError, ValueError):
            pass
    if ident is not None and hasattr(time, "pthread_getcpuclockid"):
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(ident))
        except (OSError, OverflowError):
            return None
    return None
