"""Per-step metrics under DDP on two local Gloo processes (no Ray): each step's metrics
ride on its gradient all-reduce (state/carrier.py: Carrier), and give what a collective of their own
gave, without touching the gradients."""

import time

import pytest
import torch
import torch.distributed as dist

from raytrainer.config import TrainerConfig
from raytrainer.contract import COMPUTE_KEY
from raytrainer.worker.loop.loop import Loop
from raytrainer.worker.loop.settings import LoopSettings, Outlets
from raytrainer.worker.state.strategy import DDP

from .dist_procs import run_ranks
from .tasks import RegressionTask


def _train(rank, world, how, **trainer):
    if how == "hookless":  # DDP as it comes: the metrics take the window's all-reduce
        torch.nn.parallel.DistributedDataParallel.register_comm_hook = lambda *args: None
    rows = []
    cfg = TrainerConfig(max_steps=7, global_batch_size=16, **trainer)
    loop = Loop(RegressionTask(), LoopSettings(trainer=cfg), Outlets(report=rows.extend), rank=rank, world_size=world,
                device=torch.device("cpu"))
    if how == "hookless":
        loop.strategy.carrier = None
    carried = loop.strategy.carrier is not None
    weights = loop.fit()
    return weights, rows, carried


@pytest.mark.parametrize("nonfinite", ["stop", "off"])
def test_carried_metrics_match_a_window_reduction_and_leave_the_weights_bit_identical(nonfinite):
    """Accumulation (2 micro-batches a rank), a window of 3 steps, clipping (a norm that
    needs no reduction): the same rows, and weights equal to the bit. With the non-finite
    check off, the window holds each step's carried sums as they came, on the device, until
    its flush: each step's must be its own, not a view of memory a later step reuses."""
    trainer = dict(micro_batch_size=4, log_every_n_steps=3, grad_clip_norm=0.5, nonfinite=nonfinite)
    (weights, rows, carried), (none, others, _) = run_ranks(_train, 2, "carried", **trainer)
    (reference, expected, hooked), _ = run_ranks(_train, 2, "hookless", **trainer)
    assert carried and not hooked and none is None and others == []
    assert all(torch.equal(weights[k], reference[k]) for k in reference)
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 8))
    times = [r.pop(COMPUTE_KEY) for r in train]  # each rank's own compute time, carried too
    assert all(len(t) == 2 and all(x > 0 for x in t) for t in times)
    drop = ("time", "samples_per_s")  # wall-clock fields
    assert [{k: v for k, v in r.items() if k not in drop} for r in rows] == \
        [{k: v for k, v in r.items() if k not in drop} for r in expected]


def _pause(rank, world, log_every):
    cfg = TrainerConfig(max_steps=20, global_batch_size=16, log_every_n_steps=log_every)
    loop = Loop(RegressionTask(), LoopSettings(trainer=cfg), rank=rank, world_size=world, device=torch.device("cpu"))
    loop.pause_requested = rank == 1  # the driver asked rank 1 only
    assert loop.strategy.carrier is not None
    assert loop.fit() is None and loop.paused
    return loop.step


def test_a_pause_asked_of_one_rank_stops_every_rank_at_the_same_step():
    assert run_ranks(_pause, 2, 1) == [1, 1]  # learnt in step 1's own all-reduce
    assert run_ranks(_pause, 2, 4) == [4, 4]  # at the end of the first window


def _carry(rank, world):
    """One DDP backward carrying three metrics: what the hook gave and what a plain
    all-reduce of the same metrics gives."""
    torch.manual_seed(0)  # the same weights everywhere (DDP broadcasts rank 0's anyway)
    strategy = DDP(TrainerConfig(max_steps=1, global_batch_size=16), world)
    model = strategy.wrap(torch.nn.Linear(64, 3), world, torch.device("cpu"))  # one bucket of 195
    inputs = torch.Generator().manual_seed(rank)
    metrics = torch.randn(3, generator=inputs)  # values whose 3-term sums depend on the order
    started = time.perf_counter() - rank  # rank r has computed r seconds longer
    strategy.carrier.send(metrics, pause_requested=rank == 1, world_size=world, rank=rank, started=started)
    model(torch.randn(8, 64, generator=inputs)).square().mean().backward()
    plain = torch.cat([metrics, torch.tensor([float(rank == 1)])])
    dist.all_reduce(plain)
    carried = strategy.carrier.receive()
    return torch.cat([carried[:3], carried[-1:]]), plain, carried[3:-1]


@pytest.mark.parametrize("world", [2, 3])
def test_metrics_carried_by_the_gradient_all_reduce_equal_a_plain_all_reduce_of_them(world):
    carried, plain, times = run_ranks(_carry, world)[0]
    assert plain[-1] == 1  # rank 1's pause flag, summed
    # one column per rank, its own compute time (the others sent zero): about r seconds for rank r
    assert [round(t) for t in times.tolist()] == list(range(world)) and times[0] > 0
    if world == 2:
        assert torch.equal(carried, plain)
    else:  # summed in another order (see strategy._allreduce_carrying): the last bit may differ
        torch.testing.assert_close(carried, plain, rtol=1e-6, atol=1e-6)
