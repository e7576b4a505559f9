"""What setup builds in the group it has just joined: the Outlets through which the loop
reaches this process (rows and events for the driver's drain, the worker callbacks, the
run's checkpoints, the chaos claim, the peer snapshots kept across groups), and the loop
itself, a Task's Loop or your own loop's UserLoop.

Built anew at every setup, after the task: a worker that trained in an earlier group starts
over in this one. Your own loop gets the same outlets but has no hooks for worker callbacks,
so a config that names some is an error here rather than callbacks that never run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ...callbacks import Callbacks
from ...errors import ConfigError

if TYPE_CHECKING:
    import torch

    from ...config import Config
    from ..loop.settings import Outlets
    from ..state.snapshot import PeerSnapshots
    from ..state.state import Prebuilt


def outlets(cfg: Config, *, report: Callable[[list[dict[str, Any]]], None], notify: Callable[[dict[str, Any]], None],
            chaos_claim: Callable[[int, int], bool], snapshots: PeerSnapshots) -> Outlets:
    """The loop's outlets into the worker process: where its rows and events go (the
    worker's outbox), the chaos claim, the peer snapshots it keeps across groups; the
    worker callbacks, the run's checkpoints and where compiled artifacts are shared, built
    from `cfg`."""
    from ...checkpoint import Checkpoints, Storage
    from ..loop.compiling import share_run_artifacts
    from ..loop.settings import Outlets

    callbacks = Callbacks.build(cfg.callbacks, on_driver=False)
    return Outlets(report=report, notify=notify, callbacks=callbacks,
                   checkpoints=Checkpoints(Storage(cfg.run.storage), cfg.run.name, cfg.checkpoint),
                   chaos_claim=chaos_claim, snapshots=snapshots, share_compiled=lambda: share_run_artifacts(cfg.run))


def copied_on_load(cfg: Config) -> tuple[str, ...]:
    """The top-level keys of a handed-over state whose tensors the loop's load copies where
    they go (a Task's weights into the module, its optimizer's state into what the optimizer
    holds: strategy.load_optimizer), so that they may arrive as views of the object store's
    memory (forming.load); none for your own loop, whose state is yours."""
    return () if cfg.task.is_loop or cfg.trainer.strategy != "ddp" else ("model", "optimizer")


def build_loop(cfg: Config, node_id: str, task: Any, outlets: Outlets, rank: int, world_size: int,
               device: torch.device, state: Any, prebuilt: Prebuilt | None = None):
    """A Task's Loop (over the training state `prebuilt` where one was built ahead:
    warm.py), or, for your own loop (task.loop), fn(ctx) in the group just formed (see
    userloop.py)."""
    from ..loop.loop import Loop
    from ..loop.settings import LoopSettings

    if not cfg.task.is_loop:
        return Loop(task, LoopSettings.of(cfg), outlets, rank=rank, world_size=world_size, device=device,
                    state=state, prebuilt=prebuilt)
    from ..userloop.userloop import UserLoop

    if outlets.callbacks.callbacks:
        names = ", ".join(type(c).__name__ for c in outlets.callbacks.callbacks)
        raise ConfigError(f"callbacks: {names} run on the workers, inside a Task's loop; your own loop "
                          "(task.loop) has no such hooks: call them from your loop, or give the class "
                          "on_driver = True to run it on the driver")
    return UserLoop(task, cfg, rank=rank, world_size=world_size, device=device, report=outlets.report,
                    notify=outlets.notify, checkpoints=outlets.checkpoints, state=state,
                    node=node_id, snapshots=outlets.snapshots)
