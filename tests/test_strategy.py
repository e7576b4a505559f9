"""The loop with trainer.strategy=fsdp on two local Gloo processes (no Ray): a task's own
sharding, and validation over shards of unequal length."""

import pytest
import torch

from raytrainer.config import TrainerConfig
from raytrainer.loop import Loop

from .dist_procs import run_ranks
from .tasks import RegressionTask


class ShardsItself(RegressionTask):
    """Shards only the last Linear as a unit (then the root), as Task.shard may."""

    def __init__(self, forget_root=False, **kwargs):
        super().__init__(**kwargs)
        self.forget_root = forget_root

    def shard(self, model, mesh):
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[3], mesh=mesh)
        if not self.forget_root:
            fully_shard(model, mesh=mesh)


def _train(rank, world, task, strategy, **trainer):
    rows = []
    cfg = TrainerConfig(max_steps=4, global_batch_size=16, val_every_n_steps=4, strategy=strategy, **trainer)
    loop = Loop(task, cfg, rank=rank, world_size=world, device=torch.device("cpu"), report=rows.extend)
    weights = loop.fit()
    return weights, rows, type(loop.module).__name__


def test_a_tasks_own_sharding_trains_and_validates_every_sample_once():
    """65 validation samples over 2 ranks: 33 and 32, 5 and 4 batches of 8. The sharded
    forward is a collective, so rank 1 runs a fifth, uncounted batch; the mean sample
    index (0..64) shows every sample counted once."""
    task = ShardsItself(val_samples=65)
    ranks = run_ranks(_train, 2, task, "fsdp", micro_batch_size=8)
    (weights, rows, kind), (none, others, _) = ranks
    assert kind.startswith("FSDP") and none is None and others == []
    val = [r for r in rows if "val_index" in r]
    assert len(val) == 1 and val[0]["val_index"] == pytest.approx(32.0)
    alone = run_ranks(_train, 1, RegressionTask(val_samples=65), "ddp", micro_batch_size=8)[0]
    assert all(torch.allclose(weights[k], alone[0][k], atol=1e-5) for k in weights)
    assert val[0]["val_loss"] == pytest.approx([r for r in alone[1] if "val_loss" in r][0]["val_loss"], rel=1e-5)


def test_a_shard_hook_that_leaves_the_root_unsharded_is_a_task_error():
    with pytest.raises(Exception) as err:
        run_ranks(_train, 2, ShardsItself(forget_root=True), "fsdp")
    assert "TaskError" in str(err.value) and "to the model itself" in str(err.value)


def _pause(rank, world, storage):
    from raytrainer.checkpoint import Checkpoints, Storage
    from raytrainer.config import CheckpointConfig

    cfg = TrainerConfig(max_steps=6, global_batch_size=16, strategy="fsdp")
    checkpoints = Checkpoints(Storage(storage), "run", CheckpointConfig())
    loop = Loop(RegressionTask(), cfg, rank=rank, world_size=world, device=torch.device("cpu"),
                report=lambda rows: None, checkpoints=checkpoints)
    loop.pause_requested = rank == 0  # the driver asked rank 0; every rank learns it in a reduction
    assert loop.fit() is None and loop.paused
    return loop.step, [(c.step, c.manifest["format"]) for c in checkpoints.committed()]


def _resume(rank, world, uri, steps):
    cfg = TrainerConfig(max_steps=steps, global_batch_size=16, strategy="fsdp")
    loop = Loop(RegressionTask(), cfg, rank=rank, world_size=world, device=torch.device("cpu"),
                report=lambda rows: None, state=uri)
    start = loop.step
    return start, loop.fit()


def test_a_sharded_run_that_pauses_for_a_resize_leaves_a_checkpoint_the_new_size_reshards(tmp_path):
    """What the driver restarts a resized FSDP run from: the workers, paused at a common
    step, have written a sharded checkpoint of it; 3 workers load it and end where 2
    workers training straight through do."""
    paused = run_ranks(_pause, 2, str(tmp_path))
    step = paused[0][0]
    assert paused[1][0] == step and 1 <= step < 6 and paused[0][1] == [(step, "dcp")]
    uri = str(tmp_path / "run" / "checkpoints" / f"step-{step:08d}")
    resumed = run_ranks(_resume, 3, uri, 6)
    assert [start for start, _ in resumed] == [step] * 3
    straight = run_ranks(_resume, 2, None, 6)[0][1]
    assert all(torch.allclose(resumed[0][1][k], straight[k], atol=1e-5) for k in straight)


def test_resuming_with_another_strategy_than_the_checkpoints_is_a_config_error(tmp_path):
    from raytrainer.errors import ConfigError

    cfg = TrainerConfig(max_steps=2, global_batch_size=16)
    with pytest.raises(ConfigError, match="is sharded .* this run has trainer.strategy=ddp"):
        Loop(RegressionTask(), cfg, rank=0, world_size=1, device=torch.device("cpu"), report=lambda rows: None,
             state=str(tmp_path / "step-00000002"))
