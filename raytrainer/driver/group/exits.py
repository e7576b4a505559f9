"""Workers on the driver's node found dead by their process, not only once Ray says so.

Ray holds an actor dead once its raylet has seen the process end; a raylet starved of CPU
on a loaded node, or stopped, says so late or not at all, and the recovery would wait for
it (Recovery.settle: a worker that does not answer is taken for dead only after its
peers have stopped and two of its control calls went unanswered, 1-1.5 s). The process
itself tells sooner: read from /proc at each of the driver's polls, a worker process that
is gone, or whose main thread is a zombie with an exit status, is dead, and the signal or
the status is its cause (`killed by SIGKILL: ...`).

A worker is watched only where its node is the driver's and the process under its pid
started when the worker said it did (Node.started): the same process, seen through the
same /proc. A main thread exited with status 0 may be its own (pthread_exit) while the
process lives on: that one is left to Ray.

Nothing is read between polls. A thread that read every 50 ms and had the survivors
aborted at once was tried: at 2 GB of state it halved the kill-to-`worker_failed` time,
but the kill to the next step did not move beyond its spread, and a run of your own loop
with a Lightning Trainer then diverged from an undisturbed one after its recovery in 3 of
11 kills (0 of 11 without it; tests/test_frameworks.py), for a reason not found
(docs/benchmarks.md, "A death found from the process").
"""

from __future__ import annotations

import signal

from ...contract import Node, proc_stat

GONE = "it no longer exists"


class ExitWatch:
    def __init__(self) -> None:
        self._watched: dict[int, tuple[int, int]] = {}  # rank -> (pid, start time)

    def arm(self, nodes: list[Node], here: str) -> None:
        """Watch the workers (by rank) whose node is `here` (the driver's node id)."""
        self._watched = {}
        for rank, node in enumerate(nodes):
            stat = proc_stat(node.pid) if node.node_id == here and node.pid and node.started else None
            if stat is not None and stat[1] == node.started and stat[0] not in "ZX":
                self._watched[rank] = (node.pid, node.started)

    def disarm(self) -> None:
        self._watched = {}

    def exited(self) -> dict[int, str]:
        """The watched workers found exited since the last call: rank -> how (ended())."""
        found = {rank: how for rank, (pid, started) in self._watched.items()
                 if (how := ended(pid, started)) is not None}
        for rank in found:
            del self._watched[rank]
        return found


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
