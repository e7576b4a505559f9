"""Your own loop on a worker: `fn(ctx)` run inside the group, with the face of loop.Loop.

The actor drives a UserLoop as it drives a Task's Loop (step, progress, phase, fit,
state_dict/load_state_dict, regroup, abandon_step), so the driver, the controller and the
group's recovery are the same for both ways in; only what a step is differs.

A step boundary is a report. `ctx.report(metrics, state=...)` is one small all-reduce over
the ranks (the metrics' means, and two flags: whether every rank gave its state, and
whether one was asked to pause), then, where every rank gave its state, a copy of that
state in host memory: the state dicts of the objects given (model, optimizer, scheduler,
...) and the plain values, cloned to CPU. The copy is taken after the all-reduce, so a
worker that holds the state of report k knows every rank reached report k: after a
failure, any survivor's copy is the state of the newest report every rank reached.

Interrupted: when a peer dies, a collective in the user's code (DDP's gradient
all-reduce, or the report's) raises; fn's exception reaches the actor, which sees a peer
failure and answers "interrupted", keeping this object with its last copy. The driver
re-forms the group, the workers behind (and the replacements) take the survivor's copy,
and fit() runs fn again from the start, with ctx.state holding the copy and ctx.step the
step it was reported at. The steps done since that report are lost and redone.

A pause for a resize (or to leave a draining node) is agreed in a report's all-reduce and
taken at the first report with state on every rank after it: the report raises
`Paused` (a BaseException, which the user's `except Exception` does not catch) through fn.

Sharded state (trainer.strategy: fsdp): ctx.prepare_model shards the model as a Task's
FSDP run does (strategy.FSDP, on the mesh this loop made for the group), so a report's
state holds DTensors. Each rank's copy is then its own pieces (loopshards.py), which no
survivor holds for a lost rank: every report with state is also a peer snapshot
(snapshot.py: the copy goes to the next rank's memory too), and the driver recovers from
those as it does a Task's FSDP run (a replacement takes the copy its successor holds;
with none left, the newest checkpoint), building a new UserLoop on every worker.
Checkpoints are sharded (every rank writes its pieces); model.pt is gathered whole.
"""

from __future__ import annotations

import collections
import copy
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...checkpoint import Checkpoints, Committed, to_cpu
from ...config import Config
from ...contract import Reshard, Snapshot
from ...data import BatchPlan
from ...errors import ConfigError, TaskError
from .. import _internals, scratch
from . import loopshards
from ..dist import all_reduce_sum
from ..loop.phase import InPhase
from ..state.saver import CheckpointSaver
from ..state.snapshot import AutoInterval, PeerSnapshots, check_memory, interval_event, state_bytes
from ..state.strategy import build_strategy
from ..loop.validation import ReportValidations

Rows = Callable[[list[dict[str, Any]]], None]


class Paused(BaseException):
    """Raised by ctx.report through the user's fn when every rank has agreed to pause."""


class UserLoop:
    steps_per_epoch = None  # the loop's own business

    def __init__(self, fn: Callable[[Any], Any], config: Config, *, rank: int, world_size: int,
                 device: torch.device, report: Rows, notify: Callable[[dict[str, Any]], None],
                 checkpoints: Checkpoints | None, state: dict[str, Any] | str | Snapshot | Reshard | None = None,
                 node: str = "", snapshots: PeerSnapshots | None = None):
        self.fn, self.config = fn, config
        self.rank, self.world_size, self.device = rank, world_size, device
        self.strategy = build_strategy(config.trainer, world_size)
        self.replicated = self.strategy.replicated  # every rank's state is the same (ddp), or its own shards
        self._rows = report
        self.notify = notify
        self.total_steps = config.trainer.max_steps  # the progress bar's total, where given
        self.step = 0  # the step of the state held: where fn starts again
        self.epoch = 0
        self.progress = 0  # reports and sampled batches: the driver's hang check
        self.phase = "user"
        self.after_pending = False  # a report is whole or not at all
        self.pause_requested = False  # set by the driver's thread
        self.paused = False
        self.stop_reason: str | None = None
        self.held: dict[str, Any] | None = None  # the user's state of report `step`, on CPU
        self.layout: loopshards.Layout = []  # sharded: where the pieces in `held` belong
        self.checkpoint: str | None = None  # the checkpoint directory a restart from storage read
        self.saver = CheckpointSaver(checkpoints, config.checkpoint, self._committed, replicated=self.replicated,
                                     rank=rank, on_failure=self._save_failed)
        self.model: torch.nn.Module | None = None  # what ctx.prepare_model wrapped: the final weights
        self._reported = 0  # the newest step reported (rows), ahead of `step` where no state came
        self._pause_agreed = False
        self._warned_nonfinite = False  # a non-finite loss reported: said once
        # The rows of the latest reports, on every rank and in the state a survivor gives:
        # rank 0 may die holding rows the driver has not read yet; after a recovery, the
        # new rank 0 (often the lost one's replacement) sends those up to the state it goes
        # on from again (the driver keeps the first row of each step).
        self._history: collections.deque = collections.deque(maxlen=256)
        self.validations = ReportValidations(config.trainer.validation, report, notify)  # ctx.report(validate=)
        self._node = node or socket.gethostname()  # where this worker runs: its local rank
        self.local_rank, self.local_world_size = local_environment(rank, world_size, self._node)
        self.mesh = None if self.replicated else self._mesh()  # ctx.state's and prepare_model's
        # Sharded: every report with state is a peer snapshot too (off: failure.snapshot_every_n_steps 0).
        self.snapshots = snapshots if not self.replicated and snapshots is not None and snapshots.every else None
        self._memory_checked = False
        # ctx.state_due: how often reports carry the state, from what a copy costs (the
        # integrations' state_every="auto"), measured at each report with state and agreed
        # in the next report's all-reduce.
        self.state_interval = AutoInterval()
        self._measured = (0.0, 0.0)  # this rank's (copy s, s per step) of the last copy, not yet agreed
        self.state_asked = False  # the loop asks ctx.state_due: a changed interval is an event
        if self.snapshots is not None:
            self.snapshots.bind(rank, world_size)
        if state is not None:
            self.load_state_dict(loopshards.resolve(state, self.mesh, self.config.trainer.strategy))

    # ------------------------------------------------------------------ the Loop's face

    def fit(self) -> dict[str, torch.Tensor] | None:
        """Run fn to its end; return the final weights on rank 0. Called again after a
        recovery or a resize, it runs fn again from the state held."""
        self.paused = self._pause_agreed = False
        self._reported = self.step
        self.state_interval.reset()  # on every rank, as fn starts again on every rank
        self._measured = (0.0, 0.0)
        if self.rank == 0:
            self._rows([row for row in self._history if row["step"] <= self.step])
        folder = scratch.Folder()
        ctx = LoopContext(self, folder)
        try:
            with self.in_phase("user"):
                out = self.fn(ctx)
        except Paused:
            self.paused = True
            return None
        finally:
            folder.remove()  # ctx.scratch_dir, if fn asked for it
        if self.rank == 0:
            self.validations.take(wait=True)
        self._save(final=True)  # the end of the run, as a Task's (a no-op where this step is saved)
        self.saver.finish()
        self.stop_reason = "completed"
        if self.replicated and self.rank != 0:
            return None
        return self._final_weights(out)  # sharded: gathered, by every rank

    def state_dict(self) -> dict[str, Any]:
        """The state of the newest report with state, as a checkpoint's state.pt holds it
        (sharded: this rank's pieces, as a peer snapshot holds them)."""
        loop = {"kind": "loop", "step": self.step, "epoch": self.epoch, "checkpoint": self.checkpoint,
                "rows": [row for row in self._history if row["step"] <= self.step]}
        if not self.replicated:
            loop["layout"] = self.layout
        return {"loop": loop, "user": self.held}

    def _sharded_checkpoint(self) -> dict[str, Any]:
        """The state to save as a sharded checkpoint: the tensors apart, sharded over this
        group's mesh (every rank writes its pieces); the rest in its plain part."""
        loop = self.state_dict()["loop"]
        loop["user"], tensors = loopshards.to_checkpoint(self.held, self.layout, self.mesh)
        return {"loop": loop, "tensors": tensors}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("loop", {})
        if saved.get("kind") != "loop":
            raise ConfigError("the checkpoint to resume from was written by a raytrainer.Task run, not by "
                              "your own loop (task.loop); resume it with the task that wrote it")
        if ("layout" in saved) == self.replicated:
            written = "sharded (trainer.strategy: fsdp)" if "layout" in saved else "replicated (strategy: ddp)"
            raise ConfigError(f"the state to resume from is {written} but this run has trainer.strategy="
                              f"{self.config.trainer.strategy}; resume it with the strategy it was written with")
        self.step, self.epoch, self.held = saved["step"], saved["epoch"], state["user"]
        if not self.replicated:
            self.layout = saved["layout"]
            if self.held is not None:  # a re-shard's or a checkpoint's: this rank's pieces of this group
                self.held = loopshards.cut(self.held, self.layout, self.world_size, self.rank)
        self.checkpoint = saved.get("checkpoint")
        self._history = collections.deque(saved.get("rows", ()), maxlen=self._history.maxlen)
        self.saver.saved_step = self.step

    def regroup(self, rank: int, world_size: int) -> None:
        """Go on in a re-formed group (the default group, initialised) as `rank`. (Replicated
        state only: a sharded state's group is formed anew, each worker building a new
        UserLoop from the snapshots or a checkpoint.)"""
        self.rank, self.world_size = rank, world_size
        self.saver.rank = rank
        self.pause_requested = self._pause_agreed = self.paused = False
        self.local_rank, self.local_world_size = local_environment(rank, world_size, self._node)

    def abandon_step(self) -> None:
        """fn was interrupted: what it built is dropped; the copy of the last report stays."""
        self.model = None
        self.phase = "user"

    def save_checkpoint(self, wait: bool = False) -> None:
        """A checkpoint of the state held (that of the report it paused at), as a Task's loop
        saves one (actor.save_paused: a stop on a signal)."""
        self._save()
        if wait:
            self.saver.finish()

    def close_inputs(self) -> None:
        """Nothing to stop: the loop's own DataLoaders end with fn."""

    # ------------------------------------------------------------------ what ctx calls

    def report(self, metrics: dict[str, Any], state: dict[str, Any] | None, checkpoint: Any,
               validate: Any = None) -> None:
        step = int(metrics.get("step", self._reported + 1))
        if validate is not None and state is None:
            raise TaskError("ctx.report(validate=...) validates the state reported: give state= too")
        if not self.replicated and (validate is not None or checkpoint is not None):
            raise TaskError(f"ctx.report({'validate' if validate is not None else 'checkpoint'}=...): under "
                            "trainer.strategy fsdp each rank holds its own shards of the state, so rank 0's "
                            "copy is not the state; validate inside your loop, and let raytrainer write the "
                            "sharded checkpoints (checkpoint.every_n_steps)")
        epoch = int(metrics.get("epoch", self.epoch))
        if step <= self._reported:
            raise TaskError(f"ctx.report: step {step} after step {self._reported}; report increasing steps "
                            "(or leave 'step' out: each report is then the next step)")
        numeric = {k: _number(v) for k, v in metrics.items() if k not in ("step", "epoch") and _is_number(v)}
        for key, value in metrics.items():
            if not (_is_number(value) or isinstance(value, str) or value is None):
                raise TaskError(f"ctx.report: metrics[{key!r}] is a {type(value).__name__}; report numbers, "
                                "one-element tensors or strings")
        keys = sorted(numeric)
        flags = [float(state is not None), float(self.pause_requested)]
        values = torch.tensor([numeric[k] for k in keys] + list(self._measured) + flags, dtype=torch.float64)
        with self.in_phase("collective"):
            sums = all_reduce_sum(values).tolist()  # every rank reaches this report, or none goes past it
        everyone_has_state = sums[-2] == self.world_size
        self._pause_agreed |= sums[-1] > 0
        self.state_interval.agree(sums[-4] / self.world_size, sums[-3] / self.world_size)
        self._measured = (0.0, 0.0)
        self._reported = step
        self.progress += 1
        row = {"step": step, "epoch": epoch, "world_size": self.world_size, "time": time.time()}
        row.update({k: v for k, v in metrics.items() if k not in row and not _is_number(v)})
        row.update({k: total / self.world_size for k, total in zip(keys, sums)})
        self._history.append(row)  # first: a snapshot of this report holds its row
        if everyone_has_state:  # after the all-reduce: every rank reached this report
            self._hold(step, state)
            self.step, self.epoch, self.checkpoint = step, epoch, None
        if self.rank == 0:
            self._rows([row])
            loss = row.get("loss")
            if isinstance(loss, float) and not math.isfinite(loss) and not self._warned_nonfinite:
                self._warn_nonfinite(step, loss)
            if validate is not None and everyone_has_state:
                self.validations.submit(step, epoch, self.world_size, self.held, validate)
            elif self.validations.pending:
                self.validations.take(wait=False)
        if checkpoint is not None:
            self._save(Path(checkpoint), dict(numeric))
        elif everyone_has_state and self.saver.cfg.every_n_steps and step % self.saver.cfg.every_n_steps == 0:
            self._save(metrics=dict(numeric))
        if self._pause_agreed and everyone_has_state:
            if self.snapshots is not None:  # a resize re-shards from every rank's own (reshard.py)
                self.snapshots.keep(step, self.state_dict())
            elif not self.replicated:  # sharded state leaves through a checkpoint (resharded on load)
                self._save()
                self.saver.finish()
            raise Paused()

    def _hold(self, step: int, state: dict[str, Any]) -> None:
        """Copy the state reported (and snapshot it, sharded), measuring what that costs."""
        started = time.perf_counter()
        step_s, changed = self.state_interval.taken(step, started)
        if changed is not None and self.state_asked and self.rank == 0:
            self.notify(interval_event(step, self.state_interval))
        if self.replicated:
            self.held = _copy_state(state)
        else:
            self.held, self.layout = loopshards.take(_state_dicts(state))
        self.step = step  # the snapshot's
        self._snapshot()
        self._measured = (time.perf_counter() - started, step_s)

    def _snapshot(self) -> None:
        """Sharded: the state just held goes to the next rank's memory too, before the report
        returns: a lost rank's state of the last report with state is then on a survivor,
        as a replicated one is (a Task's snapshots, every few steps, go in the background)."""
        if self.snapshots is None:
            return
        if not self._memory_checked:  # once its size is known
            check_memory(state_bytes(self.held), self.local_world_size, "failure.snapshot_every_n_steps")
            self._memory_checked = True
        with self.in_phase("collective"):  # the ring exchange with the neighbours
            self.snapshots.take(self.step, self.state_dict())
            self.snapshots.wait()

    def _warn_nonfinite(self, step: int, loss: float) -> None:
        """Your loop owns its updates (the optimizer step came before the report), so a
        non-finite loss is only said, once: a warning on the driver's console and an event."""
        self._warned_nonfinite = True
        what = (f"step {step}: the loss your loop reported is {loss} (averaged over ranks); raytrainer does "
                "not stop your own loop for it: check for it in your loop (e.g. torch.isfinite(loss)) and "
                "skip the update or stop")
        print(f"raytrainer: warning: {what}", file=sys.stderr, flush=True)
        self.notify({"event": "nonfinite_loss", "step": step, "why": what})

    def sampled(self) -> None:
        self.progress += 1

    # ------------------------------------------------------------------ helpers

    def _save(self, directory: Path | None = None, metrics: dict[str, float] | None = None, *,
              final: bool = False) -> None:
        """Commit a checkpoint of the state held, with the files of the loop's own checkpoint
        `directory` beside it (rank 0's: a replicated state is the same on every rank)."""
        if self.saver.checkpoints is None or self.held is None and directory is None:
            return
        if directory is None:
            state = self.state_dict if self.replicated else self._sharded_checkpoint
            self.saver.save(self.step, state, metrics or {}, final=final)
            return
        self.saver.finish()  # a state-only save under way lands first
        self.saver.saved_step = self._reported
        if self.rank != 0:
            return
        if not directory.is_dir():
            raise TaskError(f"ctx.report(checkpoint={str(directory)!r}): not a directory on this worker")
        checkpoints = self.saver.checkpoints
        # The state held goes in with it where it is this report's; else the directory's
        # files are the state (ctx.state None, ctx.checkpoint this directory, on a restart).
        uri = checkpoints.storage.uri_of(checkpoints.rel(self._reported))
        state = {"loop": {"kind": "loop", "step": self._reported, "epoch": self.epoch, "checkpoint": uri},
                 "user": self.held if self.step == self._reported else None}
        self._committed(checkpoints.write_dir(self._reported, state, directory, metrics or {}))

    def _save_failed(self, step: int, path: str, cause: str) -> None:
        self.notify(self.saver.failed_event(step, path, cause))

    def _committed(self, ckpt: Committed, path: str | None = None) -> None:
        checkpoints = self.saver.checkpoints
        path = path or checkpoints.storage.path(checkpoints.rel(ckpt.step))
        self.notify({"event": "checkpoint_committed", "step": ckpt.step, "path": path,
                     "bytes": sum(f["size"] for f in ckpt.manifest["files"].values())})

    def _final_weights(self, out: Any) -> dict[str, torch.Tensor] | None:
        """model.pt: what fn returned (a module or a state dict), else the model it prepared.
        Sharded: gathered whole (a collective: every rank calls it), on rank 0."""
        found = out if out is not None else self.model
        if isinstance(found, torch.nn.Module):
            found = (_unwrap(found).state_dict() if self.replicated
                     else self.strategy.full_weights(found))
        elif not self.replicated and isinstance(found, dict):
            found = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in found.items()}
        if self.rank != 0:
            return None
        if isinstance(found, dict) and found and all(isinstance(v, torch.Tensor) for v in found.values()):
            return to_cpu(found)
        return None

    def _mesh(self) -> Any:
        """The group's device mesh (a collective), for prepare_model and ctx.state's DTensors."""
        from ..state.sharded import default_mesh

        return default_mesh(self.device.type)

    def in_phase(self, phase: str) -> InPhase:
        """Where this rank is, for the driver's hang check (see Worker.status)."""
        return InPhase(self, phase)


class LoopContext:
    """What your loop function gets: where it runs, where to start, and report()."""

    def __init__(self, loop: UserLoop, scratch_folder: scratch.Folder | None = None):
        self._loop = loop
        trainer = loop.config.trainer
        self.rank, self.world_size, self.device = loop.rank, loop.world_size, loop.device
        self.local_rank, self.local_world_size = loop.local_rank, loop.local_world_size
        self.step, self.epoch = loop.step, loop.epoch
        """The step and epoch of the state to start from (0 at a fresh start)."""
        self.state = (_clone(loop.held) if loop.replicated or loop.held is None
                      else loopshards.as_dtensors(loop.held, loop.layout, loop.mesh))
        """None at a fresh start; after a failure or a resize, the state of the newest report
        every rank reached, as reported (state dicts in place of the objects): from a
        survivor's memory, or where none survived, from the newest checkpoint. Under
        trainer.strategy fsdp, this rank's shards (DTensors over the model's mesh): load
        them after ctx.prepare_model and building the optimizer."""
        self.checkpoint = loop.checkpoint
        """The directory (or URI) of the checkpoint the state was read from, with the files
        your loop saved in it (ctx.report(checkpoint=...)); None when it came from memory."""
        self.max_steps, self.max_epochs = trainer.max_steps, trainer.max_epochs
        self.global_batch_size, self.seed = trainer.global_batch_size, trainer.seed
        self._scratch = scratch_folder if scratch_folder is not None else scratch.Folder()

    @property
    def scratch_dir(self) -> str:
        """A folder on this worker's local disk for your loop's own files (a Hugging Face
        Trainer's output_dir): this worker's alone, made when first asked for, removed when
        fn ends however it ends (commit what you keep: report(checkpoint=...)). One a killed
        worker left is removed by the next worker on its node that asks for one."""
        return str(self._scratch.path)

    def report(self, metrics: dict[str, Any], state: dict[str, Any] | None = None, checkpoint: Any = None,
               validate: Any = None) -> None:
        """A step boundary, on every rank (it is a collective: every rank reports the same
        number of times, with the same metric keys). `metrics`: a row for metrics.jsonl,
        averaged over the ranks, its step the `step` given or the next one. `state`: what to
        go on from after a failure: objects with state_dict() (model, optimizer, scheduler)
        and plain values (tensors, numbers, strings, lists and dicts of them); copied to
        host memory. `checkpoint`: a directory your loop wrote, committed with the state as
        a raytrainer checkpoint (rank 0's). `validate`: a function of the state (as reported:
        state dicts in place of the objects) returning a dict of metrics, run in a Ray task
        while training goes on (trainer.validation.resources); they arrive as this step's
        val_* row."""
        self._loop.report(metrics, state, checkpoint, validate)

    def state_due(self, step: int) -> bool:
        """Whether to give the state with the report of `step`, where you let raytrainer
        choose how often (the integrations' state_every="auto"): every interval at which the
        copies take about 2% of the time (as failure.snapshot_every_n_steps auto does for a
        Task), measured in the run, and the same answer on every rank. A failure costs up to
        that many steps (5 until the first measures; a "snapshot_interval" event says each
        interval chosen)."""
        self._loop.state_asked = True
        return self._loop.state_interval.due(step)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model on this worker's device, wrapped for the configured strategy
        (DistributedDataParallel over the group; trainer.sync_batchnorm converts its
        BatchNorm layers), or under trainer.strategy fsdp sharded in place as a Task's is
        (fully_shard, trainer.fsdp): build the optimizer over it afterwards. Its weights
        are model.pt at the end (gathered whole) unless fn returns others."""
        loop = self._loop
        if not loop.replicated:
            loop.model = loop.strategy.prepare(model, self.device, mesh=loop.mesh)
            return loop.model
        if loop.config.trainer.sync_batchnorm and self.world_size > 1:
            from ..state.syncbn import convert_sync_batchnorm

            model = convert_sync_batchnorm(model, self.device)
        model = model.to(self.device)
        if self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda"
                                            else None)
            _internals.keep_initial_buckets(model)  # sums alike after a re-form
        loop.model = model
        return model

    def sampler(self, dataset: Any, batch_size: int | None = None) -> GlobalSampler:
        """This rank's sample indices, one list per step: its share of each global batch
        (`batch_size`, default trainer.global_batch_size) in the run's seeded order by
        global sample index, the same at any world size. It starts at ctx.step, so a loop
        that reports its optimizer steps resumes at the sample it stopped at. A batch
        sampler: DataLoader(dataset, batch_sampler=ctx.sampler(dataset))."""
        size = dataset if isinstance(dataset, int) else len(dataset)
        batch = batch_size or self.global_batch_size
        plan = BatchPlan(size, batch, -(-batch // self.world_size), self.world_size, self.seed)  # no accumulation
        return GlobalSampler(plan, self.rank, self.step, self._loop.sampled)


class GlobalSampler:
    """A batch sampler by global sample index (see data.BatchPlan): the indices of this
    rank's share of each global batch of an epoch, from the step it starts at."""

    def __init__(self, plan: BatchPlan, rank: int, start_step: int, on_batch: Callable[[], None]):
        self.plan, self.rank, self._on_batch = plan, rank, on_batch
        self.steps_per_epoch = plan.steps_per_epoch
        start_epoch, in_epoch = divmod(start_step, self.steps_per_epoch)
        self._start = (start_epoch, in_epoch * plan.global_batch_size)
        self.epoch = start_epoch
        """The epoch the start step falls in (iterate from it: `for epoch in range(s.epoch, N)`)."""

    def set_epoch(self, epoch: int) -> None:
        """Iterate epoch `epoch` next (from the start position, if it is the start's epoch)."""
        self.epoch = epoch

    def _first(self) -> int:
        return self._start[1] if self.epoch == self._start[0] else 0

    def __iter__(self):
        position = self._first()
        while self.plan.fits(position):
            self._on_batch()
            yield torch.cat(self.plan.micro_batches(self.epoch, position, self.rank)).tolist()
            position += self.plan.global_batch_size

    def __len__(self) -> int:
        return (self.plan.epoch_size - self._first()) // self.plan.global_batch_size


# --------------------------------------------------------------------------- state

PLAIN = (torch.Tensor, int, float, bool, str, bytes, type(None))


def local_environment(rank: int, world_size: int, here: str) -> tuple[int, int]:
    """What torchrun sets, for code that initialises itself from it (Hugging Face's
    Trainer, accelerate, Lightning): this group's ranks, and on this node (`here`).
    Forming the group set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (dist.init_group);
    the local rank needs every rank's node: one all-gather, as the group forms. Returns
    (the local rank, the local world size)."""
    nodes = [here]
    if world_size > 1:
        nodes = [None] * world_size
        dist.all_gather_object(nodes, here)
    local_rank, local_world_size = nodes[:rank].count(here), nodes.count(here)
    node_rank = str(sorted(set(nodes), key=nodes.index).index(here))
    os.environ.update(LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(local_world_size),
                      GROUP_RANK=node_rank, NODE_RANK=node_rank)
    _forget_framework_state()
    return local_rank, local_world_size


def _copy_state(state: dict[str, Any]) -> dict[str, Any]:
    """The state of a report on CPU: each object's state_dict() (DDP's unwrapped), each
    plain value as it is; tensors cloned, so training on does not change the copy."""
    return to_cpu(_state_dicts(state))


def _state_dicts(state: dict[str, Any]) -> dict[str, Any]:
    """The state of a report: each object's state_dict() (DDP's unwrapped; a sharded
    module's after its parameters are resharded, so they are its DTensor shards), each
    plain value as it is, checked."""
    if not isinstance(state, dict):
        raise TaskError(f"ctx.report(state=...) takes a dict of objects and values, not {type(state).__name__}")
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.nn.Module):
            value = _unwrap(_resharded(value)).state_dict()
        elif hasattr(value, "state_dict") and callable(value.state_dict):
            value = value.state_dict()
        _check_plain(value, f"state[{key!r}]")
        out[key] = value
    return out


def _resharded(module: torch.nn.Module) -> torch.nn.Module:
    """After a forward with no backward FSDP keeps the root's parameters (and any unit's with
    reshard_after_forward off) gathered, registered whole: reshard them first."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):  # fully_shard is applied to the root last
        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
    return module


def _check_plain(value: Any, where: str) -> None:
    """What torch.load(weights_only=True) reads back: a copy sent to another worker, or a
    checkpoint, never unpickles code."""
    if isinstance(value, dict):
        for k, v in value.items():
            _check_plain(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
    elif not isinstance(value, PLAIN):
        raise TaskError(f"ctx.report: {where} is a {type(value).__name__}; a state holds objects with "
                        "state_dict() and tensors, numbers, strings, and lists and dicts of them")


def _clone(state: Any) -> Any:
    """A copy for fn to load from: optimizers load state tensors without copying them, and
    must not train the copy held for the next recovery."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return type(state)((k, _clone(v)) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(_clone(v) for v in state)
    return copy.copy(state)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def _is_number(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, (int, float))


def _number(value: Any) -> float:
    return float(value.detach().item()) if isinstance(value, torch.Tensor) else float(value)


def _forget_framework_state() -> None:
    """accelerate (under Hugging Face's Trainer) keeps the process group's shape in
    process-wide singletons, made once: after a re-form (a new group, maybe of another
    size) they must be made again from the new environment (see _internals)."""
    _internals.reset_accelerate_state()
