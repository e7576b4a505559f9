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


class NonFiniteLoss(RaytrainerError):
    """A step's loss (or gradient norm) was NaN or Inf (trainer.nonfinite): a property of
    the data or the hyperparameters, never retried as a worker failure."""


class Stopped(KeyboardInterrupt):
    """The run stopped on a signal (SIGINT, SIGTERM) after committing a checkpoint at the
    step it reached. A KeyboardInterrupt: code that stops on Ctrl-C stops on it."""

    def __init__(self, signum: int, step: int, checkpoint: str | None = None, checkpoint_step: int | None = None,
                 run_dir: str | None = None):
        import signal

        self.signum, self.step, self.run_dir = signum, step, run_dir
        self.checkpoint, self.checkpoint_step = checkpoint, checkpoint_step
        if checkpoint is None:
            saved = "no checkpoint is committed"
        elif checkpoint_step == step:
            saved = f"checkpoint {checkpoint} committed"
        else:
            saved = f"the newest committed checkpoint is {checkpoint} (step {checkpoint_step})"
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}; {saved}")

    def __reduce__(self):
        return (type(self), (self.signum, self.step, self.checkpoint, self.checkpoint_step, self.run_dir))

    def how_to_continue(self, config: str | None = None) -> str | None:
        """The command that continues the run: `raytrainer resume RUN_DIR` where the run
        directory holds its config.yaml (a local one, or a URI: the driver uploaded it with the
        checkpoint a stop commits), else the run's config (`config`) trained again under its
        name; None where the run has no directory yet."""
        import os

        if not self.run_dir:
            return None
        if "://" in self.run_dir or os.path.isfile(os.path.join(self.run_dir, "config.yaml")):
            return f"raytrainer resume {self.run_dir}"
        return f"raytrainer train {config or 'CONFIG'} --set run.name={self.run_dir.rstrip('/').rpartition('/')[2]}"


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
