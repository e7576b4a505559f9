"""When and how a rank saves checkpoints: at most once per step, synchronously or (with
checkpoint.async) in the background, where the step only waits for the copy of the
state into shared memory, and a process of its own writes it (writer.py).

A save that fails (a full disk, storage that cannot be reached) does not stop training:
nothing of it is committed, what it left is removed, the previous checkpoint stays the
newest (retention runs only after a commit), and `on_failure` reports it (the driver
logs `checkpoint_failed` and warns once per failed save). The next save is the retry:
the next `every_n_steps`, or the time trigger brought forward (`retry_in`: 1, 2, 4 ...
minutes, never later than `every_n_minutes`). Only the final save (the end of the run)
must succeed: it is tried 4 times over about a minute (checkpoint.with_retries), then the run fails with
a StorageError that says where, why, and which checkpoint is kept.

Replicated state (DDP): rank 0 writes state.pt, the other ranks go on at once.
Sharded state (FSDP): every rank writes its shards (a collective: every rank saves at
the same steps; DCP hands a rank's write error to every rank), and rank 0 commits once
all are written (see checkpoint.py)."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ...checkpoint import Checkpoints, Committed, cause_of, with_retries
from ...config import CheckpointConfig
from ...errors import StorageError

log = logging.getLogger(__name__)

# A failed periodic save is tried again this long after it (doubling per failure in a row),
# or at the next every_n_steps, whichever comes first; never later than every_n_minutes.
RETRY_FIRST_S = 60.0


class CheckpointSaver:
    def __init__(self, checkpoints: Checkpoints | None, cfg: CheckpointConfig,
                 on_commit: Callable[[Committed, str], None], *, replicated: bool = True, rank: int = 0,
                 on_failure: Callable[[int, str, str], None] | None = None):
        self.checkpoints = checkpoints  # None: nowhere to write (a loop run on its own)
        self.cfg = cfg
        self.on_commit = on_commit  # (the checkpoint, its path)
        self.on_failure = on_failure or (lambda step, path, cause: None)  # (its step, its path, the cause)
        self.replicated, self.rank = replicated, rank
        self.saved_step = -1
        self.committed_step = -1  # the newest step this saver committed
        self.failures_in_row = 0
        self.last_attempt = time.monotonic()  # the time trigger counts from here (set-up counts as a save)
        self._writer: Any = None  # writer.ProcessWriter, for checkpoint.async
        self._sharded: Any = None  # sharded.AsyncShardedSaver, for checkpoint.async
        self._failed_step: int | None = None  # the step of the last save that failed
        self.blocked_s: dict[int, float] = {}
        """step -> how long its save held the training thread (the commit event says it)."""
        if checkpoints is not None and cfg.async_save and replicated and rank == 0:
            self._process_writer().start()  # its process now, while the worker sets up

    def save(self, step: int, state: Callable[[], dict[str, Any]], metrics: dict[str, float], *,
             final: bool = False) -> None:
        """Save the state after `step` (a no-op if it is saved already). Only rank 0 writes
        the replicated state: no collective, the other ranks go on. A failed save is reported
        (on_failure) and training goes on; with `final` (the end of the run), it is tried
        again, and raises StorageError if it cannot be made."""
        if final:
            return self._save_final(step, state, metrics)
        if step == self.saved_step:
            return
        self.saved_step = step
        self.last_attempt = time.monotonic()
        if self.checkpoints is None or (self.replicated and self.rank != 0):
            return
        started = time.perf_counter()
        if not self.replicated:
            self._save_sharded(step, state(), dict(metrics), started, self.cfg.async_save)
        elif self.cfg.async_save:
            self._process_writer().submit(step, state(), dict(metrics))
            self.blocked_s[step] = time.perf_counter() - started
        else:
            self._write(step, state, metrics, started)

    def _write(self, step: int, state: Callable[[], dict[str, Any]], metrics: dict[str, float],
               started: float) -> None:
        try:
            ckpt = self.checkpoints.write(step, state(), dict(metrics))
        except Exception as exc:  # noqa: BLE001 - reported; training goes on
            self._failed(exc, step)
            return
        self.blocked_s[step] = time.perf_counter() - started
        self._committed(ckpt)

    def retry_in(self) -> float | None:
        """Seconds from the last save until the time trigger is due (None: no time trigger)."""
        every = self.cfg.every_n_minutes
        if not every:
            return None
        if self.failures_in_row:
            return min(every * 60.0, RETRY_FIRST_S * 2 ** (self.failures_in_row - 1))
        return every * 60.0

    def time_due(self) -> bool:
        """Whether this rank's clock says a save is due (checkpoint.every_n_minutes since the
        last save, sooner after a failed one). Rank 0 decides; the loop agrees on the step."""
        wait = self.retry_in()
        return wait is not None and time.monotonic() - self.last_attempt >= wait

    def _save_final(self, step: int, state: Callable[[], dict[str, Any]], metrics: dict[str, float]) -> None:
        if self.checkpoints is None:
            return
        self.finish()  # a save under way lands first
        if step != self.saved_step:
            # In this thread, async or not: the run waits for its end anyway, and its
            # outcome must be known here.
            self.saved_step, self.last_attempt = step, time.monotonic()
            if not self.replicated:
                self._save_sharded(step, state(), dict(metrics), time.perf_counter(), False)
            elif self.rank == 0:
                self._write(step, state, metrics, time.perf_counter())
        if self._failed_step != step:  # committed, or saved before (or by another rank: replicated)
            return
        if not self.replicated:
            # Every rank writes its shards: a retry would be a collective every rank must
            # agree to; the run fails on the rank that saw the failure.
            raise StorageError(f"the run trained to its end, but its final checkpoint (step {step}) could not "
                               f"be written to {self._where(step)}: {self._last_cause}. {self.kept()}")
        started = time.perf_counter()
        ckpt = with_retries(lambda: self.checkpoints.write(step, state(), dict(metrics)),
                            f"its final checkpoint (step {step})", self._where(step), self.kept)
        self.blocked_s[step] = time.perf_counter() - started
        self._committed(ckpt)

    def kept(self) -> str:
        """What a user still has, for an error: the newest committed checkpoint, if any."""
        try:
            newest = self.checkpoints.newest()
        except Exception:  # noqa: BLE001 - the storage itself may be what fails
            newest = None
        if newest is not None:
            return (f"Kept: the checkpoint of step {newest.step}, "
                    f"{self.checkpoints.storage.path(newest.rel)} (raytrainer resume continues from it)")
        if self.committed_step >= 0:
            return f"Kept: the checkpoint of step {self.committed_step} (its storage cannot be listed now)"
        return "No checkpoint of this run was committed; model.pt was not written"

    def _where(self, step: int) -> str:
        return self.checkpoints.storage.path(self.checkpoints.rel(step))

    def _process_writer(self) -> Any:
        if self._writer is None:
            from .writer import ProcessWriter

            self._writer = ProcessWriter(self.checkpoints, self._committed, self._failed)
        return self._writer

    def _save_sharded(self, step: int, state: dict[str, Any], metrics: dict[str, float], started: float,
                      in_background: bool) -> None:
        from .sharded import AsyncShardedSaver, save_sharded

        checkpoints = self.checkpoints
        if not in_background:
            try:
                files = save_sharded(state, checkpoints.storage, checkpoints.rel(step))
                self.blocked_s[step] = time.perf_counter() - started
                if self.rank == 0:
                    self._committed(checkpoints.commit_sharded(step, files, metrics))
            except Exception as exc:
                if _peer_failure(exc):
                    raise  # a peer died mid-save: a recovery, not a storage failure
                self._failed(exc, step)
            return
        if self._sharded is None:  # its own Gloo group: made now, at the same step on every rank
            self._sharded = AsyncShardedSaver()
        try:
            future = self._sharded.save(state, checkpoints.storage, checkpoints.rel(step))
        except OSError as exc:  # rank 0 could not prepare the directory (every rank raises it)
            self._failed(exc, step)
            return
        self.blocked_s[step] = time.perf_counter() - started

        def done(future: Any) -> None:  # on DCP's thread, once every rank's shards are written
            try:
                files = future.result()
                if self.rank == 0:
                    self._committed(checkpoints.commit_sharded(step, files, metrics))
            except BaseException as exc:
                self._failed(exc, step)

        future.add_done_callback(done)

    def finish(self) -> None:
        """Wait for a write under way. (The writer process stays for the next save; it goes
        with its worker, or with this saver.)"""
        if self._writer is not None:
            self._writer.wait()
        if self._sharded is not None:
            try:
                self._sharded.wait()
            except BaseException:
                pass  # its done callback has reported the error

    def close(self) -> None:
        """finish(), and let the writer process go now."""
        try:
            self.finish()
        finally:
            if self._writer is not None:
                self._writer.close()

    def _committed(self, ckpt: Committed) -> None:
        self.committed_step = max(self.committed_step, ckpt.step)
        self.failures_in_row = 0
        if self._failed_step == ckpt.step:
            self._failed_step = None
        self.on_commit(ckpt, self.checkpoints.storage.path(f"{self.checkpoints.prefix}/{ckpt.name}"))

    def _failed(self, exc: BaseException, step: int | None = None) -> None:
        """A save failed (on the training thread, the writer's answers thread or DCP's):
        nothing of it is committed; report it once, and bring the next try forward."""
        step = self.saved_step if step is None else step
        self._failed_step, self._last_cause = step, cause_of(exc)
        self.failures_in_row += 1
        if self.rank != 0:
            return  # a sharded save's error reaches every rank (DCP): rank 0 reports it, once
        if self.checkpoints is not None:
            self.checkpoints.discard(self.checkpoints.rel(step).rsplit("/", 1)[-1])
        self.on_failure(step, self._where(step) if self.checkpoints is not None else "", self._last_cause)

    _last_cause = ""

    def failed_event(self, step: int, path: str, cause: str) -> dict[str, Any]:
        """The `checkpoint_failed` event for the driver's log: a save that failed (on_failure's
        arguments), and the newest step this saver committed, which stays."""
        return {"event": "checkpoint_failed", "step": step, "path": path, "cause": cause,
                "kept_step": self.committed_step if self.committed_step >= 0 else None}


def _peer_failure(exc: BaseException) -> bool:
    import torch.distributed as dist

    from .. import _internals

    return isinstance(exc, dist.DistError) or _internals.is_gloo_transport_error(exc)
