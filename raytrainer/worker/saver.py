"""When and how a rank saves checkpoints: at most once per step, synchronously or (with
checkpoint.async) in the background, where the step only waits for the copy of the
state into shared memory, and a process of its own writes it (writer.py). A write that
failed in the background is raised on the training thread at the next save or at the end
of the run, never lost.

Replicated state (DDP): rank 0 writes state.pt, the other ranks go on at once.
Sharded state (FSDP): every rank writes its shards (a collective: every rank saves at
the same steps), and rank 0 commits once all are written (see checkpoint.py)."""

from __future__ import annotations

import time
from typing import Any, Callable

from ..checkpoint import Checkpoints, Committed
from ..config import CheckpointConfig


class CheckpointSaver:
    def __init__(self, checkpoints: Checkpoints | None, cfg: CheckpointConfig,
                 on_commit: Callable[[Committed, str], None], *, replicated: bool = True, rank: int = 0):
        self.checkpoints = checkpoints  # None: nowhere to write (a loop run on its own)
        self.cfg = cfg
        self.on_commit = on_commit  # (the checkpoint, its path)
        self.replicated, self.rank = replicated, rank
        self.saved_step = -1
        self._writer: Any = None  # writer.ProcessWriter, for checkpoint.async
        self._sharded: Any = None  # sharded.AsyncShardedSaver, for checkpoint.async
        self._error: BaseException | None = None
        self.blocked_s: dict[int, float] = {}
        """step -> how long its save held the training thread (the commit event says it)."""
        if checkpoints is not None and cfg.async_save and replicated and rank == 0:
            self._process_writer().start()  # its process now, while the worker sets up

    def save(self, step: int, state: Callable[[], dict[str, Any]], metrics: dict[str, float]) -> None:
        """Save the state after `step` (a no-op if it is saved already). Only rank 0 writes
        the replicated state: no collective, the other ranks go on."""
        if step == self.saved_step:
            return
        self.saved_step = step
        self.raise_error()
        if self.checkpoints is None or (self.replicated and self.rank != 0):
            return
        started = time.perf_counter()
        if not self.replicated:
            self._save_sharded(step, state(), dict(metrics), started)
        elif self.cfg.async_save:
            self._process_writer().submit(step, state(), dict(metrics))
            self.blocked_s[step] = time.perf_counter() - started
        else:
            ckpt = self.checkpoints.write(step, state(), dict(metrics))
            self.blocked_s[step] = time.perf_counter() - started
            self._committed(ckpt)

    def _process_writer(self) -> Any:
        if self._writer is None:
            from .writer import ProcessWriter

            self._writer = ProcessWriter(self.checkpoints, self._committed, self._failed)
        return self._writer

    def _save_sharded(self, step: int, state: dict[str, Any], metrics: dict[str, float], started: float) -> None:
        from .sharded import AsyncShardedSaver, save_sharded

        checkpoints = self.checkpoints
        if not self.cfg.async_save:
            files = save_sharded(state, checkpoints.storage, checkpoints.rel(step))
            self.blocked_s[step] = time.perf_counter() - started
            if self.rank == 0:
                self._committed(checkpoints.commit_sharded(step, files, metrics))
            return
        if self._sharded is None:  # its own Gloo group: made now, at the same step on every rank
            self._sharded = AsyncShardedSaver()
        future = self._sharded.save(state, checkpoints.storage, checkpoints.rel(step))
        self.blocked_s[step] = time.perf_counter() - started

        def done(future: Any) -> None:  # on DCP's thread, once every rank's shards are written
            try:
                files = future.result()
                if self.rank == 0:
                    self._committed(checkpoints.commit_sharded(step, files, metrics))
            except BaseException as exc:
                self._failed(exc)

        future.add_done_callback(done)

    def finish(self) -> None:
        """Wait for a write under way; raise if one failed. (The writer process stays for the
        next save; it goes with its worker, or with this saver.)"""
        if self._writer is not None:
            self._writer.wait()
        if self._sharded is not None:
            try:
                self._sharded.wait()
            except BaseException:
                pass  # its done callback has kept the error
        self.raise_error()

    def close(self) -> None:
        """finish(), and let the writer process go now."""
        try:
            self.finish()
        finally:
            if self._writer is not None:
                self._writer.close()

    def raise_error(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint failed: {exc}") from exc

    def _committed(self, ckpt: Committed) -> None:
        self.on_commit(ckpt, self.checkpoints.storage.path(f"{self.checkpoints.prefix}/{ckpt.name}"))

    def _failed(self, exc: BaseException) -> None:
        self._error = exc
