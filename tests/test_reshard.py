"""Re-sharding FSDP state from peer snapshots onto another world size (worker/state/reshard.py),
on local Gloo processes (no Ray; the same through Ray with kills from outside is
test_fsdp's): 4 ranks snapshot, 2 or 3 go on from every rank's snapshot, and the run ends
within float tolerance of an undisturbed one (the same global batch and sample order; only
the order of the sums over ranks differs). The same for your own loop under FSDP
(worker/userloop/loopshards.py): its report's state is put back together from every rank's pieces."""

import pytest
import torch

from raytrainer.config import TrainerConfig
from raytrainer.contract import Reshard
from raytrainer.worker.loop.loop import Loop
from raytrainer.worker.loop.settings import LoopSettings, Outlets
from raytrainer.worker.state.reshard import reshard
from raytrainer.worker.state.snapshot import PeerSnapshots

from .dist_procs import run_ranks
from .ray_procs import free_ports
from .tasks import RegressionTask

# Clipping and EMA: their state (the EMA's shadow shards) is re-sharded too. hidden=18
# gives uneven pieces (5, 5, 5, 3 over 4 ranks; the last layer's one row to rank 0 only).
CFG = {"global_batch_size": 24, "micro_batch_size": 2, "grad_clip_norm": 0.5, "ema_decay": 0.9,
       "val_every_n_steps": 3, "strategy": "fsdp"}


def _loop(rank, world, steps, snapshots=None, state=None):
    cfg = TrainerConfig(max_steps=steps, **CFG)
    return Loop(RegressionTask(hidden=18), LoopSettings(trainer=cfg), Outlets(snapshots=snapshots), rank=rank,
                world_size=world, device=torch.device("cpu"), state=state)


def _straight(rank, world, steps):
    return _loop(rank, world, steps).fit()


def _snapshotted(rank, world, stop_at):
    """Train to `stop_at` with snapshots every 2 steps; this rank's own newest snapshot."""
    snapshots = PeerSnapshots(every_n_steps=2)
    _loop(rank, world, stop_at, snapshots).fit()
    snapshots.wait()
    return snapshots.own_snapshot(max(snapshots.holdings().own))


def _resharded(rank, world, parts, steps):
    snapshots = PeerSnapshots(every_n_steps=2)
    loop = _loop(rank, world, steps, snapshots, state=Reshard(parts[0].step, tuple(parts)))
    start = loop.step
    weights = loop.fit()
    snapshots.wait()
    return start, snapshots.holdings(), weights


@pytest.mark.parametrize("world", [2])
def test_four_ranks_snapshots_go_on_at_a_smaller_world_size_within_float_tolerance(world):
    parts = run_ranks(_snapshotted, 4, 5)
    assert [p.rank for p in parts] == [0, 1, 2, 3] and {p.step for p in parts} == {4}
    ranks = run_ranks(_resharded, world, parts, 9)
    straight = run_ranks(_straight, 4, 9)[0]
    for rank, (start, holdings, _) in enumerate(ranks):
        assert start == 4
        # The new group snapshots at once (its first step boundary) and every 2 steps after:
        # no shard is left with a single copy longer than an exchange.
        assert (holdings.rank, holdings.world_size) == (rank, world) and holdings.own == (8,)
    resumed = ranks[0][2]
    assert resumed.keys() == straight.keys()
    for k in straight:
        torch.testing.assert_close(resumed[k], straight[k], rtol=1e-5, atol=1e-6)


def test_a_grow_reshards_two_ranks_snapshots_onto_four():
    parts = run_ranks(_snapshotted, 2, 5)
    ranks = run_ranks(_resharded, 4, parts, 9)
    straight = run_ranks(_straight, 2, 9)[0]
    for k in straight:
        torch.testing.assert_close(ranks[0][2][k], straight[k], rtol=1e-5, atol=1e-6)


def test_snapshots_that_do_not_fit_the_state_are_refused_with_the_key():
    template = {"model": {"w": torch.zeros(3)}, "loop": {"step": 0}}
    with pytest.raises(ValueError, match=r"state.model.*rank 1's snapshot"):
        reshard(template, [{"model": {"w": torch.ones(3)}, "loop": {"step": 4}}, {"model": {}, "loop": {}}])
    filled = reshard(template, [{"model": {"w": torch.ones(3)}, "loop": {"step": 4}}] * 2)
    assert filled["loop"] == {"step": 4} and torch.equal(template["model"]["w"], torch.ones(3))


def _offsets_after_renumbering(rank, world):
    """Shard a layer, then form the group again with the ranks turned one place (as a
    survivor of a re-shard is renumbered) and shard a new layer: its offset must be the new
    rank's, not the one this process had in the first group."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from raytrainer.worker.state.sharded import default_mesh

    def offset():
        weight = fully_shard(torch.nn.Linear(4, 4 * world), mesh=default_mesh("cpu")).weight
        return compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)[1][0]

    before = offset()
    port = [None]
    if rank == 0:
        port = free_ports(1)
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    new = (rank + 1) % world
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port[0]}", rank=new, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    return before, new, offset()


def test_a_renumbered_rank_shards_at_its_new_offset():
    for rank, (before, new, after) in enumerate(run_ranks(_offsets_after_renumbering, 3)):
        assert before == 4 * rank and after == 4 * new


# ---------------------------------------------------------------------- your own loop


class _KeepingStep(PeerSnapshots):
    """Peer snapshots that also keep this rank's own snapshot of one step, once exchanged."""

    def __init__(self, every_n_steps, step):
        super().__init__(every_n_steps)
        self.step, self.kept = step, None

    def wait(self):
        super().wait()
        if self.kept is None and self.step in self.own:
            self.kept = self.own_snapshot(self.step)


def _user_loop(rank, world, steps, snapshots, state=None):
    """tests.tasks.sharded_regression_loop to `steps`, state reported every 3 steps; no
    dropout (its masks are drawn per rank, so they differ by world size)."""
    from functools import partial

    from raytrainer.config import load_config
    from raytrainer.worker.userloop.userloop import UserLoop

    from .tasks import sharded_regression_loop

    config = load_config({"task": {"loop": "tests.tasks:sharded_regression_loop"},
                          "trainer": {"global_batch_size": 24, "max_steps": steps, "strategy": "fsdp"}})
    fn = partial(sharded_regression_loop, steps=steps, state_every=3, dropout=0.0)
    loop = UserLoop(fn, config, rank=rank, world_size=world, device=torch.device("cpu"), report=lambda rows: None,
                    notify=lambda event: None, checkpoints=None, state=state, snapshots=snapshots)
    return loop.step, loop.fit()


def _loop_straight_and_snapshotted(rank, world, steps, at):
    """A loop run to `steps`, with this rank's snapshot of step `at` kept on the way."""
    snapshots = _KeepingStep(1, at)
    _, weights = _user_loop(rank, world, steps, snapshots)
    return snapshots.kept, weights


def _loop_resharded(rank, world, parts, steps):
    return _user_loop(rank, world, steps, PeerSnapshots(1), state=Reshard(parts[0].step, tuple(parts)))


def test_your_loops_sharded_state_goes_on_at_another_world_size_within_float_tolerance():
    """Two ranks' pieces of step 6 (a (1, 16) layer: rank 1's piece of it is empty), put back
    together and cut for three (6, 5, 5 rows; the layer to rank 0): the loop goes on from
    ctx.state at step 6 and ends within float tolerance of the two ranks' undisturbed run."""
    two = run_ranks(_loop_straight_and_snapshotted, 2, 12, 6)
    parts = [kept for kept, _ in two]
    assert [(p.rank, p.step) for p in parts] == [(0, 6), (1, 6)]
    three = run_ranks(_loop_resharded, 3, parts, 12)
    assert [start for start, _ in three] == [6, 6, 6]
    resumed, straight = three[0][1], two[0][1]
    assert resumed.keys() == straight.keys()
    for k in straight:
        torch.testing.assert_close(resumed[k], straight[k], rtol=1e-5, atol=1e-6)
