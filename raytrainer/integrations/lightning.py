"""A PyTorch Lightning `Trainer` inside raytrainer.train_loop (the `[lightning]` extra).

    from raytrainer.integrations import lightning as rtl

    def train_func(ctx):
        model = MyLightningModule()
        trainer = L.Trainer(max_steps=ctx.max_steps, use_distributed_sampler=False,
                            strategy=rtl.RaytrainerDDPStrategy(ctx),
                            callbacks=[rtl.RaytrainerCallback(ctx)])
        trainer.fit(model, rtl.dataloader(ctx, train_set),
                    ckpt_path=rtl.checkpoint_to_resume(ctx, "/tmp/lightning"))

The pieces Ray Train's users know (RayLightningEnvironment, RayDDPStrategy,
RayTrainReportCallback), on raytrainer's process group:
- `RaytrainerEnvironment`: a ClusterEnvironment that reads this worker's rank, local rank,
  node rank and world size from raytrainer and creates no processes;
- `RaytrainerDDPStrategy`: Lightning's DDPStrategy on that environment, on ctx.device; the
  process group is raytrainer's (Lightning finds it initialised and keeps it);
- `RaytrainerCallback`: each optimizer step is a raytrainer step boundary (ctx.report): what
  the module logged (`self.log`) is a row of metrics.jsonl, with the metrics of a validation
  run after that step; every `state_every` steps Lightning's whole checkpoint (model,
  optimizers, schedulers, loops, callbacks) goes to host memory on every worker;
- `checkpoint_to_resume`: the `ckpt_path` to fit from: None at a fresh start, else that
  checkpoint (from a survivor's memory, or where none survived the newest committed one),
  written to a local file;
- `dataloader`: batches in raytrainer's seeded global order (ctx.sampler) that start at the
  step resumed from, so a fit resumed mid-epoch sees the batches an undisturbed one does
  (a plain DataLoader restarts its epoch: Lightning warns that the result is unreliable).

FSDP: not provided. Lightning's FSDPStrategy gathers a full state dict on rank 0 only (or
writes sharded files), so no survivor holds the whole state that raytrainer's replicated
recovery copies; a sharded Lightning run would recover from checkpoints only.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.strategies import DDPStrategy

from . import AUTO, state_due, state_every_checked

__all__ = ["RaytrainerEnvironment", "RaytrainerDDPStrategy", "RaytrainerCallback", "checkpoint_to_resume",
           "dataloader"]


class RaytrainerEnvironment(ClusterEnvironment):
    """This worker's place in raytrainer's group. Lightning's setters are ignored: the group
    is raytrainer's, formed before the loop function runs."""

    def __init__(self, ctx: Any):
        super().__init__()
        self.ctx = ctx

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ["MASTER_ADDR"]

    @property
    def main_port(self) -> int:
        return int(os.environ["MASTER_PORT"])

    @staticmethod
    def detect() -> bool:
        return False  # given explicitly, never picked by Lightning

    def world_size(self) -> int:
        return self.ctx.world_size

    def set_world_size(self, size: int) -> None:
        pass

    def global_rank(self) -> int:
        return self.ctx.rank

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return self.ctx.local_rank

    def node_rank(self) -> int:
        return int(os.environ.get("NODE_RANK", 0))


TO_MEMORY = "raytrainer://memory"  # the path that RaytrainerDDPStrategy.save_checkpoint keeps in memory


class RaytrainerDDPStrategy(DDPStrategy):
    """DDPStrategy on raytrainer's process group, on ctx.device (any DDPStrategy argument:
    `static_graph=True`, `find_unused_parameters=True`, ...)."""

    def __init__(self, ctx: Any, **kwargs: Any):
        kwargs.setdefault("cluster_environment", RaytrainerEnvironment(ctx))
        super().__init__(**kwargs)
        self.ctx = ctx
        self.in_memory: dict[str, Any] | None = None

    @property
    def root_device(self) -> torch.device:
        return self.ctx.device

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.ctx.world_size, "rank": self.ctx.rank}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Trainer.save_checkpoint(TO_MEMORY) hands the checkpoint's dict to the callback
        instead of writing a file (Lightning's public way to the dict it saves)."""
        if filepath == TO_MEMORY:
            self.in_memory = checkpoint
            return
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)


class RaytrainerCallback(pl.Callback):
    """Reports each optimizer step to raytrainer (see the module). `state_every`: every how
    many steps the state goes to memory, a failure costing at most that many steps; "auto"
    (the default): as often as that takes about 2% of the time, measured in the run
    (ctx.state_due)."""

    def __init__(self, ctx: Any, state_every: int | str = AUTO):
        self.ctx, self.state_every = ctx, state_every_checked(state_every)
        self._row: dict[str, Any] | None = None  # the step's row, until it is reported
        self._validation_keys: set[str] = set()
        self._last = ctx.step  # the newest step with a row: accumulating batches add none

    def setup(self, trainer, pl_module, stage):
        if not isinstance(trainer.strategy, RaytrainerDDPStrategy):
            raise TypeError(f"RaytrainerCallback needs Trainer(strategy=RaytrainerDDPStrategy(ctx)), not "
                            f"{type(trainer.strategy).__name__}: the state reported is the checkpoint that "
                            "strategy keeps in memory")

    def on_train_start(self, trainer, pl_module):
        # Lightning has read the file checkpoint_to_resume wrote (Trainer._run: it restores
        # before the run's stage starts): a recovery's copy of the whole state is not left
        # on the worker's disk, one more at each recovery.
        while _written:
            with contextlib.suppress(OSError):
                os.remove(_written.pop())

    # A step is reported at the start of the next batch (or the end of the fit): the model
    # and optimizers are as the step left them, a validation run after the step has added
    # its metrics to the row, the epoch's end (its hooks and epoch schedulers) is behind,
    # and Lightning resumes a checkpoint taken there exactly, like any mid-epoch one. A
    # checkpoint taken in on_train_epoch_end is not: Lightning resumes it by ending that
    # epoch again, and the fit goes apart from the undisturbed one two steps later
    # (Lightning 2.6; test_frameworks' resume from every step's state).
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step <= self._last:
            return
        self._last = trainer.global_step
        metrics = {k: v for k, v in trainer.callback_metrics.items() if k not in self._validation_keys}
        self._row = {"step": trainer.global_step, "epoch": trainer.current_epoch, **_numbers(metrics)}

    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking or self._row is None:
            return
        found = _numbers(trainer.callback_metrics)
        self._validation_keys = {k for k in found if k not in self._row}
        self._row.update(found)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._flush(trainer)

    def on_train_end(self, trainer, pl_module):
        self._flush(trainer)

    def _flush(self, trainer) -> None:
        if self._row is None:
            return
        row, self._row = self._row, None
        state = None
        if state_due(self.ctx, self.state_every, row["step"]):
            state = {"lightning": _checkpoint(trainer)}
        self.ctx.report(row, state=state)


def checkpoint_to_resume(ctx: Any, directory: str) -> str | None:
    """The `ckpt_path` for Trainer.fit: None at a fresh start, else the state raytrainer
    holds, as a Lightning checkpoint file in `directory` (this worker's local disk; its own
    name, removed by RaytrainerCallback once Lightning has read it)."""
    if ctx.state is None or "lightning" not in ctx.state:
        return None
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"raytrainer-{os.getpid()}-step{ctx.step}-rank{ctx.rank}.ckpt")
    torch.save(ctx.state["lightning"], path)
    _written.append(path)
    return path


_written: list[str] = []
"""The files checkpoint_to_resume wrote in this process that Lightning has not read yet."""


def dataloader(ctx: Any, dataset: Any, batch_size: int | None = None, **kwargs: Any) -> torch.utils.data.DataLoader:
    """A DataLoader of this rank's share of each global batch (`batch_size`, default
    trainer.global_batch_size) in the run's seeded order, starting at the step resumed from
    (ctx.sampler). Give the Trainer `use_distributed_sampler=False`: the batches are
    already this rank's."""
    return _ResumableLoader(dataset, batch_sampler=_Batches(ctx.sampler(dataset, batch_size)), **kwargs)


class _Batches:
    """ctx.sampler as Lightning drives a batch sampler: it sets the epoch on
    `batch_sampler.sampler` (lightning.fabric.utilities.data._set_sampler_epoch), and counts
    a resumed epoch's batches from the checkpoint's position, so the length is the whole
    epoch's."""

    def __init__(self, batches: Any):
        self.batches = batches
        self.sampler = _Epochs(batches)

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return self.batches.steps_per_epoch


class _Epochs:
    def __init__(self, batches: Any):
        self.set_epoch = batches.set_epoch


class _ResumableLoader(torch.utils.data.DataLoader):
    """A loader that says it resumes (state_dict/load_state_dict), which it does from
    ctx.step: Lightning need not warn that a mid-epoch resume is unreliable."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _checkpoint(trainer) -> dict[str, Any]:
    """Lightning's checkpoint of the fit as a dict (what Trainer.save_checkpoint writes, its
    hooks run), kept in memory by the strategy. Hyperparameters are left out: the module's
    __init__ sets them again, and they may hold objects that are not plain values."""
    trainer.save_checkpoint(TO_MEMORY, weights_only=False)
    ckpt, trainer.strategy.in_memory = trainer.strategy.in_memory, None
    for key in ("hyper_parameters", "hparams_name", "datamodule_hyper_parameters", "datamodule_hparams_name"):
        ckpt.pop(key, None)
    return ckpt


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            out[key] = float(value.detach().item())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    return out
