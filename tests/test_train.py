"""Real runs: 1-2 Gloo workers on a local Ray (one Ray for the whole module)."""

import json

import pytest
import torch

import raytrainer
from raytrainer.errors import ConfigError, PlacementError, TaskError, WorkerError

from .conftest import assert_no_leaks


def config(tmp_path, name, **sections):
    cfg = {
        "task": {"target": "tests.tasks:RegressionTask", "args": {}},
        "trainer": {"max_epochs": 2, "global_batch_size": 32, "log_every_n_steps": 3},
        "scaling": {"num_workers": 2},
        "run": {"name": name, "storage": str(tmp_path)},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def test_two_workers_write_the_run_directory(ray_local, tmp_path):
    result = raytrainer.train(config(tmp_path, "two"), progress=False)
    run = tmp_path / "two"
    assert result.run_dir == run
    for name in ("config.yaml", "metrics.jsonl", "events.jsonl", "model.pt"):
        assert (run / name).is_file(), name
    assert list(run.glob("events.out.tfevents.*"))

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r and "val_loss" not in r]
    assert [r["step"] for r in train] == list(range(1, 17))  # 256 / 32 * 2 epochs: every step
    assert all(r["world_size"] == 2 and {"epoch", "time", "lr", "samples_per_s"} <= r.keys() for r in train)
    assert train[-1]["loss"] < train[0]["loss"]
    val = [r for r in rows if "val_loss" in r]
    assert [(r["step"], r["epoch"]) for r in val] == [(8, 0), (16, 1)]
    # Validation covers all 64 samples exactly once across both ranks: mean index 31.5.
    assert val[-1]["val_index"] == pytest.approx(31.5)
    assert result.metrics["step"] == 16 and result.metrics["val_loss"] == val[-1]["val_loss"]

    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["run_started", "group_formed", "checkpoint_committed", "finished"]
    assert events[1]["world_size"] == 2
    assert events[2]["step"] == 16 and (run / "checkpoints" / "step-00000016" / "COMMITTED").is_file()
    weights = torch.load(run / "model.pt", weights_only=True)
    assert set(weights) == {"0.weight", "0.bias", "3.weight", "3.bias"}
    assert_no_leaks()


def test_one_and_two_workers_end_with_the_same_weights(ray_local, tmp_path):
    """Averaging, sharding and accumulation are right iff the maths ignores the worker count
    and whether loader processes read the batches: one worker reading in its training
    thread, two with two loader processes each (that two workers without loader processes
    match one is also test_equivalence_holds_with_accumulation_clipping_and_ema's)."""
    trainer = {"max_steps": 10, "micro_batch_size": 8}
    one = raytrainer.train(config(tmp_path, "one", trainer=trainer, scaling={"num_workers": 1},
                                  data={"num_workers": 0}), progress=False)
    two = raytrainer.train(config(tmp_path, "two", trainer=trainer, data={"num_workers": 2}), progress=False)
    a = torch.load(one.run_dir / "model.pt", weights_only=True)
    b = torch.load(two.run_dir / "model.pt", weights_only=True)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)
    last = [[r for r in run.history if "loss" in r][-1] for run in (one, two)]
    assert last[0]["loss"] == pytest.approx(last[1]["loss"], rel=1e-4)


def test_user_exception_names_the_rank_and_traceback(ray_local, tmp_path):
    args = {"fail_at_step": 3, "fail_rank": 1}
    cfg = config(tmp_path, "boom", task={"args": args}, failure={"max_failures": 0})
    with pytest.raises(WorkerError) as info:
        raytrainer.train(cfg, progress=False)
    error = info.value
    assert error.rank == 1 and error.step == 3
    assert "ValueError: boom" in str(error) and "tests/tasks.py" in error.traceback
    assert "in train_step" in error.traceback
    events = [json.loads(line) for line in (tmp_path / "boom" / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "failed" and events[-1]["rank"] == 1
    assert_no_leaks()


def test_task_that_does_not_import(ray_local, tmp_path):
    with pytest.raises(ConfigError, match="module 'tests.nope' does not import"):
        raytrainer.train(config(tmp_path, "x", task={"target": "tests.nope:Task"}), progress=False)
    with pytest.raises(ConfigError, match="has no 'Nope'"):
        raytrainer.train(config(tmp_path, "y", task={"target": "tests.tasks:Nope"}), progress=False)
    with pytest.raises(ConfigError, match="task.args do not fit"):
        raytrainer.train(config(tmp_path, "z", task={"args": {"bogus": 1}}), progress=False)
    assert_no_leaks()


def test_train_step_without_loss(ray_local, tmp_path):
    with pytest.raises(TaskError, match="'loss'"):
        raytrainer.train(config(tmp_path, "noloss", task={"args": {"no_loss": True}}), progress=False)
    assert_no_leaks()


def test_dataset_smaller_than_one_global_batch(ray_local, tmp_path):
    cfg = config(tmp_path, "tiny", task={"target": "tests.tasks:TinyTask"})
    with pytest.raises(ConfigError, match="8 samples, fewer than one global batch"):
        raytrainer.train(cfg, progress=False)
    assert_no_leaks()


def test_more_workers_than_the_cluster_can_place(ray_local, tmp_path):
    cfg = config(tmp_path, "big", scaling={"num_workers": 2, "resources_per_worker": {"CPU": 3},
                                           "placement_timeout_s": 1.5})
    with pytest.raises(PlacementError) as info:
        raytrainer.train(cfg, progress=False)
    message = str(info.value)
    assert "2 workers of {'CPU': 3.0}" in message and "the cluster has CPU 4 in total" in message
    assert "scaling.num_workers" in message
    assert_no_leaks()


def test_existing_run_directory_is_not_overwritten(ray_local, tmp_path):
    run = tmp_path / "taken"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="already holds a run"):
        raytrainer.train(config(tmp_path, "taken"), progress=False)
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_equivalence_holds_with_accumulation_clipping_and_ema(ray_local, tmp_path):
    trainer = {"max_steps": 8, "micro_batch_size": 4, "grad_clip_norm": 0.5, "ema_decay": 0.8}
    task = {"target": "tests.tasks:FeatureTask", "args": {"lr": 0.5}}
    one = raytrainer.train(config(tmp_path, "one", task=task, trainer=trainer, scaling={"num_workers": 1}),
                           progress=False)
    two = raytrainer.train(config(tmp_path, "two", task=task, trainer=trainer), progress=False)
    assert any(r["grad_norm"] > 0.5 for r in one.history if "grad_norm" in r)  # clipping was active
    a = torch.load(one.run_dir / "model.pt", weights_only=True)
    b = torch.load(two.run_dir / "model.pt", weights_only=True)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)


def global_batch_mean(step_in_epoch, num_samples=256, batch=32, seed=0):
    """Mean input of one global batch, computed from the sampler and the data directly."""
    from raytrainer.data import BatchPlan

    from .tasks import FeatureTask

    x = FeatureTask(num_samples=num_samples).train_dataset().tensors[0]
    index = torch.cat(BatchPlan(num_samples, batch, batch, 1, seed).micro_batches(0, step_in_epoch * batch, 0))
    return x[index].mean(0)


@pytest.mark.parametrize("sync", [True, False])
def test_sync_batchnorm_statistics_cover_the_global_batch(ray_local, tmp_path, sync):
    # BatchNorm momentum 1.0: after one step its running mean is that step's batch mean.
    task = {"target": "tests.tasks:FeatureTask", "args": {"batchnorm": True}}
    result = raytrainer.train(config(tmp_path, f"bn{sync}", task=task,
                                     trainer={"max_steps": 1, "sync_batchnorm": sync}), progress=False)
    running_mean = torch.load(result.run_dir / "model.pt", weights_only=True)["0.running_mean"]
    matches = torch.allclose(running_mean, global_batch_mean(0), atol=1e-6)
    assert matches is sync  # without SyncBatchNorm it is rank 0's half-batch mean


def test_sync_batchnorm_on_two_workers_trains_like_batchnorm_on_one(ray_local, tmp_path):
    """The backward through the synchronised statistics is exact, not only the forward."""
    task = {"target": "tests.tasks:FeatureTask", "args": {"batchnorm": True, "lr": 0.2}}
    trainer = {"max_steps": 6, "sync_batchnorm": True}
    one = raytrainer.train(config(tmp_path, "one", task=task, trainer=trainer, scaling={"num_workers": 1}),
                           progress=False)
    two = raytrainer.train(config(tmp_path, "two", task=task, trainer=trainer), progress=False)
    a = torch.load(one.run_dir / "model.pt", weights_only=True)
    b = torch.load(two.run_dir / "model.pt", weights_only=True)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)


def test_early_stopping_stops_every_rank_at_the_same_step(ray_local, tmp_path):
    record = tmp_path / "hooks"
    cfg = config(
        tmp_path, "early",
        task={"target": "tests.tasks:FeatureTask", "args": {"frozen": True}},
        trainer={"max_epochs": 5, "val_every_n_steps": 2,
                 "early_stopping": {"metric": "val_loss", "patience": 2}},
    )
    cfg["callbacks"] = [{"target": "tests.tasks:Recorder", "args": {"path": str(record)}},
                        {"target": "tests.tasks:DriverRecorder", "args": {"path": str(record)}}]
    result = raytrainer.train(cfg, progress=False)
    finished = result.events[-1]
    assert finished["event"] == "finished" and finished["step"] == 6
    assert finished["reason"].startswith("early_stopping: val_loss did not improve")

    def hooks(who):
        return [json.loads(line) for line in (tmp_path / f"hooks.{who}").read_text().splitlines()]

    ends = [hooks(rank)[-1] for rank in (0, 1)]
    assert [(e["hook"], e["step"]) for e in ends] == [("on_run_end", 6)] * 2
    for who in (0, 1, "driver"):  # lifecycle boundaries only, the same on every rank and the driver
        names = [h["hook"] for h in hooks(who)]
        assert names[0] == "on_run_start" and names[-1] == "on_run_end"
        assert names.count("on_validation_end") == 3 and names.count("on_epoch_start") == 1
    assert [h["step"] for h in hooks("driver") if h["hook"] == "on_validation_end"] == [2, 4, 6]


def test_a_task_pads_its_variable_length_sequences_with_its_collate_fn(ray_local, tmp_path):
    cfg = config(tmp_path, "padded", task={"target": "tests.tasks:SequenceTask", "args": {"lr": "5e-2"}},
                 trainer={"max_epochs": None, "max_steps": 4, "global_batch_size": 8, "log_every_n_steps": 1},
                 data={"collate_fn": "pad"})
    result = raytrainer.train(cfg, progress=False)
    assert [row["step"] for row in result.history if "loss" in row] == [1, 2, 3, 4]
