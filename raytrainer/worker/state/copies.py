"""A second copy of a lone survivor's state, where the survivor's death does not take it.

When a recovery leaves one worker holding the training state (a fast recovery down to
one worker, its replacement still starting), that worker writes its state after every
step to a file in its node's shared memory (/dev/shm: RAM, no disk; a file there outlives
the process that wrote it, not the node). Should it die too, the recovery builds the next
group from the file's step: at most the step in flight is lost, where it used to be every
step since the last checkpoint (DESIGN.md, "Two copies, always").

Two copies per name, `<prefix>-0` and `<prefix>-1`, written in turn: a step's copy is
marked complete in its header only once all of it is written, so a death in the middle of
a write leaves the other turn's step, one step older, to read. Layout: a header file
(magic, step, complete, skeleton length, then the pickled skeleton of transfer.py with each
tensor's place), and the tensors' bytes in part files beside it, `<prefix>-<turn>.<i>`,
written with pwrite (one kernel copy per tensor) by one thread per part. (Through a mapping
of the file each 4 KB page takes a fault, every time, where pwrite copies in the kernel; a
full tmpfs is then an OSError where a mapping's write was a SIGBUS. A tmpfs file takes one
write at a time (its inode's lock), so two threads into one file are no faster than one,
and into two files they are: docs/results/2026-11-26-lone-survivor-copy-pwrite.md.)

Plain torch (imported where a state is packed or read) and numpy; no Ray.
"""

from __future__ import annotations

import functools
import glob
import mmap
import os
import pickle
import struct
import tempfile
import threading
import warnings
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from .transfer import Packed

_MAGIC = b"RTCOPY02"
_HEADER = struct.Struct("<8sqqq")  # magic, step, complete, skeleton length
MAX_PARTS = 8  # writers, one per part file: the lone survivor's cores, which wait for the copy
PART_BYTES = 64 << 20  # a part at least this large: a small state is one file, no thread


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
        self.written: int | None = None  # the step of the newest complete copy in the files
        self._turn = 0

    def take(self, step: int, state_dict: Callable[[], Any]) -> None:
        if step == self.step:
            return
        from .transfer import pack  # torch: not where this module is imported

        packed = pack(state_dict())
        sizes = [b.nbytes for b in packed.buffers]
        places, part_sizes = _place(sizes, min(MAX_PARTS, os.cpu_count() or 1, -(-sum(sizes) // PART_BYTES)))
        skeleton = pickle.dumps((packed.skeleton, sizes, places), protocol=5)
        total = _HEADER.size + len(skeleton) + sum(part_sizes)
        if self.prefix is None:
            # A write to a full tmpfs through a mapping is a SIGBUS, not an error: room for
            # both turns first (a container's /dev/shm is often 64 MB), else the temp dir.
            room = next((d for d in _dirs() if _free_bytes(d) > 2 * total + (64 << 20)), None)
            if room is None:
                raise OSError(f"no room for two copies of {total / 1e9:.2f} GB in {' or '.join(_dirs())}")
            self.prefix = os.path.join(room, self.name)
        head = f"{self.prefix}-{self._turn}"
        fds = [os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
               for path in [head] + [f"{head}.{i}" for i in range(len(part_sizes))]]
        try:
            for fd, size in zip(fds, [_HEADER.size + len(skeleton)] + part_sizes):
                if os.fstat(fd).st_size != size:
                    os.ftruncate(fd, size)
            _write(fds[0], _HEADER.pack(_MAGIC, step, 0, len(skeleton)) + skeleton, 0)
            jobs: list[list[tuple[Any, int]]] = [[] for _ in part_sizes]
            for buffer, (part, offset) in zip(packed.buffers, places):
                jobs[part].append((buffer, offset))
            _write_parts(fds[1:], jobs)
            # Complete only now: the files' pages are the node's page cache, seen by every
            # process at once, and kept whatever happens to this one.
            _write(fds[0], _HEADER.pack(_MAGIC, step, 1, len(skeleton)), 0)
        finally:
            for fd in fds:
                os.close(fd)
        self.step, self.written, self._turn = step, step, 1 - self._turn

    def remove(self) -> None:
        remove(self.name)
        self.prefix, self.step, self.written = None, None, None


class LoneCopy:
    """A worker's copy of the state beside it, while the driver says it is the state's only
    holder (Worker.keep_copy, copy_now): the loop's keeper writes it at every step
    boundary. A copy that cannot be made (no room) is warned of, never a reason to stop
    training. `rank`: the worker's rank now, for the warning."""

    def __init__(self, rank: Callable[[], int | None]):
        self.copy: StateCopy | None = None
        self._rank = rank

    def keep(self, loop: Any, prefix: str | None, secured: int | None = None) -> None:
        if self.copy is not None and prefix != self.copy.name:
            self.remove()
        if prefix is not None and self.copy is None:
            self.copy = StateCopy(prefix, step=secured)
        if loop is not None:
            loop.keeper = functools.partial(self._write, loop) if self.copy is not None else None

    def now(self, loop: Any, prefix: str) -> int | None:
        self.keep(loop, prefix)
        if self.copy.written != loop.step:
            self.copy.step = None  # a step secured elsewhere is in no file: write it
        self._write(loop, loop.step, loop.state_dict)
        return self.copy.written if loop.keeper is not None else None

    def pause(self, loop: Any) -> None:
        """A second holder is back: no copy written until the driver says so again."""
        if self.copy is not None:
            loop.keeper = None

    def remove(self) -> None:
        if self.copy is not None:
            self.copy.remove()
            self.copy = None

    def _write(self, loop: Any, step: int, state_dict: Callable[[], Any]) -> None:
        try:
            self.copy.take(step, state_dict)
        except OSError as exc:
            warnings.warn(f"rank {self._rank()}: no copy of the state kept beside this worker, its only holder "
                          f"(a second failure now restarts from the newest checkpoint): {exc}", stacklevel=1)
            loop.keeper = None


def _place(sizes: list[int], parts: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Each buffer's (part, offset in it), whole buffers, the largest first into the part
    with the fewest bytes so far; and each part's size (no empty part)."""
    parts = max(1, min(parts, sum(1 for size in sizes if size)))
    filled = [0] * parts
    places: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        part = min(range(parts), key=filled.__getitem__)
        places[i] = (part, filled[part])
        filled[part] += sizes[i]
    return places, filled


def _write_parts(fds: list[int], jobs: list[list[tuple[Any, int]]]) -> None:
    """Write each part's buffers into its file, one thread per part after the first (this
    one's)."""
    errors: list[BaseException] = []

    def run(fd: int, job: list[tuple[Any, int]]) -> None:
        try:
            for buffer, offset in job:
                _write(fd, buffer, offset)
        except BaseException as exc:  # an OSError (a full tmpfs): raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(fd, job), name="raytrainer-copy-part", daemon=True)
               for fd, job in zip(fds[1:], jobs[1:])]
    for thread in threads:
        thread.start()
    run(fds[0], jobs[0])
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _write(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:  # one write moves at most ~2 GB
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


def read(name: str) -> tuple[int | None, Packed | None]:
    """The newest complete copy of `name` on this node: (its step, the state packed; its
    buffers map the files), or (None, None)."""
    best = None
    for path in (f"{os.path.join(d, name)}-{turn}" for d in _dirs() for turn in (0, 1)):
        try:
            with open(path, "rb") as f:
                head = f.read(_HEADER.size)
                if len(head) < _HEADER.size:
                    continue
                magic, step, complete, skeleton_len = _HEADER.unpack(head)
                if magic == _MAGIC and complete and (best is None or step > best[0]):
                    best = (step, path, f.read(skeleton_len))
        except OSError:  # absent
            continue
    if best is None:
        return None, None
    from .transfer import Packed

    step, path, skeleton = best
    skeleton, sizes, places = pickle.loads(skeleton)
    maps: dict[int, mmap.mmap] = {}
    for part in {part for (part, _), size in zip(places, sizes) if size}:
        with open(f"{path}.{part}", "rb") as f:
            maps[part] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    buffers = [np.frombuffer(maps[part], dtype=np.uint8, count=size, offset=offset) if size
               else np.empty(0, np.uint8) for (part, offset), size in zip(places, sizes)]
    return step, Packed(skeleton, buffers)


def remove(name: str) -> None:
    for d in _dirs():
        for path in glob.glob(f"{glob.escape(os.path.join(d, name))}-[01]*"):
            try:
                os.unlink(path)
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
