"""A rank's state at the loop's edges: what the loop starts from when it is built, and what
it leaves behind: checkpoints, told to the driver's log as they commit or fail; at a pause
for a resize, what the next group needs; at the end of the run, the final checkpoint and
weights.

A replicated state (DDP) arrives whole: a survivor's, or the checkpoint rank 0 read. A
sharded one (FSDP) arrives as where to find this rank's part: a checkpoint's URI (each rank
reads its own shards), a peer snapshot of its shards, or every rank's snapshots of another
world size, re-sharded onto this one. Either is checked first: a state resumes with the
strategy and the global batch it was written with, and a Task's loop does not resume your
own loop's state. Peer snapshots are kept for sharded state only, which no survivor holds
whole; at a pause they are what the next group re-shards, or, without them, a checkpoint.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...checkpoint import Checkpoints, Committed, Storage, with_retries
from ...config import CheckpointConfig, RunConfig, TrainerConfig
from ...contract import Reshard, Snapshot
from ...errors import ConfigError
from ..state.saver import CheckpointSaver
from ..state.snapshot import PeerSnapshots, check_memory, estimate_bytes, load, ranks_on_this_machine, restore
from ..state.state import TrainState
from ..state.strategy import Strategy

if TYPE_CHECKING:
    from .face import HandoverFace


def starting_state(state: dict[str, Any] | str | Snapshot | Reshard | None, strategy: Strategy,
                   cfg: TrainerConfig, template: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
    """The state dict to load (None: start afresh). `template`: the loop's state_dict, whose
    layout a sharded state is read into."""
    sharded = isinstance(state, (str, Snapshot, Reshard))
    if (state is not None) and sharded == strategy.replicated:
        written = "sharded (trainer.strategy: fsdp)" if sharded else "replicated (strategy: ddp)"
        raise ConfigError(f"the checkpoint to resume from is {written} but this run has trainer.strategy="
                          f"{cfg.strategy}; resume it with the strategy it was written with")
    if isinstance(state, str):  # a sharded checkpoint's URI: each rank reads its own shards
        return strategy.read_checkpoint(state, template())
    if isinstance(state, Snapshot):  # a peer snapshot of this rank's shards
        return restore(template(), load(state))
    if isinstance(state, Reshard):  # every rank's snapshot, of another world size (parts with data)
        from ..state.reshard import reshard

        return reshard(template(), [load(part) for part in state.parts])
    return state


def check_resumable(saved: dict[str, Any], cfg: TrainerConfig) -> None:
    """Raise where the loop's part of a state (`saved`) cannot go on in this run."""
    if saved.get("kind") == "loop":
        raise ConfigError("the checkpoint to resume from was written by a run of your own loop "
                          "(task.loop), not by a raytrainer.Task; resume it with that loop")
    if saved["global_batch_size"] != cfg.global_batch_size:
        raise ConfigError(
            f"the checkpoint was trained with trainer.global_batch_size="
            f"{saved['global_batch_size']}, this run has {cfg.global_batch_size}; "
            "resuming needs the same global batch (the steps, the schedule and the LR were set for it)"
        )


def where(loop: HandoverFace, rows: bool) -> dict[str, Any]:
    """The loop's own part of the state: where it is in the run (the step, the epoch and
    the data position, what early stopping and the non-finite steps counted, whether the
    step's after-work is pending), with the recent metric rows where `rows`."""
    return {"step": loop.step, "epoch": loop.epoch, "position": loop.position,
            "skipped_steps": loop.skipped_steps, "nonfinite_skips": loop.nonfinite.skips,
            "best": loop.stopping.best, "bad_validations": loop.stopping.bad_validations,
            "after_pending": loop.after_pending, "stop_reason": loop.stop_reason,
            "global_batch_size": loop.cfg.global_batch_size, "world_size": loop.world_size,
            "recent_losses": list(loop.spikes.recent),
            "rows": [r for r in loop.window.recent if r["step"] <= loop.step] if rows else []}


def go_back(loop: HandoverFace, saved: dict[str, Any]) -> None:
    """Put the loop where `saved` (where()) says, at the same global sample index whatever
    the world size now is."""
    loop.step, loop.skipped_steps = saved["step"], saved["skipped_steps"]
    loop.nonfinite.skips = saved.get("nonfinite_skips", 0)
    loop.spikes.recent = [tuple(pair) for pair in saved.get("recent_losses", ())]
    if "position" in saved:
        loop.epoch, loop.position = saved["epoch"], saved["position"]
    else:  # written before the position was saved: always a fixed global batch then
        loop.epoch, in_epoch = divmod(loop.step, loop.plan_for(loop.base_world_size).steps_per_epoch)
        loop.position = in_epoch * loop.cfg.global_batch_size
    loop.stopping.best, loop.stopping.bad_validations = saved["best"], saved["bad_validations"]
    loop.after_pending, loop.stop_reason = saved["after_pending"], saved["stop_reason"]
    loop.saver.saved_step = loop.step
    loop.window.recent.clear()
    loop.window.recent.extend(saved.get("rows", ()))


def bind_snapshots(snapshots: PeerSnapshots | None, strategy: Strategy, train: TrainState, *,
                   rank: int, world_size: int) -> PeerSnapshots | None:
    """The peer snapshots this loop takes (None: none, or the state is replicated), bound to
    its group once the host memory they need is known to be there."""
    snapshots = None if strategy.replicated else snapshots
    if snapshots is not None:
        check_memory(estimate_bytes(train.module, train.optimizer, train.ema), ranks_on_this_machine(),
                     "failure.snapshot_every_n_steps")
        snapshots.bind(rank, world_size)
    return snapshots


def checkpoint_saver(loop: HandoverFace, checkpoints: Checkpoints | None, cfg: CheckpointConfig) -> CheckpointSaver:
    """The loop's saver. A commit goes to the driver's log, the async validation (which ranks
    it for keep_best once its metrics arrive) and the callbacks; a failed save to the log."""

    def committed(ckpt: Committed, path: str) -> None:
        loop.notify({"event": "checkpoint_committed", "step": ckpt.step, "path": path,
                     "bytes": sum(f["size"] for f in ckpt.manifest["files"].values()),
                     # how long the save held the training thread (async: the copy of the state)
                     "blocked_s": round(loop.saver.blocked_s.pop(ckpt.step, 0.0), 4)})
        if loop.validation is not None:
            loop.validation.committed(ckpt)
        loop.callbacks("on_checkpoint", loop, path)

    def failed(step: int, path: str, cause: str) -> None:
        loop.notify(loop.saver.failed_event(step, path, cause))

    return CheckpointSaver(checkpoints, cfg, committed, replicated=loop.strategy.replicated, rank=loop.rank,
                           on_failure=failed)


def leave(loop: HandoverFace) -> dict[str, torch.Tensor] | None:
    """What a fit that stopped leaves behind. Paused for a resize (regroup(), then fit()
    again): nothing where the state is replicated (a survivor gives it), else what the next
    group re-shards; None. At the end of the run: the final checkpoint, and the final weights
    (EMA weights when on), on CPU, on rank 0."""
    if loop.paused:
        if loop.snapshots is not None and loop.snapshots.every:  # re-sharded from memory (reshard.py)
            loop.snapshots.keep(loop.step, loop.state_dict())
            loop.saver.finish()  # an asynchronous save in flight runs on this group
        elif not loop.strategy.replicated:  # sharded state leaves through a checkpoint (resharded on load)
            loop.save_checkpoint()
            loop.saver.finish()
        return None
    loop.close_inputs()
    if not loop.cfg.fast_dev_run:
        # The end of the run (a no-op if this step is saved): tried again if it fails, and
        # the run fails (StorageError) only if it cannot be made.
        loop.saver.save(loop.step, loop.checkpoint_state, loop.latest_metrics, final=True)
        loop.saver.finish()
    loop.stop_reason = loop.stop_reason or ("fast_dev_run" if loop.cfg.fast_dev_run else "completed")
    loop.callbacks("on_run_end", loop)
    with loop.train.averaged() as final:
        return loop.strategy.full_weights(final)


def save_model(loop: HandoverFace, run: RunConfig, weights: dict[str, Any]) -> str:
    """Write the final weights to <run.storage>/<run.name>/model.pt, whole or not at all;
    return where (the driver hands that path to its loggers, never the bytes)."""
    storage = Storage(run.storage)
    buffer = io.BytesIO()
    torch.save(weights, buffer)
    saver = loop.saver
    kept = saver.kept if saver.checkpoints is not None else (lambda: "No checkpoint of this run is kept")
    with_retries(lambda: storage.write_atomic(f"{run.name}/model.pt", buffer.getvalue()), "model.pt",
                 storage.path(f"{run.name}/model.pt"), kept)
    return storage.uri_of(f"{run.name}/model.pt")
