"""One root exception; every message names the setting or the code to change."""

from __future__ import annotations

import warnings


class RaytrainerError(Exception):
    """Root of every error raytrainer raises on purpose."""


class ConfigError(RaytrainerError):
    """The config (or a --set override) is wrong; the message names the key."""


class TaskError(RaytrainerError):
    """The user's task broke the contract (e.g. train_step returned no 'loss')."""


class PlacementError(RaytrainerError):
    """The cluster cannot place the workers the config asks for."""


class PeerFailure(RaytrainerError):
    """A worker's collective (or the forming of its group) failed because a peer failed:
    this worker is fine, the peer is the cause."""


class NoSurvivors(RaytrainerError):
    """Every worker was lost at once: only a checkpoint can continue the run."""


class CheckpointCorrupt(RaytrainerError):
    """A worker read a committed checkpoint that does not match its manifest: the next
    older one is tried."""

    def __init__(self, name: str, why: str):
        self.name, self.why = name, why
        super().__init__(f"checkpoint {name} {why}")

    def __reduce__(self):
        return (type(self), (self.name, self.why))


class WorkerError(RaytrainerError):
    """User code (or the loop) raised on a worker; carries the rank and its traceback."""

    def __init__(self, rank: int, message: str, traceback: str = "", step: int | None = None):
        self.rank = rank
        self.message = message
        self.traceback = traceback
        self.step = step
        where = f"rank {rank}" + (f", step {step}" if step is not None else "")
        text = f"worker {where} failed: {message}"
        if traceback:
            text += f"\n\n--- traceback on {where} ---\n{traceback.rstrip()}"
        super().__init__(text)

    def __reduce__(self):  # crosses process boundaries through Ray
        return (type(self), (self.rank, self.message, self.traceback, self.step))


class StorageError(RaytrainerError):
    """The end of the run could not be saved (its final checkpoint or model.pt) after
    retries: the message says where, why, and which checkpoint is kept."""


class RaytrainerWarning(RuntimeWarning):
    """Something the user must know that does not stop the run (a skipped checkpoint, a
    failed save): shown once, as `raytrainer: warning: ...` by the CLI."""


def warn(message: str, stacklevel: int = 2) -> None:
    """Warn once: through `warnings` only (catchable, filterable), never also printed."""
    warnings.warn(message, RaytrainerWarning, stacklevel=stacklevel + 1)


def show_warnings_plainly() -> None:
    """The CLI's display: `raytrainer: warning: <message>`, one line, every time."""
    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, RaytrainerWarning):
            import sys

            print(f"raytrainer: warning: {message}", file=file or sys.stderr, flush=True)
        else:
            default(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    warnings.simplefilter("always", RaytrainerWarning)
