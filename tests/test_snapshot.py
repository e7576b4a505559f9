"""Peer snapshots of sharded state (snapshot.py): which step a recovery can go back to
(policy.choose_snapshot), the ring exchange, and a rollback that replays to the weights of
an undisturbed run, on three local Gloo processes (no Ray; the same through Ray and
outside kills is test_fsdp's)."""

import pytest
import torch

from raytrainer.config import FailureConfig, TrainerConfig
from raytrainer.config.failure import AUTO_FIRST, AUTO_MOST, auto_interval
from raytrainer.contract import Holdings
from raytrainer.errors import ConfigError
from raytrainer.worker.loop.loop import Loop
from raytrainer.worker.loop.settings import LoopSettings, Outlets
from raytrainer.driver.policy import SnapshotChoice, choose_snapshot
from raytrainer.worker.state import snapshot as snapshot_module
from raytrainer.worker.state.snapshot import PeerSnapshots, check_memory

from .dist_procs import run_ranks
from .tasks import RegressionTask


def held(world, own, peer):
    return {r: Holdings(r, world, tuple(own[r]), tuple(peer[r])) for r in own}


def test_a_lost_rank_goes_back_to_the_newest_step_its_successor_holds_a_copy_of():
    # Rank 2 had taken its snapshot of step 8 but not yet received rank 1's: step 4 serves.
    survivors = held(3, own={0: [4, 8], 2: [4, 8]}, peer={0: [4, 8], 2: [4]})
    assert choose_snapshot(3, [1], survivors) == SnapshotChoice(4)
    survivors = held(3, own={0: [8], 2: [8]}, peer={0: [8], 2: [8]})
    assert choose_snapshot(3, [1], survivors) == SnapshotChoice(8)


def test_a_rank_lost_with_the_peer_holding_its_copy_leaves_no_snapshot():
    choice = choose_snapshot(3, [1, 2], held(3, own={0: [8]}, peer={0: [8]}))
    assert choice.step is None and "rank 1 was lost together with rank 2" in choice.why
    # Ranks 2 and 0 are neighbours in the ring too (0 holds 2's copy).
    choice = choose_snapshot(3, [0, 2], held(3, own={1: [8]}, peer={1: [8]}))
    assert choice.step is None and "rank 2 was lost together with rank 0" in choice.why


def test_a_copy_secured_in_an_earlier_attempt_serves_and_the_world_size_must_match():
    # Attempt 1 secured rank 1's copy of step 8; rank 1's replacement (fresh, no snapshots
    # of its own) survives, and rank 2 is lost now: 0 survives, 2's copy is on 0.
    survivors = {0: Holdings(0, 3, (8,), (8,)), 1: Holdings(0, 1, (), ())}  # 1: fresh, never in a group
    assert choose_snapshot(3, [2], survivors, secured={1: 8}) == SnapshotChoice(8)
    assert choose_snapshot(3, [2], survivors).step is None
    choice = choose_snapshot(3, [1], {0: Holdings(0, 2, (8,), (8,)), 2: Holdings(2, 2, (8,), ())})
    assert choice.step is None and "world size 2" in choice.why


def test_snapshots_that_would_not_fit_in_memory_are_a_config_error_naming_the_setting():
    with pytest.raises(ConfigError, match=r"failure.snapshot_every_n_steps=0"):
        check_memory(2**30, 2, "failure.snapshot_every_n_steps", available=4 * 2**30)
    with pytest.warns(UserWarning, match="over half"):
        check_memory(2**28, 2, "failure.snapshot_every_n_steps", available=3 * 2**30)
    check_memory(2**20, 2, "failure.snapshot_every_n_steps", available=3 * 2**30)
    with pytest.raises(ConfigError, match="snapshot_every_n_steps=-1 must be >= 0"):
        FailureConfig(snapshot_every_n_steps=-1)
    with pytest.raises(ConfigError, match="snapshot_every_n_steps='often' must be >= 0 .* or auto"):
        FailureConfig(snapshot_every_n_steps="often")


def test_auto_snapshots_as_often_as_two_percent_of_the_time_allows():
    assert FailureConfig().snapshot_every_n_steps == "auto"
    # A snapshot costing 5 ms against steps of 65 ms: every 4 steps (5 / 260 = 1.9%).
    assert auto_interval(AUTO_FIRST, 0.005, 0.065) == AUTO_FIRST  # 4 is not under two thirds of 5: kept
    assert auto_interval(10, 0.005, 0.065) == 4 and auto_interval(3, 0.005, 0.065) == 3
    assert auto_interval(2, 0.005, 0.065) == 4
    assert auto_interval(10, 0.12, 0.4) == 10 and auto_interval(5, 0.12, 0.4) == 15  # 100 MB at 0.4 s a step
    assert auto_interval(3, 1e-6, 1.0) == 1 and auto_interval(3, 600.0, 0.01) == AUTO_MOST
    assert auto_interval(7, 0.005, 0.0) == 7  # no step time measured yet


CFG = {"global_batch_size": 24, "micro_batch_size": 4, "grad_clip_norm": 0.5, "ema_decay": 0.9,
       "val_every_n_steps": 3, "strategy": "fsdp"}


def _loop(rank, world, steps, snapshots=None, state=None):
    cfg = TrainerConfig(max_steps=steps, **CFG)
    return Loop(RegressionTask(dropout=0.1), LoopSettings(trainer=cfg), Outlets(snapshots=snapshots), rank=rank,
                world_size=world, device=torch.device("cpu"), state=state)


def _straight(rank, world, steps):
    return _loop(rank, world, steps).fit()


def _roll_back(rank, world, stop_at, steps):
    """Train to `stop_at` with snapshots every 2 steps, then, as a recovery does, build the
    state anew: rank 1 (the "replacement") from the copy rank 2 holds, the others from their
    own, and train on to `steps`."""
    import torch.distributed as dist

    snapshots = PeerSnapshots(every_n_steps=2)
    _loop(rank, world, stop_at, snapshots).fit()
    snapshots.wait()
    holdings = snapshots.holdings()
    copies = [None] * world
    dist.all_gather_object(copies, snapshots.peer_snapshot(holdings.peer[-1]))
    back = max(holdings.own)
    state = copies[2] if rank == 1 else snapshots.own_snapshot(back)
    snapshots.close()
    loop = _loop(rank, world, steps, PeerSnapshots(every_n_steps=2), state=state)
    return holdings, copies[2].rank, loop.step, loop.fit()


def test_going_back_to_peer_snapshots_replays_to_an_undisturbed_runs_weights():
    """FSDP on 3 ranks, with dropout, accumulation, clipping and EMA. Snapshots come at the
    first step boundary and every 2 steps; each rank keeps its own and rank - 1's of the
    newest step. Going back from step 5 to step 4 (rank 1 from the copy on rank 2) and
    replaying ends bit-identical to training straight through."""
    ranks = run_ranks(_roll_back, 3, 5, 7)
    for rank, (holdings, copy_of, start, _) in enumerate(ranks):
        assert (holdings.rank, holdings.world_size, holdings.own, holdings.peer) == (rank, 3, (4,), (4,))
        assert copy_of == 1 and start == 4
    straight = run_ranks(_straight, 3, 7)[0]
    rolled = ranks[0][3]
    assert rolled.keys() == straight.keys() and all(torch.equal(rolled[k], straight[k]) for k in straight)


def _auto(rank, world, steps, slow_copy_s):
    """FSDP with snapshot_every_n_steps auto, steps of >= 40 ms; rank 1's copies of its state
    take `slow_copy_s` longer than the others'. The steps snapshotted, the pair each take
    read (agreed by the exchange before it), and the events rank 0 was given."""
    import time

    snapshots, taken, events = PeerSnapshots("auto"), [], []
    take = snapshots.take
    copy = snapshot_module.to_cpu

    def recording(step, state):
        taken.append((step, snapshots.agreed))
        return take(step, state)

    def slow(state):
        time.sleep(slow_copy_s if rank == 1 else 0)
        return copy(state)

    snapshots.take, snapshot_module.to_cpu = recording, slow
    cfg = TrainerConfig(max_steps=steps, **CFG)
    loop = Loop(RegressionTask(sleep_s=0.04), LoopSettings(trainer=cfg),
                Outlets(snapshots=snapshots, notify=events.append), rank=rank, world_size=world,
                device=torch.device("cpu"))
    loop.fit()
    snapshots.wait()
    return taken, [e for e in events if e["event"] == "snapshot_interval"]


def test_auto_interval_is_agreed_by_every_rank_from_the_slowest_ranks_cost():
    """failure.snapshot_every_n_steps auto on 3 ranks: snapshots at the first step boundary,
    then AUTO_FIRST steps apart until a step time is measured, then at the interval each
    take computes from the means agreed by the exchanges before it. Rank 1's copy is 300 ms
    slower: every rank's agreed cost includes it (the MAX), so every rank snapshots at the
    same steps, and rank 0 logs each interval chosen."""
    ranks = run_ranks(_auto, 3, 60, 0.3)
    steps = [[step for step, _ in taken] for taken, _ in ranks]
    assert steps[0] == steps[1] == steps[2], steps
    assert steps[0][:3] == [1, 1 + AUTO_FIRST, 1 + 2 * AUTO_FIRST]
    every, changes = AUTO_FIRST, []
    for (step, pair), (after, _) in zip(ranks[0][0][2:], ranks[0][0][3:] + [(None, None)]):
        if auto_interval(every, *pair) != every:
            every = auto_interval(every, *pair)
            changes.append((step, every))
        assert after is None or after - step == every
    for taken, _ in ranks:
        assert [pair for _, pair in taken] == [pair for _, pair in ranks[0][0]]  # the same on every rank
        assert taken[0][1] is taken[1][1] is None and all(pair[0] >= 0.3 for _, pair in taken[2:])
    # 300 ms against 2% of a step: an interval over 1.5 x AUTO_FIRST while a step takes under
    # 2 s. (With 30 ms, under 0.2 s: a slow day's steps of 40 ms of sleep, 3 ranks on 2 loaded
    # cores, took longer, and no interval changed.)
    assert changes and [(e["step"], e["steps"]) for e in ranks[0][1]] == changes
    assert not ranks[1][1] and not ranks[2][1]  # rank 0's alone


def test_the_auto_interval_follows_the_agreed_cost_of_a_copy():
    """The decision snapshot_every_n_steps: auto and ctx.state_due (the integrations'
    state_every="auto") share: AUTO_FIRST steps until a step time is agreed, then the
    interval at which copies take AUTO_BUDGET of the time."""
    from raytrainer.worker.state.snapshot import AutoInterval

    interval = AutoInterval()
    assert interval.due(1)
    assert interval.taken(1, now=100.0) == (0.0, None)
    assert [s for s in range(2, 12) if interval.due(s)] == list(range(1 + AUTO_FIRST, 12))
    step_s, _ = interval.taken(1 + AUTO_FIRST, now=100.0 + AUTO_FIRST * 0.01)
    assert step_s == pytest.approx(0.01)
    interval.agree(cost_s=0.0001, step_s=step_s)  # cheap: every step
    assert interval.taken(11, now=100.1)[1] == AUTO_FIRST and interval.every == 1
    interval.agree(cost_s=0.9999, step_s=0.01)  # the means: a copy costs 50 steps
    interval.taken(12, now=100.11)
    assert interval.every == auto_interval(1, 0.5, 0.01) == AUTO_MOST
    interval.reset()  # a new group measures anew
    assert interval.every == AUTO_FIRST and interval.agreed is None and interval.due(0)
