"""Workers on the driver's node found dead by their process, before Ray says so.

Ray holds an actor dead once its process is gone, after its last thread has exited; for a
process of gigabytes that is after the kernel has freed its memory (2 GB of training state:
0.2-0.5 s on the 2-core VM; a GPU process's teardown takes longer), and its peers'
collectives fail only then too, as its sockets close last. Its main thread is a zombie
within milliseconds of the SIGKILL, with the signal as its exit code. So a thread reads the
state of the group's workers on this node from /proc every PERIOD_S while the group trains;
on an exit it has the others' collectives aborted (they stop at once, holding their state)
and the driver's next poll reports the rank dead, with the signal.

A worker is watched only where its node is the driver's and the process under its pid
started when the worker said it did (Node.started): the same process, seen through the
same /proc. A main thread exited with status 0 may be its own (pthread_exit) while the
process lives on: that one is left to Ray.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

from ...contract import Node, proc_stat


GONE = "it no longer exists"


class ExitWatch:
    PERIOD_S = 0.05

    def __init__(self, on_exit: Callable[[int], None]):
        """`on_exit(rank)`: called from the watching thread, under its lock, as a watched
        worker is found exited; it must not block (it sends the others' aborts)."""
        self._on_exit = on_exit
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[int, int]] = {}  # rank -> (pid, start time)
        self._exited: dict[int, str] = {}  # rank -> how its process ended (ended()), not reported yet
        self._thread: threading.Thread | None = None

    def arm(self, nodes: list[Node], here: str) -> None:
        """Watch the workers (by rank) whose node is `here` (the driver's node id)."""
        watched = {}
        for rank, node in enumerate(nodes):
            stat = proc_stat(node.pid) if node.node_id == here and node.pid and node.started else None
            if stat is not None and stat[1] == node.started and stat[0] not in "ZX":
                watched[rank] = (node.pid, node.started)
        with self._lock:
            self._watched, self._exited = watched, {}
            if watched and self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="raytrainer-exits", daemon=True)
                self._thread.start()

    def disarm(self) -> None:
        """Stop watching (before a re-form, or at the end): no on_exit call is running or
        will run once this returns."""
        with self._lock:
            self._watched, self._exited = {}, {}

    def exited(self) -> dict[int, str]:
        """The ranks found exited since the last call: rank -> how the process ended."""
        with self._lock:
            found, self._exited = self._exited, {}
        return found

    def _watch(self) -> None:
        while True:
            time.sleep(self.PERIOD_S)
            with self._lock:
                if not self._watched:
                    self._thread = None  # arm() starts another
                    return
                for rank, (pid, started) in list(self._watched.items()):
                    how = ended(pid, started)
                    if how is not None:
                        del self._watched[rank]
                        self._exited[rank] = how
                        self._on_exit(rank)


def ended(pid: int, started: int) -> str | None:
    """How process `pid` (started at `started`) ended ("killed by SIGKILL: ...", "exited with
    status 3", GONE: reaped, its exit status unseen), or None while it may still run."""
    stat = proc_stat(pid)
    if stat is None or stat[1] != started:
        return GONE
    state, _, code = stat
    if state not in "ZX" or code == 0:
        return None
    if code & 0x7F:
        try:
            name = signal.Signals(code & 0x7F).name
        except ValueError:
            name = f"signal {code & 0x7F}"
        why = ": the OOM killer, Ray's memory monitor, or a kill from outside" if code & 0x7F == signal.SIGKILL else ""
        return f"killed by {name}" + (", core dumped" if code & 0x80 else "") + why
    return f"exited with status {code >> 8}"
