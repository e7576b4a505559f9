"""What to do about a failure: pure decisions, no actors, no torch.

The controller reports what it saw (which workers died, hung, raised, or were
merely interrupted by a peer's failure) and carries out the decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .errors import RaytrainerError, WorkerError


@dataclass(frozen=True)
class Failure:
    rank: int
    kind: Literal["died", "hung", "error", "interrupted"]
    """died: the process or its node is gone; hung: no progress, killed by the driver;
    error: the worker's code raised; interrupted: a collective failed under it because
    a peer failed (a consequence, not a cause)."""
    cause: str
    step: int | None = None
    """The last step this worker completed, where known."""
    node: str | None = None
    error: BaseException | None = None
    """For `error`: what the worker raised (a WorkerError with its traceback, or ours)."""

    @property
    def error_type(self) -> str:
        return self.cause.partition(":")[0]


@dataclass(frozen=True)
class Decision:
    recover: bool
    reason: str = ""
    error: BaseException | None = None
    """What to raise when not recovering."""


class FailurePolicy:
    """Recover up to `max_failures` times; never retry our own errors (a config or task
    contract error will not go away) nor a worker error that recurs at the same step
    (deterministic: retrying it would only repeat it)."""

    def __init__(self, max_failures: int):
        self.max_failures = max_failures
        self.failures = 0
        self._errors: set[tuple[int | None, str]] = set()

    def decide(self, failures: list[Failure]) -> Decision:
        causes = root_causes(failures)
        for f in causes:
            if f.kind != "error":
                continue
            if isinstance(f.error, RaytrainerError) and not isinstance(f.error, WorkerError):
                return Decision(False, f"rank {f.rank}: {f.cause}", f.error)
            key = (f.step, f.error_type)
            if key in self._errors:
                return Decision(False, f"rank {f.rank} raised {f.error_type} again at the same step, "
                                       "so it is not retried", f.error)
            self._errors.add(key)
        self.failures += 1
        if self.failures > self.max_failures:
            last = "; ".join(f"rank {f.rank} {f.kind}: {f.cause}" for f in causes)
            reason = (f"failure.max_failures={self.max_failures} exceeded: failure {self.failures} "
                      f"of this run ({last}). Fix the cause, or raise failure.max_failures")
            # A worker's own error is what the user must see (rank, traceback); the reason
            # is in the event log.
            error = next((f.error for f in causes if isinstance(f.error, WorkerError)), None)
            return Decision(False, reason, error or FailuresExceeded(reason))
        return Decision(True, "; ".join(f"rank {f.rank} {f.kind}" for f in causes))


def root_causes(failures: list[Failure]) -> list[Failure]:
    """The failures that caused the others (all of them if every one was an interruption)."""
    return [f for f in failures if f.kind != "interrupted"] or list(failures)


class FailuresExceeded(RaytrainerError):
    """The run failed more often than failure.max_failures allows."""
