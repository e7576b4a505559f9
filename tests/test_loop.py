"""The loop on one rank, in-process: no Ray, no process group."""

import time

import pytest
import torch

from raytrainer.config import TrainerConfig
from raytrainer.errors import ConfigError, TaskError
from raytrainer.worker.loop.loop import Loop
from raytrainer.worker.loop.settings import LoopSettings, Outlets

from .tasks import RegressionTask


def make_loop(task=None, rows=None, **trainer):
    trainer.setdefault("max_steps", 4)
    cfg = TrainerConfig(global_batch_size=32, **trainer)
    sink = rows if rows is not None else []
    return Loop(task or RegressionTask(), LoopSettings(trainer=cfg), Outlets(report=sink.extend), rank=0, world_size=1,
                device=torch.device("cpu"))


def test_one_row_per_step_then_validation():
    rows = []
    loop = make_loop(rows=rows, max_steps=5, log_every_n_steps=2)
    loop.fit()
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
    assert all(r["world_size"] == 1 and r["epoch"] == 0 and r["lr"] == 0.05 for r in train)
    assert "val_loss" in rows[-1] and rows[-1]["step"] == 5  # the run's last step validates
    assert train[-1]["loss"] < train[0]["loss"]


def test_validation_metrics_are_weighted_by_sample_count():
    rows = []
    # 10 validation samples in micro-batches of 4: 4 + 4 + 2. The weighted mean of the
    # sample index is 4.5; a plain mean of the three batch means would be 5.17.
    loop = make_loop(RegressionTask(val_samples=10), rows, micro_batch_size=4, max_steps=1)
    loop.fit()
    assert rows[-1]["val_index"] == pytest.approx(4.5)


def test_accumulation_gives_the_same_weights_as_one_big_batch():
    full = make_loop(max_steps=6)
    accumulated = make_loop(max_steps=6, micro_batch_size=4)
    assert accumulated.plan.accumulation == 8
    a, b = full.fit(), accumulated.fit()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)


def test_epochs_and_max_steps_pick_the_earlier_end():
    loop = make_loop(max_steps=100, max_epochs=2)  # 256 samples / 32 = 8 steps per epoch
    assert loop.total_steps == 16
    rows = []
    make_loop(rows=rows, max_steps=None, max_epochs=2).fit()
    val = [r for r in rows if "val_loss" in r]
    assert [(r["step"], r["epoch"]) for r in val] == [(8, 0), (16, 1)]


def test_val_every_n_steps():
    rows = []
    make_loop(rows=rows, max_steps=7, val_every_n_steps=3).fit()
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6, 7]


def test_train_step_without_loss_is_a_clear_error():
    with pytest.raises(TaskError, match="must return a dict with 'loss'"):
        make_loop(RegressionTask(no_loss=True)).fit()


def per_worker_loop(rows=None, base_world_size=2, state=None, max_world_size=None, **trainer):
    """A rank alone (world size 1) under the per_worker batch policy, its batch and LR
    given for `base_world_size` workers (scaling.num_workers)."""
    cfg = TrainerConfig(global_batch_size=32, batch_policy="per_worker", **trainer)
    sink = rows if rows is not None else []
    settings = LoopSettings(trainer=cfg, base_world_size=base_world_size, max_world_size=max_world_size)
    return Loop(RegressionTask(num_samples=100), settings, Outlets(report=sink.extend), rank=0, world_size=1,
                device=torch.device("cpu"), state=state)


def test_per_worker_policy_keeps_the_worker_batch_and_scales_the_lr():
    """One worker of a run tuned for 2: a global batch of 16 (its own share of 32) at half
    the LR, for whole epochs of 100 // 16 = 6 steps, whatever the schedule's estimate."""
    rows = []
    loop = per_worker_loop(rows, max_epochs=2)
    assert (loop.plan.global_batch_size, loop.lr_scale) == (16, 0.5)
    assert loop.total_steps == 2 * (100 // 32)  # the LR schedule's length, at 2 workers
    weights = loop.fit()
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 13)) and loop.step == 12
    assert {r["lr"] for r in train} == {0.025}
    assert loop.optimizer.param_groups[0]["lr"] == 0.05  # the optimizer keeps its own LR

    # The same maths as a fixed batch of 16 at the LR scaled by hand.
    fixed = Loop(RegressionTask(num_samples=100, lr=0.025),
                 LoopSettings(trainer=TrainerConfig(global_batch_size=16, max_epochs=2)),
                 rank=0, world_size=1, device=torch.device("cpu"))
    expected = fixed.fit()
    assert all(torch.equal(weights[k], expected[k]) for k in weights)


def test_a_survivors_state_carries_its_recent_rows_for_a_new_rank_0_to_send_again():
    """Rank 0 may die holding rows the driver has not read: the state a survivor gives
    holds the newest rows (every rank keeps them), and a loop that goes on from it as
    rank 0 sends them again before its own (the driver keeps the first of each step). A
    checkpoint holds none: a resume's driver has them."""
    survivor = per_worker_loop(max_steps=5, val_every_n_steps=4)
    survivor.fit()
    given = survivor.state_dict()
    assert [(r["step"], "val_loss" in r) for r in given["loop"]["rows"]] == [
        (1, False), (2, False), (3, False), (4, False), (4, True), (5, False), (5, True)]
    assert survivor.checkpoint_state()["loop"]["rows"] == []
    rows = []
    per_worker_loop(rows, state=given, max_steps=6).fit()
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]
    rows = []
    per_worker_loop(rows, state=survivor.checkpoint_state(), max_steps=6).fit()
    assert [r["step"] for r in rows if "loss" in r] == [6]


def test_a_batch_that_outgrows_the_rest_of_the_epoch_ends_it():
    """The data position is a sample offset: state taken at 5 x 16 = 80 of 100 samples,
    resumed where the global batch is 32, leaves 20 < 32, so epoch 0 ends (validated)
    before the next step, which starts epoch 1 at offset 0."""
    small = per_worker_loop(max_steps=5)
    small.fit()
    assert (small.epoch, small.position) == (0, 80)
    rows = []
    big = per_worker_loop(rows, base_world_size=1, state=small.checkpoint_state(), max_steps=6)
    assert big.plan.global_batch_size == 32 and (big.epoch, big.position) == (0, 80)
    big.fit()
    assert [(r["step"], r["epoch"], "val_loss" in r) for r in rows] == [
        (5, 0, True), (6, 1, False), (6, 1, True)]
    assert (big.epoch, big.position) == (1, 32)


def test_a_batch_too_big_for_the_data_at_max_workers_fails_at_the_start():
    """per_worker: 16 samples a worker, 7 workers at most: 112 > 100 samples. That is a
    config error before training, not a failure when the seventh worker arrives."""
    assert per_worker_loop(max_steps=1, max_world_size=6).plan.global_batch_size == 16
    with pytest.raises(ConfigError, match="100 samples, fewer than one global batch of 112"):
        per_worker_loop(max_steps=1, max_world_size=7)


def test_a_worker_taken_while_it_builds_ahead_leaves_its_object_store_alone(tmp_path, monkeypatch):
    """A worker warms its node's object store for the hand-over once it has built ahead,
    unless its setup took the state meanwhile: the hand-over has happened, and the put
    would take cores from its first step."""
    import threading

    from raytrainer.config import load_config
    from raytrainer.worker.process import warm
    from raytrainer.worker.process.actor import _WarmUp

    cfg = load_config({"task": {"target": "tests.tasks:RegressionTask"}, "trainer": {"max_steps": 4},
                       "scaling": {"num_workers": 1}, "run": {"name": "r", "storage": str(tmp_path)}})
    gate, touched, taken = threading.Event(), [], []
    monkeypatch.setattr(warm, "prebuild", lambda config, build=warm.prebuild: gate.wait(30) and build(config))
    monkeypatch.setattr(warm, "touch_object_store", touched.append)
    building = _WarmUp(cfg, spare=False)
    setup = threading.Thread(target=lambda: taken.append(building.take()))
    setup.start()
    while not building._taken:
        time.sleep(0.01)
    gate.set()
    setup.join(30)
    building.wait(building.warmed)
    assert taken and taken[0] is not None and touched == []
    ahead = _WarmUp(cfg, spare=False)  # built before setup asks: the store is warmed
    ahead.wait(ahead.warmed)
    assert len(touched) == 1 and touched[0] is ahead.take()


def test_a_training_state_built_ahead_is_the_one_setup_builds_and_a_loaded_state_goes_on_over_it(tmp_path):
    """A spare, a replacement or a newcomer builds the task's model and optimizer as it
    starts (worker/process/warm.py), and its setup adopts them where it loads a survivor's state."""
    from raytrainer.config import load_config
    from raytrainer.worker.state.transfer import pack
    from raytrainer.worker.process.warm import adopt, prebuild

    cfg = load_config({"task": {"target": "tests.tasks:RegressionTask"},
                       "trainer": {"max_steps": 4, "global_batch_size": 32},
                       "scaling": {"num_workers": 1}, "run": {"name": "r", "storage": str(tmp_path)}})
    settings, cpu = LoopSettings.of(cfg), torch.device("cpu")
    ahead = prebuild(cfg)
    fresh = Loop(ahead.task, settings, rank=0, world_size=1, device=cpu)  # what a setup without it builds
    assert all(torch.equal(a, b) for a, b in zip(ahead.train.module.parameters(), fresh.module.parameters()))

    trained = Loop(RegressionTask(), settings, rank=0, world_size=1, device=cpu)
    trained.fit()
    state = trained.state_dict()
    assert adopt(ahead, pack(state), cpu) is ahead and adopt(ahead, b"torch.save'd", cpu) is ahead
    # Nothing to load (a fresh start), a sharded checkpoint's URI, a GPU: built anew.
    assert adopt(ahead, None, cpu) is adopt(ahead, "file:///ckpt", cpu) is adopt(ahead, state, torch.device("cuda")) is None
    # Its optimizer holds its state's memory already (SGD's momentum): the load copies into it.
    held = [s["momentum_buffer"] for s in ahead.train.optimizer.state.values()]
    assert held and all(b.abs().sum() == 0 for b in held)
    assert ahead.nbytes == 2 * sum(p.nbytes for p in ahead.train.module.parameters())
    taken = Loop(ahead.task, settings, rank=0, world_size=1, device=cpu, state=state, prebuilt=ahead)
    assert taken.module is ahead.train.module and taken.optimizer is ahead.train.optimizer
    assert taken.step == 4 and all(torch.equal(a, b) for a, b in zip(taken.module.parameters(),
                                                                      trained.module.parameters()))
    loaded = [taken.optimizer.state[p]["momentum_buffer"] for p in taken.module.parameters()]
    assert [b.data_ptr() for b in loaded] == [b.data_ptr() for b in held]
    assert all(torch.equal(taken.optimizer.state[p]["momentum_buffer"], trained.optimizer.state[q]["momentum_buffer"])
               for p, q in zip(taken.module.parameters(), trained.module.parameters()))
    # Built for another largest world size (SyncBatchNorm is decided by it): not taken.
    other = prebuild(cfg)
    other.most_world_size = 2
    assert Loop(other.task, settings, rank=0, world_size=1, device=cpu, state=state,
                prebuilt=other).module is not other.train.module
