"""What the loop's satellites know a Task's Loop by: its public face, as a Protocol.

The step (step.py), a validation in this process (evaluate.py) or on the validation
actors (validation.py), what a rank starts from and leaves behind (handover.py) and a
roll-back (rollback.py) are functions of the loop beside it (see loop.py's module doc):
they take the loop and read and move its state. They take it as a LoopFace, defined here
below all of them, not as loop.Loop: loop.py imports them, so they may not import it (not
even for type checking). Loop has each member; nothing here is private to it.

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


class LoopFace(Protocol):
    # What it runs, where, and at which size.
    task: Task
    cfg: TrainerConfig
    rank: int
    world_size: int
    base_world_size: int
    device: torch.device
    max_steps: int | None
    max_epochs: int | None
    plan: BatchPlan
    flops_per_sample: float | None
    tokens_per_sample: float | None
    peak_flops: float | None

    # Where it stands: the data position, the hang check's progress and phase.
    step: int
    epoch: int
    position: int
    progress: int
    phase: str
    after_pending: bool
    last_time: float
    """When the last step (or validation) ended, on time.perf_counter: samples_per_s runs from it."""
    skipped_steps: int
    stop_reason: str | None
    pause_requested: bool
    paused: bool

    # What it is made of.
    train: TrainState
    strategy: Strategy
    module: torch.nn.Module
    scheduler: Any
    wrapped: torch.nn.Module
    model: Callable[..., Any]
    train_input: Any
    val_input: Any
    val_data: Any
    outputs: StepOutputs
    window: MetricsWindow
    latest_metrics: dict[str, float]
    stopping: EarlyStopping
    nonfinite: NonFiniteSteps
    spikes: Any
    rollbacks: Any
    validation: Any
    saver: CheckpointSaver
    snapshots: PeerSnapshots | None
    callbacks: Callbacks
    notify: Callable[[dict[str, Any]], None]

    def in_phase(self, phase: str) -> AbstractContextManager[None]: ...

    def in_user_code(self) -> AbstractContextManager[None]: ...

    def autocast(self) -> AbstractContextManager[Any]: ...

    def row(self, step: int, epoch: int, metrics: dict[str, float]) -> dict[str, Any]: ...

    def save_wanted(self) -> bool: ...

    def plan_for(self, world_size: int | None = None) -> BatchPlan: ...

    def flush(self, wait: bool = False) -> None: ...

    def validate(self, epoch: int) -> dict[str, float] | None: ...

    def state_dict(self, rows: bool = True) -> dict[str, Any]: ...

    def checkpoint_state(self) -> dict[str, Any]: ...

    def save_checkpoint(self, wait: bool = False) -> None: ...

    def close_inputs(self) -> None: ...
