"""Input pipelines in one process (no Ray): loader processes read exactly what the
BatchPlan names, streams are sharded and resume where they stopped, and bad input fails
with a clear error instead of hanging."""

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from raytrainer.config import DataConfig, TrainerConfig, load_config
from raytrainer.data import BatchPlan, fetch
from raytrainer.errors import ConfigError, TaskError
from raytrainer.worker.input.input import LoaderProcessDied, MapInput, StreamInput, PlanSampler
from raytrainer.worker.loop.loop import Loop
from raytrainer.worker.loop.settings import LoopSettings

from .conftest import assert_no_loader_processes
from .ray_procs import SESSION_TAG, live_processes, short_temp_dir
from .tasks import BadInputTask, RegressionStream, RegressionTask, SequenceTask, StreamTask
from .waits import Deadline


def loop(task, data=None, state=None, **trainer):
    cfg = TrainerConfig(**{"max_steps": 12, "global_batch_size": 16, "micro_batch_size": 5, **trainer})
    return Loop(task, LoopSettings(trainer=cfg, data=DataConfig(**(data or {}))), rank=0, world_size=1,
                device=torch.device("cpu"), state=state)


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------- map-style

def test_the_sampler_yields_the_plans_micro_batches_across_epochs():
    plan = BatchPlan(50, 16, 5, 2, seed=3)  # 3 steps an epoch, 2 samples dropped
    sampler = PlanSampler(plan, rank=1)
    sampler.epoch, sampler.position = 0, 32  # the last step of epoch 0
    got = [index for _, index in zip(range(3 * plan.accumulation), sampler)]
    want = [i.tolist() for epoch, position in ((0, 32), (1, 0), (1, 16))
            for i in plan.micro_batches(epoch, position, 1)]
    assert got == want


@pytest.mark.parametrize("data", [{"num_workers": 2}, {"num_workers": 1, "persistent_workers": True}])
def test_loader_processes_train_to_the_same_weights(data):
    """Through loader processes (and validation through them too) the batches are the
    same tensors: bit-identical weights, over an epoch end."""
    task = lambda: RegressionTask(num_samples=50, dropout=0.1)  # noqa: E731: dropout draws per step
    base = loop(task(), val_every_n_steps=5).fit()
    run = loop(task(), data, val_every_n_steps=5)
    assert same(run.fit(), base)
    assert_no_loader_processes()


def test_a_loader_restarts_at_the_position_after_an_interrupted_step():
    """A step abandoned half-way leaves prepared batches of that step behind: the loader
    restarts at the position it is asked for, not where it had got to."""
    data = RegressionTask(num_samples=64)._data(64, 1)
    plan = BatchPlan(64, 16, 4, 1, seed=0)
    loader = MapInput(data, DataConfig(num_workers=2), rank=0, plan=plan, device=torch.device("cpu"))
    try:
        batches = loader.batches(0, 16, 1)
        next(batches)  # the step is interrupted after its first micro-batch
        got = [b[2].tolist() for b in loader.batches(0, 16, 1)]
        assert got == [i.tolist() for i in plan.micro_batches(0, 16, 0)]
        loader.regroup(BatchPlan(64, 16, 4, 2, seed=0), rank=1, step=1)  # a resize
        got = [b[2].tolist() for b in loader.batches(0, 16, 1)]
        assert got == [fetch(data, i)[2].tolist() for i in BatchPlan(64, 16, 4, 2, seed=0).micro_batches(0, 16, 1)]
    finally:
        loader.close()
    assert_no_loader_processes()


# ---------------------------------------------------------------------- streams

def stream_samples(world, steps, num_workers=0, *, sharded=False, start=None):
    """{rank: [stream index per sample, in the order trained]} of `steps` steps."""
    task = StreamTask(num_samples=40, sharded=sharded)
    plan = BatchPlan(10**9, 12, 4, world, seed=0)
    out = {}
    for rank in range(world):
        stream = StreamInput(task.train_dataset(), DataConfig(num_workers=num_workers), rank=rank, plan=plan,
                             device=torch.device("cpu"))
        if start is not None:
            stream.load_state_dict(start, steps[0])
        out[rank] = [i for step in steps for b in stream.batches(0, 0, step) for i in b[2].tolist()]
        stream.close()
    return out, stream.state_dict(steps[-1] + 1)


@pytest.mark.parametrize("num_workers, sharded", [(0, False), (2, False), (2, True)])
def test_a_stream_is_split_over_ranks_and_loader_processes_without_overlap(num_workers, sharded):
    """At 3 ranks (12 samples a step: 4 each), the ranks' items are disjoint and together
    the first 3 x 4 x 6 stream items; the same with items read by 2 loader processes each
    (a micro-batch each in turn), with a dataset that skips or that reads only its share."""
    got, _ = stream_samples(3, range(6), num_workers, sharded=sharded)
    assert all(len(v) == 24 for v in got.values())
    seen = sorted(i for v in got.values() for i in v)
    assert seen == list(range(72))
    assert set(got[1]) == {i for i in range(72) if i % 3 == 1}


def test_a_stream_resumes_where_it_stopped_and_a_resize_never_repeats_an_item():
    whole, _ = stream_samples(2, range(6), num_workers=2)
    first, state = stream_samples(2, range(3), num_workers=2)
    rest, _ = stream_samples(2, range(3, 6), num_workers=2, start=state)
    assert {r: first[r] + rest[r] for r in whole} == whole  # exact
    # At 3 ranks after 3 steps at 2: a new segment after every item trained on so far.
    grown, _ = stream_samples(3, range(3, 6), num_workers=2, start=state)
    before = {i for v in first.values() for i in v}
    after = [i for v in grown.values() for i in v]
    assert len(after) == len(set(after)) == 36 and min(after) > max(before)
    assert min(after) - max(before) <= 2 * 4  # the skipped items: what lagging processes had not reached


def test_a_stream_trains_and_resumes_to_the_same_weights_through_the_loop():
    task = lambda: StreamTask(num_samples=40)  # noqa: E731
    whole = loop(task(), {"num_workers": 2}).fit()
    first = loop(task(), {"num_workers": 2}, max_steps=5)
    first.fit()
    state = first.state_dict()
    assert state["input"]["start_step"] == 0 and state["loop"]["step"] == 5
    assert same(loop(task(), {"num_workers": 2}, state=state).fit(), whole)
    # data.num_workers does not change the order as long as it is the same on resume:
    assert same(loop(task(), {"num_workers": 1}).fit(), loop(task()).fit())
    assert_no_loader_processes()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_stream_that_runs_dry_is_a_clear_error(num_workers):
    run = loop(StreamTask(num_samples=40, stream_length=50), {"num_workers": num_workers})
    with pytest.raises(TaskError, match=r"stream ran dry.*lower trainer.max_steps"):
        run.fit()
    run.close_inputs()
    assert run.step == 3  # 3 x 16 samples; the fourth step needs 64
    assert_no_loader_processes()


def test_a_stream_has_no_epochs():
    with pytest.raises(ConfigError, match="set trainer.max_epochs: null and trainer.max_steps"):
        loop(StreamTask(), max_epochs=1)


@pytest.fixture
def short_tmp():
    """A temp dir with a path as short as /tmp's own (a socket's path is at most 107 bytes:
    one under pytest's tmp_path would be too long to be made there)."""
    path = short_temp_dir()
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


def test_a_worker_killed_as_its_loader_processes_read_leaves_no_process_and_no_folder(short_tmp, monkeypatch):
    """A process training with loader processes, SIGKILLed from outside mid-run, as Ray
    kills a worker at a run's end or a fault does, with nothing but the kernel to clean up
    (Ray 2.60 also kills a dead worker's process group; not every Ray does). Its loader
    processes and their fork server go with it: they used to live on for good, each
    waiting on the other. Its fork server's socket folder is not multiprocessing's own
    (pymp-*, which only a normal exit removes: one was left in the temp dir for each such
    worker and run) but a scratch folder of the worker's, which the next one on the node
    removes."""
    from raytrainer.worker import scratch

    monkeypatch.setenv(SESSION_TAG, uuid.uuid4().hex)  # this test's processes apart from any other's
    script = ("import torch\n"
              "from raytrainer.config import DataConfig, TrainerConfig\n"
              "from raytrainer.worker.loop.loop import Loop\n"
              "from raytrainer.worker.loop.settings import LoopSettings\n"
              "from tests.tasks import RegressionTask\n"
              "if __name__ == '__main__':\n"
              "    cfg = LoopSettings(trainer=TrainerConfig(max_steps=100000, global_batch_size=16, micro_batch_size=8),\n"
              "                       data=DataConfig(num_workers=2))\n"
              "    Loop(RegressionTask(sleep_s=0.02), cfg, rank=0, world_size=1, device=torch.device('cpu')).fit()\n")
    (short_tmp / "train.py").write_text(script)
    errors = short_tmp / "stderr"
    with errors.open("w") as stderr:
        worker = subprocess.Popen([sys.executable, str(short_tmp / "train.py")], stderr=stderr,
                                  env={**os.environ, "TMPDIR": str(short_tmp), "PYTHONPATH": os.getcwd()})

    def others():
        return [(pid, cmdline) for pid, _, cmdline in live_processes(ours_only=True) if pid != worker.pid]

    try:
        deadline = Deadline(120)
        while len([c for _, c in others() if b"raytrainer.worker.input.input" in c]) < 3:  # the fork server, 2 loaders
            assert worker.poll() is None, errors.read_text()
            assert not deadline.passed(), f"no loader processes started: {others()}"
            time.sleep(0.1)
        worker.kill()
        assert worker.wait() == -signal.SIGKILL
        deadline = Deadline(30)
        while others() and not deadline.passed():
            time.sleep(0.1)
        assert not others(), f"left running after the worker was killed: {others()}"
    finally:
        worker.kill()
        for pid, _ in others():
            os.kill(pid, signal.SIGKILL)
    root = short_tmp / scratch.ROOT
    assert not list(short_tmp.glob("pymp-*"))
    [left] = root.iterdir()  # the killed worker's, which it could not remove
    assert left.name.startswith(f"{worker.pid}@") and any(p.name.startswith("listener-") for p in left.iterdir())
    monkeypatch.setattr(scratch.tempfile, "tempdir", str(short_tmp))
    made = scratch.make()  # the next worker's
    assert sorted(root.iterdir()) == [made]


def test_sockets_too_long_for_a_scratch_folder_stay_in_multiprocessings_own(tmp_path, monkeypatch):
    from multiprocessing import process

    from raytrainer.worker import _internals

    monkeypatch.setattr(process.current_process(), "_config", {})  # a process that has made no socket yet
    long = tmp_path / ("x" * 100)
    assert _internals.use_multiprocessing_folder(lambda: long.mkdir() or long) is None
    assert not long.exists() and "tempdir" not in process.current_process()._config
    short = tmp_path / "s"
    assert _internals.use_multiprocessing_folder(lambda: short.mkdir() or short) == short
    assert process.current_process()._config["tempdir"] == str(short)
    assert _internals.use_multiprocessing_folder(lambda: pytest.fail("made again")) is None  # once a process


# ---------------------------------------------------------------------- bad input

def test_a_dataset_that_cannot_reach_loader_processes_names_the_setting():
    run = loop(BadInputTask("unpicklable"), {"num_workers": 2})
    with pytest.raises(ConfigError, match=r"cannot be sent to loader processes.*data.num_workers: 0"):
        run.fit()
    assert_no_loader_processes()


def test_a_loader_process_that_dies_is_an_error_not_a_hang():
    run = loop(BadInputTask("dies"), {"num_workers": 2})
    with pytest.raises(LoaderProcessDied, match="loader process reading the training dataset died"):
        run.fit()
    run.abandon_step()  # what the worker does after a failure: the loader goes
    assert_no_loader_processes()


def test_data_config_is_validated():
    base = {"task": {"target": "a:B"}, "trainer": {"max_steps": 1}}
    assert load_config({**base, "data": {"num_workers": 2}}).data.num_workers == 2
    with pytest.raises(ConfigError, match=r"unknown key 'data.workers'.*allowed keys: num_workers, prefetch"):
        load_config({**base, "data": {"workers": 2}})
    with pytest.raises(ConfigError, match="data.num_workers=-1 must be >= 0"):
        load_config({**base, "data": {"num_workers": -1}})
    with pytest.raises(ConfigError, match="data.pin_memory='yes' has the wrong type"):
        load_config({**base, "data": {"pin_memory": "yes"}})


def test_regression_stream_is_what_the_tests_assume():
    stream = RegressionStream(RegressionTask()._data(4, 1), length=6)
    assert [int(i) for _, _, i in stream] == list(range(6))


# ---------------------------------------------------------------------- data.collate_fn

@pytest.mark.parametrize("collate, data", [("pad", {}), ("tests.tasks:pad_sequences", {"num_workers": 1})])
def test_a_tasks_collate_fn_pads_variable_length_sequences(collate, data):
    """A method of the task, or a function by import path (through a loader process too)."""
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        loop(SequenceTask(), max_steps=2).fit()  # what default_collate makes of them
    run = loop(SequenceTask(), {"collate_fn": collate, **data}, max_steps=4)
    run.fit()
    assert run.step == 4
    assert_no_loader_processes()


def test_a_collate_fn_that_cannot_be_found_is_a_config_error():
    base = {"task": {"target": "tests.tasks:SequenceTask"}, "trainer": {"max_steps": 1}}
    with pytest.raises(ConfigError, match=r"data.collate_fn='tests.nowhere:pad'.*does not import.*launch in"):
        load_config({**base, "data": {"collate_fn": "tests.nowhere:pad"}})
    with pytest.raises(ConfigError, match=r"data.collate_fn='tests.tasks:no_such'.*defines no 'no_such'"):
        load_config({**base, "data": {"collate_fn": "tests.tasks:no_such"}})
    with pytest.raises(ConfigError, match=r"data.collate_fn='pad it'.*neither a method name"):
        load_config({**base, "data": {"collate_fn": "pad it"}})
    with pytest.raises(ConfigError, match=r"data.collate_fn='padd'.*SequenceTask has no method 'padd'"):
        loop(SequenceTask(), {"collate_fn": "padd"})
