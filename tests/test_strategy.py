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
