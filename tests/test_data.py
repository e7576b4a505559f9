import pytest
import torch

from raytrainer.data import BatchPlan, batch_size_of, fetch, val_shard
from raytrainer.errors import ConfigError


def step_samples(plan, epoch, step):
    """All samples of one optimizer step, over every rank and micro-batch, in order."""
    position = step * plan.global_batch_size
    return torch.cat([torch.cat(plan.micro_batches(epoch, position, r)) for r in range(plan.world_size)])


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
    counts = {len(plan.micro_batches(0, 5 * 48, r)) for r in range(3)}
    assert counts == {4}


@pytest.mark.parametrize("world, micro", [(3, 8), (5, 5), (7, 2), (24, 1), (5, 100)])
def test_uneven_splits_keep_the_samples_and_weigh_them_alike(world, micro):
    """Where the world size does not divide the batch (an elastic run at 5 of 24), the
    step still holds the same samples, every rank runs the same number of micro-batches,
    and the loss weights (1 / divisor) sum to what a plain mean over the batch gives."""
    ref = BatchPlan(100, 25, 25, 1, seed=3)
    plan = BatchPlan(100, 25, micro, world, seed=3)
    for step in range(plan.steps_per_epoch):
        assert torch.equal(step_samples(plan, 1, step), step_samples(ref, 1, step))
        per_rank = [plan.micro_batches(1, step * 25, r) for r in range(world)]
        assert len({len(m) for m in per_rank}) == 1 and all(len(b) > 0 for m in per_rank for b in m)
        # DDP averages over ranks the sum of each micro-batch's mean loss / divisor: that
        # must weigh every sample by 1 / 25.
        weights = [1 / plan.loss_divisor(len(b)) / world for m in per_rank for b in m]
        assert sum(weights) == pytest.approx(1.0)
        assert all(w / len(b) == pytest.approx(1 / 25) for w, b in zip(weights, (b for m in per_rank for b in m)))


def test_even_splits_divide_the_loss_by_the_accumulation_exactly():
    plan = BatchPlan(100, 24, 4, 2, seed=0)
    assert plan.accumulation == 3 and plan.loss_divisor(4) == 3.0


def test_more_workers_than_samples_in_a_batch():
    with pytest.raises(ConfigError, match="5 workers cannot share a global batch of 4"):
        BatchPlan(100, 4, 1, 5, seed=0)


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
