"""The loop with trainer.strategy=fsdp on two local Gloo processes (no Ray): a task's own
sharding, and validation over shards of unequal length."""

import pytest
import torch

from raytrainer.config import TrainerConfig
from raytrainer.worker.loop.loop import Loop
from raytrainer.worker.loop.settings import LoopSettings, Outlets

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
    trainer = {"global_batch_size": 16, **trainer}
    cfg = TrainerConfig(max_steps=4, val_every_n_steps=4, strategy=strategy, **trainer)
    loop = Loop(task, LoopSettings(trainer=cfg), Outlets(report=rows.extend), rank=rank, world_size=world,
                device=torch.device("cpu"))
    weights = loop.fit()
    return weights, rows, type(loop.module).__name__


FEATURES = {"global_batch_size": 32, "micro_batch_size": 8, "grad_clip_norm": 0.5, "ema_decay": 0.9}


def test_fsdp_on_two_ranks_is_ddp_on_one_and_validates_every_sample_once():
    """The same maths: 2 micro-batches of 8 accumulated per rank (no reduce-scatter between
    them), the global norm clipped over shards, EMA kept as shards and validated and
    exported consolidated. And 65 validation samples over 2 ranks are 33 and 32, 5 and 4
    batches of 8: the sharded forward is a collective, so rank 1 runs a fifth, uncounted
    batch; the mean sample index (0..64) shows every sample counted once."""
    ranks = run_ranks(_train, 2, ShardsItself(val_samples=65), "fsdp", **FEATURES)
    (weights, rows, kind), (none, others, _) = ranks
    assert kind.startswith("FSDP") and none is None and others == []
    val = [r for r in rows if "val_index" in r]
    assert len(val) == 1 and val[0]["val_index"] == pytest.approx(32.0)
    alone = run_ranks(_train, 1, RegressionTask(val_samples=65), "ddp", **FEATURES)[0]
    assert all(torch.allclose(weights[k], alone[0][k], atol=1e-6) for k in weights)
    curve = [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]
    reference = [(r["step"], r["loss"], r["grad_norm"]) for r in alone[1] if "loss" in r]
    assert [c[0] for c in curve] == [1, 2, 3, 4] == [c[0] for c in reference]
    assert [v for c in curve for v in c[1:]] == pytest.approx([v for c in reference for v in c[1:]], rel=1e-5)
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
    loop = Loop(RegressionTask(), LoopSettings(trainer=cfg), Outlets(checkpoints=checkpoints), rank=rank,
                world_size=world, device=torch.device("cpu"))
    loop.pause_requested = rank == 0  # the driver asked rank 0; every rank learns it in a reduction
    assert loop.fit() is None and loop.paused
    return loop.step, [(c.step, c.manifest["format"]) for c in checkpoints.committed()]


def _resume(rank, world, uri, steps):
    cfg = TrainerConfig(max_steps=steps, global_batch_size=16, strategy="fsdp")
    loop = Loop(RegressionTask(), LoopSettings(trainer=cfg), rank=rank, world_size=world, device=torch.device("cpu"),
                state=uri)
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
        Loop(RegressionTask(), LoopSettings(trainer=cfg), rank=0, world_size=1, device=torch.device("cpu"),
             state=str(tmp_path / "step-00000002"))


def test_fsdp_on_a_torch_too_old_for_it_is_a_config_error_naming_the_version(monkeypatch):
    """What a worker with torch 2.7 meets (.ci/oldest.sh runs this on the oldest torch, unpatched)."""
    from torch.torch_version import TorchVersion

    from raytrainer.errors import ConfigError
    from raytrainer.worker.state.strategy import FSDP, build_strategy

    if torch.__version__ >= FSDP.NEEDS_TORCH:
        monkeypatch.setattr(torch, "__version__", TorchVersion("2.7.1"))
    with pytest.raises(ConfigError, match=r"trainer.strategy=fsdp needs torch >= 2.9 .* trainer.strategy=ddp"):
        build_strategy(TrainerConfig(max_steps=2, global_batch_size=16, strategy="fsdp"), 2)
