"""A second copy of a lone survivor's state, where the survivor's death does not take it.

When a recovery leaves one worker holding the training state (a fast recovery down to
one worker, its replacement still starting), that worker writes its state after every
step to a file in its node's shared memory (/dev/shm: RAM, no disk; a file there outlives
the process that wrote it, not the node). Should it die too, the recovery builds the next
group from the file's step: at most the step in flight is lost, where it used to be every
step since the last checkpoint (DESIGN.md, "Two copies, always").

Two files per copy, `<prefix>-0` and `<prefix>-1`, written in turn: a step's copy is
marked complete in its header only once all of it is written, so a death in the middle of
a write leaves the other file's step, one step older, to read. Layout: a header (magic,
step, complete, skeleton length), the pickled skeleton (transfer.py), then each tensor's
bytes back to back, written with pwrite: one kernel copy per tensor. (Through a mapping of
the file each 4 KB page took a fault, every time: 2 GB took 1.3 s where pwrite takes 0.4-0.5
s, on the 2-core VM; a full tmpfs is then an OSError where a mapping's write was a SIGBUS.)

Plain torch and numpy; no Ray.
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
import tempfile
from typing import Any, Callable

import numpy as np

from .transfer import Packed, pack

_MAGIC = b"RTCOPY01"
_HEADER = struct.Struct("<8sqqq")  # magic, step, complete, skeleton length
_DATA_ALIGN = 4096


def _data_offset(skeleton_len: int) -> int:
    return -(-(_HEADER.size + skeleton_len) // _DATA_ALIGN) * _DATA_ALIGN


class StateCopy:
    """The writer: `take(step, state_dict)` at every step boundary (a no-op for a step it
    has); `remove()` when a second holder is back or the run ends. `name`: the copy's
    file name in `default_dir()`, the driver's choice; `step`: a step whose state is kept
    elsewhere already (the recovery that made this worker the only holder secured it in
    the object store), not written again."""

    def __init__(self, name: str, step: int | None = None):
        self.name = name
        self.prefix: str | None = None  # chosen at the first copy, by its size
        self.step = step
        self._turn = 0

    def take(self, step: int, state_dict: Callable[[], Any]) -> None:
        if step == self.step:
            return
        packed = pack(state_dict())
        skeleton = pickle.dumps((packed.skeleton, [b.nbytes for b in packed.buffers]), protocol=5)
        offset = _data_offset(len(skeleton))
        total = offset + packed.nbytes
        if self.prefix is None:
            # A write to a full tmpfs through a mapping is a SIGBUS, not an error: room for
            # both turns first (a container's /dev/shm is often 64 MB), else the temp dir.
            room = next((d for d in _dirs() if _free_bytes(d) > 2 * total + (64 << 20)), None)
            if room is None:
                raise OSError(f"no room for two copies of {total / 1e9:.2f} GB in {' or '.join(_dirs())}")
            self.prefix = os.path.join(room, self.name)
        path = f"{self.prefix}-{self._turn}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != total:
                os.ftruncate(fd, total)
            _write(fd, _HEADER.pack(_MAGIC, step, 0, len(skeleton)) + skeleton, 0)
            for buffer in packed.buffers:
                _write(fd, buffer, offset)
                offset += buffer.nbytes
            # Complete only now: the file's pages are the node's page cache, seen by every
            # process at once, and kept whatever happens to this one.
            _write(fd, _HEADER.pack(_MAGIC, step, 1, len(skeleton)), 0)
        finally:
            os.close(fd)
        self.step, self._turn = step, 1 - self._turn

    def remove(self) -> None:
        remove(self.name)
        self.prefix, self.step = None, None


def _write(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:  # one write moves at most ~2 GB
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


def read(name: str) -> tuple[int | None, Packed | None]:
    """The newest complete copy of `name` on this node: (its step, the state packed; its
    buffers map the file), or (None, None)."""
    best = None
    for path in (f"{os.path.join(d, name)}-{turn}" for d in _dirs() for turn in (0, 1)):
        try:
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # absent, or empty
            continue
        if len(mm) < _HEADER.size:
            continue
        magic, step, complete, skeleton_len = _HEADER.unpack(mm[:_HEADER.size])
        if magic == _MAGIC and complete and (best is None or step > best[0]):
            best = (step, mm, skeleton_len)
    if best is None:
        return None, None
    step, mm, skeleton_len = best
    skeleton, sizes = pickle.loads(mm[_HEADER.size:_HEADER.size + skeleton_len])
    buffers, offset = [], _data_offset(skeleton_len)
    for size in sizes:
        buffers.append(np.frombuffer(mm, dtype=np.uint8, count=size, offset=offset))
        offset += size
    return step, Packed(skeleton, buffers)


def remove(name: str) -> None:
    for d in _dirs():
        for turn in (0, 1):
            try:
                os.unlink(f"{os.path.join(d, name)}-{turn}")
            except FileNotFoundError:
                pass


def default_dir() -> str:
    """Where copies go: the node's shared memory (RAM), else its temporary directory."""
    return _dirs()[0]


def _dirs() -> list[str]:
    shm = ["/dev/shm"] if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else []
    return shm + [tempfile.gettempdir()]


def _free_bytes(path: str) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize
