"""Asynchronous checkpoint writes in a process of their own (checkpoint.async, replicated state).

The training thread only copies the state into a shared-memory buffer (allocated at the
first save and reused: no page faults after it; from a GPU, a non-blocking copy into the
buffer pinned, then one wait for the stream) and sends the writer its layout: a few
hundred bytes. The writer process (forked from this worker's fork server, input.py: torch
already imported) rebuilds the tensors from the buffer, serialises them (torch.save), hashes
and writes them, and commits with the marker last (Checkpoints.write), at nice 19: on a
machine whose cores the workers use, it takes what they leave, and never their GIL. A
background thread of this process turns its answers into the commit event, or an error
reported as a failed save (CheckpointSaver: training goes on; only the final save must succeed).

At most one write is under way: a save waits for the previous one first (the buffer is
its). The writer dies with its worker, mid-write too (then nothing is committed): a thread
of it waits on a pipe whose other end only the worker holds, and exits the process when
that end closes (the worker is gone, however it went, or done with it).

What the training thread is held per save, against a synchronous save:
docs/benchmarks.md (the checkpoint stall).
"""

from __future__ import annotations

import os
import threading
import traceback
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...checkpoint import Checkpoints, Committed

ALIGN = 64  # bytes: every tensor's place in the buffer starts at a multiple of this


@dataclass(frozen=True)
class _Slot:
    """Where one tensor of the state is in the shared buffer."""
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class SharedState:
    """A state tree copied into one shared-memory buffer: `copy` returns the tree with each
    tensor replaced by its _Slot (its layout, pickled to the writer); `rebuild`, in the
    writer, the tree with tensors of their own again."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.pinned = False

    def copy(self, state: Any) -> tuple[Any, bool]:
        """(the layout, whether the buffer is new and must be sent to the writer first)."""
        tensors: list[tuple[_Slot, torch.Tensor]] = []
        end = 0

        def place(obj: Any) -> Any:
            nonlocal end
            if isinstance(obj, torch.Tensor):
                t = obj.to_local() if hasattr(obj, "to_local") else obj  # a DTensor: this rank's shard
                t = t.detach()
                slot = _Slot(end, t.dtype, tuple(t.shape))
                tensors.append((slot, t))
                end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
                return slot
            if isinstance(obj, dict):
                return {k: place(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return type(obj)(place(v) for v in obj)
            return obj

        layout = place(state)
        new = self.buffer is None or self.buffer.numel() < end
        if new:
            self.buffer = torch.empty(max(end, ALIGN), dtype=torch.uint8).share_memory_()
            self.pinned = False
        on_gpu = any(t.is_cuda for _, t in tensors)
        if on_gpu and not self.pinned:
            self.pinned = _pin(self.buffer)
        for slot, t in tensors:
            view(self.buffer, slot).copy_(t, non_blocking=on_gpu and self.pinned)
        if on_gpu:
            torch.cuda.current_stream().synchronize()  # the copies are done before the writer reads
        return layout, new


def view(buffer: torch.Tensor, slot: _Slot) -> torch.Tensor:
    count = 1
    for n in slot.shape:
        count *= n
    size = torch.empty((), dtype=slot.dtype).element_size()
    return buffer[slot.offset:slot.offset + count * size].view(slot.dtype).view(slot.shape)


def rebuild(buffer: torch.Tensor, layout: Any) -> Any:
    """The state tree, each tensor a storage of its own over its bytes in the buffer, not
    copied (torch.save writes one storage per tensor, as a synchronous save does; views of
    the buffer would each write it all)."""
    memory = memoryview(buffer.numpy()).cast("B")

    def build(layout: Any) -> Any:
        if isinstance(layout, _Slot):
            size = torch.empty((), dtype=layout.dtype).element_size()
            count = 1
            for n in layout.shape:
                count *= n
            if count == 0:
                return torch.empty(layout.shape, dtype=layout.dtype)
            return torch.frombuffer(memory[layout.offset:layout.offset + count * size],
                                    dtype=layout.dtype).view(layout.shape)
        if isinstance(layout, dict):
            return {k: build(v) for k, v in layout.items()}
        if isinstance(layout, (list, tuple)):
            return type(layout)(build(v) for v in layout)
        return layout

    return build(layout)


def _pin(buffer: torch.Tensor) -> bool:
    """Page-lock the shared buffer for the GPU's copies (cudaHostRegister, as torch's own
    _create_cpu_state_dict does); False if it cannot. The registration ends with the buffer:
    freed while registered, its pages stay known to the driver, and a later allocation at the
    same address fails the next CUDA call ("resource already mapped", seen on an H100)."""
    try:
        cudart = torch.cuda.cudart()
        ptr = buffer.data_ptr()
        if int(cudart.cudaHostRegister(ptr, buffer.numel(), 0)) != 0:
            _clear_cuda_error()
            return False
    except Exception:  # noqa: BLE001 - an unpinned buffer still works, with a blocking copy
        return False
    weakref.finalize(buffer, _unpin, ptr)
    return True


def _unpin(ptr: int) -> None:
    try:
        if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
            _clear_cuda_error()
    except Exception:  # noqa: BLE001 - at exit CUDA may be gone before the buffer
        pass


def _clear_cuda_error() -> None:
    """Consume the error a failed runtime call leaves behind. The CUDA runtime keeps it as the
    thread's last error, and torch checks that after its next kernel launch: the training step
    would fail for a pin that was only an optimisation. torch binds no cudaGetLastError; a
    launch of its own reads it and raises it here, where it is dropped."""
    try:
        torch.empty(1, device="cuda").zero_()
        torch.cuda.current_stream().synchronize()
    except Exception:  # noqa: BLE001 - the error being cleared
        pass


class ProcessWriter:
    """checkpoint.AsyncWriter's interface (submit, wait), writing in a process of its own."""

    def __init__(self, checkpoints: Checkpoints, on_commit: Callable[[Committed], None],
                 on_error: Callable[[BaseException, int], None]):
        self.checkpoints = checkpoints
        self.on_commit, self.on_error = on_commit, on_error
        self.shared = SharedState()
        self._conn: Any = None
        self._proc: Any = None
        self._idle = threading.Event()
        self._idle.set()
        self.writing = -1  # the step being written (what an error is about)

    def start(self) -> None:
        """Start the writer process now (the fork server too, if it is not up): at set-up,
        not in the first save."""
        if self._proc is None or not self._proc.is_alive():
            self._start()

    def submit(self, step: int, state: dict[str, Any], metrics: dict[str, float]) -> None:
        """Copy `state` (the training thread waits for this only) and have it written."""
        self.wait()  # the previous write has finished: the buffer is free
        layout, new = self.shared.copy(state)
        if self._proc is None or not self._proc.is_alive():
            self._start()
            new = True
        self._idle.clear()
        self.writing = step
        try:
            if new:
                self._conn.send(("buffer", self.shared.buffer))
            self._conn.send(("write", step, layout, metrics))
        except (OSError, EOFError) as exc:  # it died just now
            self._idle.set()
            self.on_error(RuntimeError(f"the checkpoint writer process is gone: {exc}"), step)

    def wait(self) -> None:
        self._idle.wait()

    def close(self) -> None:
        """Wait for a write under way, then let the process go."""
        self.wait()
        if self._conn is not None:
            self._conn.close()  # the writer sees its pipe close and exits
            self._alive.close()
        if self._proc is not None:
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
        self._conn = self._proc = None

    def _start(self) -> None:
        from ..loaders import loader_context

        ctx = loader_context()
        mine, theirs = ctx.Pipe()
        # Only this process holds `alive`'s writing end: the writer sees it close the moment
        # this process is gone, however it went.
        watched, self._alive = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_writer_main, args=(theirs, watched, self.checkpoints), daemon=True,
                                 name="raytrainer-checkpoint-writer")
        self._proc.start()
        theirs.close()
        watched.close()
        self._conn = mine
        # A writer no one holds any more (a loop replaced after a recovery) lets its process
        # go: the answers' thread holds it only weakly, and the pipe closes with it.
        weakref.finalize(self, self._alive.close)
        threading.Thread(target=_answers, args=(weakref.ref(self), mine, self._idle),
                         name="raytrainer-checkpoint-answers", daemon=True).start()


def _answers(writer: Callable[[], ProcessWriter | None], conn: Any, idle: threading.Event) -> None:
    """The writer process's answers, to the worker's callbacks, until it is gone."""
    while True:
        try:
            answer = conn.recv()
        except (EOFError, OSError):
            if not idle.is_set() and (w := writer()) is not None:  # it died while writing
                w.on_error(RuntimeError("the checkpoint writer process died while writing"), w.writing)
            idle.set()
            return
        try:
            if (w := writer()) is not None:
                if answer[0] == "committed":
                    w.on_commit(answer[1])
                else:
                    w.on_error(RuntimeError(answer[1]), w.writing)
                del w
        finally:
            idle.set()


def _writer_main(conn: Any, alive: Any, checkpoints: Checkpoints) -> None:
    """The writer process: write each state it is sent, answer with its Committed or an error;
    exit at once, mid-write too (nothing is committed then), when its worker is gone."""
    threading.Thread(target=_exit_with_worker, args=(alive,), daemon=True).start()
    try:
        os.nice(19)
    except OSError:
        pass
    torch.set_num_threads(1)
    buffer = None
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the worker is gone, or done with us
        if message[0] == "buffer":
            buffer = message[1]
            continue
        _, step, layout, metrics = message
        try:
            answer = ("committed", checkpoints.write(step, rebuild(buffer, layout), metrics))
        except BaseException as exc:  # noqa: BLE001 - the worker raises it
            answer = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        try:
            conn.send(answer)
        except (EOFError, OSError):
            return


def _exit_with_worker(alive: Any) -> None:
    """Its parent is the fork server, which outlives the worker as long as any process it
    forked lives (PR_SET_PDEATHSIG would wait for it): watch the worker's own pipe instead."""
    try:
        alive.recv()
    except (EOFError, OSError):
        pass
    os._exit(0)
