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
bytes back to back: one memcpy per tensor into the mapped file.

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
    file name in `default_dir()`, the driver's choice."""

    def __init__(self, name: str):
        self.name = name
        self.prefix: str | None = None  # chosen at the first copy, by its size
        self.step: int | None = None
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
            with mmap.mmap(fd, total) as mm:
                mm[:_HEADER.size] = _HEADER.pack(_MAGIC, step, 0, len(skeleton))
                mm[_HEADER.size:_HEADER.size + len(skeleton)] = skeleton
                for buffer in packed.buffers:
                    mm[offset:offset + buffer.nbytes] = buffer
                    offset += buffer.nbytes
                # Complete only now: tmpfs pages are the node's, seen by every process at
                # once, and kept whatever happens to this one.
                mm[:_HEADER.size] = _HEADER.pack(_MAGIC, step, 1, len(skeleton))
        finally:
            os.close(fd)
        self.step, self._turn = step, 1 - self._turn

    def remove(self) -> None:
        remove(self.name)
        self.prefix, self.step = None, None


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
