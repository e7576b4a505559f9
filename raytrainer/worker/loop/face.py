"""What the loop's satellites know a Task's Loop by: each its own part of its public face,
as Protocols.

The step (step.py), a validation in this process (evaluate.py) or on the validation
actors (validation.py), what a rank starts from and leaves behind (handover.py) and a
roll-back (rollback.py) are functions of the loop beside it (see loop.py's module doc):
they take the loop and read and move its state. Each takes it as the Protocol here that
lists what it uses, defined below all of them, not as loop.Loop: loop.py imports them, so
they may not import it (not even for type checking). Loop has each member; nothing here is
private to it.

Members typed Any are the satellites' own classes (rollback.LossSpikes and Rollbacks,
validation.AsyncValidation), which this module may not import either.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    import torch

    from ...callbacks import Callbacks
    from ...config import TrainerConfig
    from ...data import BatchPlan
    from ...task import Task
    from ..state.saver import CheckpointSaver
    from ..state.snapshot import PeerSnapshots
    from ..state.state import TrainState
    from ..state.strategy import Strategy
    from .nonfinite import NonFiniteSteps
    from .outputs import StepOutputs
    from .stopping import EarlyStopping
    from .window import MetricsWindow


class Position(Protocol):
    """Where the loop stands: the optimizer steps done, the epoch and the data position in
    it (samples of the epoch's order consumed), at this rank and world size, over `plan`."""

    step: int
    epoch: int
    position: int
    rank: int
    world_size: int
    plan: BatchPlan
    train: TrainState


class Phases(Protocol):
    """Where a rank is, for the driver's hang check (phase.py)."""

    phase: str

    def in_phase(self, phase: str) -> AbstractContextManager[None]: ...

    def in_user_code(self) -> AbstractContextManager[None]: ...


class RollbackFace(Position, Protocol):
    """What rollback.roll_back moves the loop back with."""

    train_input: Any
    spikes: Any  # rollback.LossSpikes
    rollbacks: Any  # rollback.Rollbacks | None
    notify: Callable[[dict[str, Any]], None]


class StepFace(RollbackFace, Phases, Protocol):
    """What step.py's parts of an optimizer step use (and roll back with)."""

    task: Task
    cfg: TrainerConfig
    device: torch.device
    strategy: Strategy
    module: torch.nn.Module
    wrapped: torch.nn.Module
    model: Callable[..., Any]
    scheduler: Any
    outputs: StepOutputs
    nonfinite: NonFiniteSteps
    progress: int
    pause_requested: bool
    skipped_steps: int
    last_time: float
    """When the last step (or validation) ended, on time.perf_counter: samples_per_s runs from it."""
    flops_per_sample: float | None
    tokens_per_sample: float | None
    peak_flops: float | None

    def autocast(self) -> AbstractContextManager[Any]: ...

    def row(self, step: int, epoch: int, metrics: dict[str, float]) -> dict[str, Any]: ...

    def save_wanted(self) -> bool: ...


class Validating(Position, Phases, Protocol):
    """What a validation reads and reports through, in this process or on the actors."""

    task: Task
    cfg: TrainerConfig
    device: torch.device
    strategy: Strategy
    progress: int
    val_data: Any
    window: MetricsWindow
    latest_metrics: dict[str, float]
    stopping: EarlyStopping
    stop_reason: str | None
    callbacks: Callbacks

    def row(self, step: int, epoch: int, metrics: dict[str, float]) -> dict[str, Any]: ...


class EvaluateFace(Validating, Protocol):
    """What evaluate.py's validation in the training process uses."""

    val_input: Any
    outputs: StepOutputs
    validation: Any  # validation.AsyncValidation | None
    last_time: float

    def autocast(self) -> AbstractContextManager[Any]: ...

    def flush(self, wait: bool = False) -> None: ...


class ValidationFace(Validating, Protocol):
    """What validation.py's validations (async on the validation actors, or your loop's
    reported ones) use."""

    max_steps: int | None
    max_epochs: int | None
    saver: CheckpointSaver
    notify: Callable[[dict[str, Any]], None]

    def validate(self, epoch: int) -> dict[str, float] | None: ...


class HandoverFace(Position, Protocol):
    """What handover.py reads and restores at the loop's edges: what it starts from, saves
    and leaves, and the loop's own position in a state."""

    cfg: TrainerConfig
    base_world_size: int
    strategy: Strategy
    after_pending: bool
    stop_reason: str | None
    paused: bool
    skipped_steps: int
    nonfinite: NonFiniteSteps
    spikes: Any  # rollback.LossSpikes
    stopping: EarlyStopping
    window: MetricsWindow
    latest_metrics: dict[str, float]
    saver: CheckpointSaver
    snapshots: PeerSnapshots | None
    validation: Any  # validation.AsyncValidation | None
    callbacks: Callbacks
    notify: Callable[[dict[str, Any]], None]

    def plan_for(self, world_size: int | None = None) -> BatchPlan: ...

    def state_dict(self, rows: bool = True) -> dict[str, Any]: ...

    def checkpoint_state(self) -> dict[str, Any]: ...

    def save_checkpoint(self, wait: bool = False) -> None: ...

    def close_inputs(self) -> None: ...
