"""Forming a process group, the part setup and regroup share: what the driver sees of it
meanwhile, and the state a worker takes as it joins.

While a group forms, status() tells the driver how far this worker got (`Forming.phase`:
preparing, joining, joined) and reads the clock of the thread that forms the group and then
trains, so that the driver blames a worker that does not reach the rendezvous while its
peers wait there, and not one that is merely slow to prepare. The state handed in arrives
packed (transfer.py: a survivor's, through the object store or, on the survivor's node,
its copy in shared memory: copies.py), as torch.save'd bytes (a checkpoint's), or, for sharded
state, as peer snapshots: this worker's own, named by its step alone because it never left
this process, or other ranks', fetched from the object store.
"""

from __future__ import annotations

import contextlib
import io
import threading
from typing import Any, Callable

from ...contract import CopiedState, Reshard, Snapshot
from ..busy import busy_seconds


class Forming:
    """Where this worker stands in forming a group (`phase`, Status.forming; None outside
    setup and regroup), and the thread that forms it and trains (`working`: ids, the
    kernel's and Python's), for the driver's clock of this worker's progress."""

    def __init__(self):
        self.phase: str | None = None
        self.working: tuple[int, int] | None = None

    def note_working(self) -> None:
        """This call's thread forms the group or trains: status() reads its clock."""
        self.working = (threading.get_native_id(), threading.get_ident())

    def busy_s(self) -> float | None:
        return busy_seconds(*self.working) if self.working else None

    @contextlib.contextmanager
    def marked(self):
        """Mark a setup or regroup call for status(): the driver blames a worker that does
        not reach the group's rendezvous while its peers wait there."""
        self.phase = "preparing"
        try:
            yield
        finally:
            self.phase = None

    def join(self, rank: int, world_size: int, addr: str, port: int, backend: str, timeout_s: float) -> None:
        from ..dist import init_group

        self.phase = "joining"
        init_group(rank, world_size, addr, port, backend, timeout_s)
        self.phase = "joined"


def resolve(resume: Any, own_snapshot: Callable[[int], Snapshot]) -> Any:
    """The snapshots in `resume` as setup loads them: this worker's own by its step (its
    peer snapshots' `own_snapshot`, asked only where one is named), and
    every rank's of a re-shard; a survivor's copy on this node, read (mapped); anything
    else as it is."""
    if isinstance(resume, Snapshot) and resume.data is None:
        return own_snapshot(resume.step)
    if isinstance(resume, Reshard):
        return Reshard(resume.step, tuple(_snapshot_part(part, own_snapshot) for part in resume.parts))
    if isinstance(resume, CopiedState):
        from ..state.copies import read

        step, packed = read(resume.name)
        if step != resume.step:  # the survivor wrote it for this worker and waits: never so
            raise RuntimeError(f"the copy of the state to take, {resume.name}, holds step {step}, not "
                               f"{resume.step}")
        return packed
    return resume


def _snapshot_part(part: Any, own_snapshot: Callable[[int], Snapshot]) -> Snapshot:
    """One rank's snapshot to re-shard from: this worker's own (no data), else fetched
    from the object store (a nested reference Ray does not resolve by itself)."""
    if isinstance(part, Snapshot) and part.data is None:
        return own_snapshot(part.step)
    import ray

    return ray.get(part)


def load(data: Any, views: tuple[str, ...] = ()) -> Any:
    """A state handed over: packed (transfer.py; the tensors under the top-level keys in
    `views` left views of the buffers, for a loader that copies them) or torch.save'd
    bytes (a checkpoint's); anything else as it is (a sharded checkpoint's URI, a peer
    snapshot)."""
    import torch

    from ..state.transfer import Packed, unpack

    if isinstance(data, Packed):
        return unpack(data, views)
    if isinstance(data, bytes):
        return torch.load(io.BytesIO(data), weights_only=True)
    return data
