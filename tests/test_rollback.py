"""trainer.nonfinite: rollback (worker/loop/rollback.py): a poisoned batch is undone by going
back to a state kept in memory and past the batches since, on every rank alike."""

import pytest
import torch

from raytrainer.config import LRScheduleConfig, TrainerConfig
from raytrainer.errors import ConfigError, NonFiniteLoss
from raytrainer.worker.loop.loop import Loop
from raytrainer.worker.loop.settings import LoopSettings, Outlets
from raytrainer.worker.state.snapshot import PeerSnapshots

from .tasks import SpikedRecordTask

# Sample 12 of 2048 falls in step 20 of the first epoch (64 steps a batch of 32), and after
# the first rollback in steps 107 and 165 of the next ones; 200 steps with a decaying LR
# reach the noise floor (about 0.0101) from anywhere.
BAD, STEPS = 12, 200


def spiked_loop(scale, events=None, rank=0, world_size=1, every=4, peer=False, **trainer):
    trainer = {"max_steps": STEPS, "global_batch_size": 32, "lr_schedule": LRScheduleConfig(), **trainer}
    task = SpikedRecordTask(num_samples=2048, val_samples=0, bad_sample=BAD, scale=scale)
    notify = events.append if events is not None else (lambda event: None)
    return Loop(task, LoopSettings(trainer=TrainerConfig(**trainer), snapshot_every_n_steps=every),
                Outlets(notify=notify, snapshots=PeerSnapshots(every) if peer else None), rank=rank, world_size=world_size, device=torch.device("cpu"))


def clean_loss(module):
    """The mean squared error over the clean training set."""
    x, y, _ = SpikedRecordTask(num_samples=2048, scale=1).train_dataset().tensors
    with torch.no_grad():
        return torch.nn.functional.mse_loss(module(x), y).item()


def rolled_back(events):
    return [(e["step"], e["to_step"], e["skipped_batches"]) for e in events if e["event"] == "rolled_back"]


def test_a_spike_is_rolled_back_and_the_run_ends_as_one_without_the_bad_record():
    clean = spiked_loop(1)
    clean.fit()
    events = []
    loop = spiked_loop(1e6, events, nonfinite="rollback", spike_factor=10)
    loop.fit()
    # Back to the state kept every 4 steps, past the batches since: the spike's and its own.
    assert rolled_back(events) == [(20, 16, 4), (107, 104, 3), (165, 164, 1)]
    assert "spike_factor=10" in events[0]["why"]
    assert loop.step == STEPS and loop.rollbacks.at == [107, 165]  # those within the last 100 steps
    assert abs(clean_loss(loop.module) - clean_loss(clean.module)) < 0.01 * clean_loss(clean.module)

    # The same spike is finite: today's check lets it through, and the weights never recover.
    loop = spiked_loop(1e6)
    loop.fit()
    assert clean_loss(loop.module) > 100 * clean_loss(clean.module)


def test_a_nonfinite_loss_is_rolled_back_where_stop_stops_at_it():
    events = []
    loop = spiked_loop(float("inf"), events, nonfinite="rollback")
    loop.fit()
    assert rolled_back(events)[0] == (20, 16, 4) and "the loss is" in events[0]["why"]
    assert torch.isfinite(torch.tensor(clean_loss(loop.module)))

    loop = spiked_loop(float("inf"))
    with pytest.raises(NonFiniteLoss, match=r"step 20: the loss is"):
        loop.fit()
    assert loop.step == 19


def test_without_a_kept_state_a_rollback_drops_the_bad_step_and_too_many_stop_the_run():
    events = []
    loop = spiked_loop(float("inf"), events, every=0, nonfinite="rollback")
    loop.fit()
    said = rolled_back(events)
    assert said[0] == (20, 19, 1) and len(said) > 1 and all(skipped == 1 for _, _, skipped in said)

    loop = spiked_loop(float("inf"), nonfinite="rollback", rollback_max=1)  # 20 and 107: within 100
    with pytest.raises(NonFiniteLoss, match=r"the 2th rollback within 100 steps, over trainer.rollback_max=1"):
        loop.fit()


class SpikedStream(SpikedRecordTask):
    """The same records as a stream (item i: record i), each micro-batch's first item noted."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.firsts = []

    def train_dataset(self):
        from .tasks import RegressionStream

        return RegressionStream(super().train_dataset())

    def train_step(self, model, batch):
        self.firsts.append(int(batch[2][0]))
        return super().train_step(model, batch)


def test_a_stream_moves_past_the_items_of_the_steps_rolled_back():
    task = SpikedStream(num_samples=2048, val_samples=0, bad_sample=19 * 32 + 5, scale=1e6)  # in step 20
    events = []
    loop = Loop(task, LoopSettings(trainer=TrainerConfig(max_steps=24, global_batch_size=32, nonfinite="rollback",
                                                         spike_factor=10), snapshot_every_n_steps=4),
                Outlets(notify=events.append), rank=0, world_size=1, device=torch.device("cpu"))
    loop.fit()
    assert rolled_back(events) == [(20, 16, 4)]
    # Steps 1-20 read items 0-639; steps 17-24, run again, the items after them.
    assert task.firsts == [32 * i for i in range(20)] + [32 * i for i in range(20, 28)]


def test_a_new_group_keeps_nothing_from_before_it_and_keeps_a_state_at_its_first_boundary():
    """Survivors and a replacement (which holds nothing) must go back to the same step."""
    from raytrainer.worker.loop.rollback import KeptState

    kept = KeptState(4, None)
    assert not kept.due(0) and kept.due(1)  # step 0's fresh optimizer has another shape
    kept.take(4, lambda: {"w": torch.ones(2)}, world_size=1)
    step, state = kept.newest(5, lambda: {"w": torch.zeros(2)})
    assert step == 4 and torch.equal(state["w"], torch.ones(2))
    kept.reset(6)
    assert kept.newest(7, lambda: {"w": torch.zeros(2)}) is None and kept.due(6)
    kept.take(6, lambda: {"w": torch.ones(2)}, world_size=1)
    assert not kept.due(7) and kept.due(8)


def test_spike_factor_belongs_to_rollback():
    with pytest.raises(ConfigError, match="needs trainer.nonfinite: rollback"):
        TrainerConfig(spike_factor=10)
    with pytest.raises(ConfigError, match="must be > 1"):
        TrainerConfig(nonfinite="rollback", spike_factor=0.5)


def _two_ranks(rank, world_size, strategy, peer):
    events = []
    loop = spiked_loop(1e6, events, rank=rank, world_size=world_size, nonfinite="rollback", spike_factor=10,
                       strategy=strategy, max_steps=40, peer=peer)
    loop.fit()
    weights = torch.cat([p.detach().full_tensor().flatten() if hasattr(p, "full_tensor") else p.detach().flatten()
                         for p in loop.module.parameters()])
    kept_here = loop.rollbacks.kept.state is not None  # a copy of the rollback's own
    return loop.step, loop.rollbacks.at, rolled_back(events), weights.tolist(), kept_here


@pytest.mark.parametrize("strategy, peer", [("ddp", False), ("fsdp", False), ("fsdp", True)])
def test_every_rank_rolls_back_at_the_same_step(strategy, peer):
    """DDP's loss rides on the gradient all-reduce, FSDP's takes one of its own; with peer
    snapshots (sharded state) the kept state is their own copy, none other is taken."""
    from .dist_procs import run_ranks

    (step0, at0, said0, w0, kept0), (step1, at1, said1, w1, kept1) = run_ranks(_two_ranks, 2, strategy, peer)
    assert kept0 == kept1 == (not peer)
    assert step0 == step1 == 40 and at0 == at1 == [20]
    assert said0 == [(20, 16, 4)] and said1 == []  # rank 0 tells the driver
    assert w0 == w1


def test_a_run_of_two_workers_rolls_back_in_memory_and_ends_as_in_one_process(ray_local, tmp_path):
    """Through the driver: the rollback is in the events, no recovery or checkpoint read is,
    and the weights are those of the same rollback in one process (the global batch fixed)."""
    import raytrainer
    from raytrainer.driver.metrics import notice

    steps = 40
    config = {
        "task": {"target": "tests.tasks:SpikedRecordTask",
                 "args": {"num_samples": 2048, "val_samples": 0, "bad_sample": BAD, "scale": 1e6}},
        "trainer": {"max_steps": steps, "global_batch_size": 32, "lr_schedule": {}, "nonfinite": "rollback",
                    "spike_factor": 10},
        "failure": {"snapshot_every_n_steps": 4},
        "scaling": {"num_workers": 2},
        "checkpoint": {"every_n_steps": 3},
        "run": {"name": "spiked", "storage": str(tmp_path)},
    }
    result = raytrainer.train(config, progress=False)
    assert rolled_back(result.events) == [(20, 16, 4)]
    said = notice(next(e for e in result.events if e["event"] == "rolled_back"))
    assert said.startswith("raytrainer: rolled back from step 20 to step 16 in memory, past 4 batch(es): step 20:")
    assert not {"recovered", "resumed", "worker_failed"} & {e["event"] for e in result.events}
    here = spiked_loop(1e6, nonfinite="rollback", spike_factor=10, max_steps=steps)
    here.fit()
    weights = torch.load(result.run_dir / "model.pt", weights_only=True)
    for name, value in here.module.state_dict().items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6)
