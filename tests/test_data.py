import pytest
import torch

from raytrainer.data import BatchPlan, batch_size_of, fetch, val_shard
from raytrainer.errors import ConfigError


def step_samples(plan, epoch, step):
    """All samples of one optimizer step, over every rank and micro-batch, in order."""
    return torch.cat([torch.cat(plan.micro_batches(epoch, step, r)) for r in range(plan.world_size)])


@pytest.mark.parametrize("world, micro", [(1, 24), (1, 4), (2, 12), (2, 3), (3, 8), (4, 2)])
def test_steps_hold_the_same_samples_at_any_world_size(world, micro):
    ref = BatchPlan(100, 24, 24, 1, seed=7)
    plan = BatchPlan(100, 24, micro, world, seed=7)
    assert plan.steps_per_epoch == 4  # 100 // 24: the remainder of 4 samples is dropped
    assert plan.accumulation * plan.micro_batch_size * world == 24
    for epoch in range(2):
        for step in range(plan.steps_per_epoch):
            assert torch.equal(step_samples(plan, epoch, step), step_samples(ref, epoch, step))


def test_an_epoch_sees_each_kept_sample_once_and_epochs_differ():
    plan = BatchPlan(50, 8, 2, 2, seed=0)
    seen = torch.cat([step_samples(plan, 0, s) for s in range(plan.steps_per_epoch)])
    assert len(seen) == 48 and len(set(seen.tolist())) == 48
    assert not torch.equal(plan.order(0), plan.order(1))
    assert torch.equal(plan.order(1), BatchPlan(50, 8, 2, 2, seed=0).order(1))
    assert not torch.equal(plan.order(0), BatchPlan(50, 8, 2, 2, seed=1).order(0))


def test_every_rank_gets_the_same_number_of_micro_batches():
    plan = BatchPlan(1000, 48, 4, 3, seed=0)
    counts = {len(plan.micro_batches(0, 5, r)) for r in range(3)}
    assert counts == {4}


def test_dataset_smaller_than_a_global_batch():
    with pytest.raises(ConfigError, match="8 samples, fewer than one global batch"):
        BatchPlan(8, 32, 16, 2, seed=0)


def test_val_shards_cover_every_sample_once():
    shards = [val_shard(11, r, 3) for r in range(3)]
    assert sorted(torch.cat(shards).tolist()) == list(range(11))


def test_fetch_and_batch_size():
    ds = torch.utils.data.TensorDataset(torch.arange(10.0), torch.arange(10))
    x, y = fetch(ds, torch.tensor([3, 1]))
    assert x.tolist() == [3.0, 1.0] and y.tolist() == [3, 1]
    items = [{"a": torch.tensor([i, i])} for i in range(5)]
    batch = fetch(items, torch.tensor([4, 0, 2]))
    assert batch["a"][:, 0].tolist() == [4, 0, 2] and batch_size_of(batch) == 3
