"""Frameworks inside your own loop, as their users run them: a Hugging Face Trainer, a
Lightning Trainer and a plain accelerate loop, each trained on 2 workers, one of them
SIGKILLed from outside by pid at a random step, recovered from a survivor's memory, and
ending with the weights of the same run undisturbed (shared per module)."""

import json
import os
import random
import tempfile
import time
import types
from pathlib import Path

import pytest
import torch
import yaml

import raytrainer
from raytrainer.config.failure import AUTO_FIRST
from raytrainer.worker import scratch
from raytrainer.worker.userloop.userloop import LoopContext

from .conftest import ROOT, assert_no_leaks
from .faults import Run, kill


def events(result, name):
    return [e for e in result.events if e["event"] == name]


def weights(result):
    return torch.load(result.run_dir / "model.pt", weights_only=True)


def assert_same_weights(a, b):
    a, b = weights(a), weights(b)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def killed_once(cfg, first_step, last_step, timeout=240):
    """The run with a random rank SIGKILLed by pid at a random moment after a random step.
    The workers wait at the report of last_step + 2 until then (tasks.gated_loop): the
    driver's rows trail them, so on a loaded machine the run could end before the kill."""
    gate = Path(cfg["run"]["storage"]) / f"{cfg['run']['name']}.gate"
    gate.touch()
    task = cfg["task"]
    cfg = dict(cfg, task={"loop": "tests.tasks:gated_loop",
                          "args": {"loop": task["loop"], "gate": str(gate), "hold_at": last_step + 2, **task["args"]}})
    try:
        run = Run(cfg)
        rng = random.Random()
        run.wait_for_step(rng.randint(first_step, last_step), timeout=timeout)
        time.sleep(rng.uniform(0, 0.1))  # anywhere in a step
        victim = rng.randrange(2)
        kill(run.pids()[victim])
    finally:
        gate.unlink()
    result = run.result(timeout=timeout)
    (failed,), (recovered,) = events(result, "worker_failed"), events(result, "recovered")
    assert failed["kind"] == "died" and failed["rank"] == victim
    assert recovered["state_from"] == "memory" and not events(result, "resumed")  # no checkpoint was read
    return result, recovered


# --------------------------------------------------------------------------- Hugging Face

def hf_config(tmp_path, name, **args):
    cfg = yaml.safe_load(open(os.path.join(ROOT, "configs/hf_trainer.yaml")))
    cfg["task"]["args"].update(block_size=32, n_embd=32, n_head=2, max_bytes=60_000, save_steps=6, eval_steps=4,
                               **args)
    cfg["trainer"]["max_steps"] = 12
    cfg["scaling"]["placement_timeout_s"] = 300  # a replacement's start, on a loaded machine
    cfg.update(run={"name": name, "storage": str(tmp_path)}, loggers=[], failure={"step_timeout_s": 120})
    return cfg


@pytest.fixture(scope="module")
def hf_undisturbed(ray_local, tmp_path_factory):
    pytest.importorskip("transformers")
    return raytrainer.train(hf_config(tmp_path_factory.mktemp("hf"), "hf"), progress=False)


def scratch_left(result):
    """The scratch folders (ctx.scratch_dir) of every worker the run had, killed ones among
    them, still on disk."""
    pids = {pid for e in result.events for pid in e.get("pids", ())}
    assert pids
    root = Path(tempfile.gettempdir()) / scratch.ROOT
    return [p for pid in pids for p in root.glob(f"{pid}@*")]


def test_a_hugging_face_trainer_reports_its_logs_evaluations_and_checkpoints(hf_undisturbed):
    """examples/hf_trainer.py: the Trainer's loss and evaluation metrics in metrics.jsonl, the
    checkpoints it saves committed with its files, and the Trainer's output_dir on each worker
    (ctx.scratch_dir) gone at the end."""
    rows = [json.loads(line) for line in (hf_undisturbed.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert all(r["loss"] > 0 and r["world_size"] == 2 and "lr" in r for r in rows)
    assert [r["step"] for r in rows if "eval_loss" in r] == [4, 8, 12]
    assert [e["step"] for e in events(hf_undisturbed, "checkpoint_committed")] == [6, 12]
    newest = hf_undisturbed.run_dir / "checkpoints" / "step-00000012"
    assert {"COMMITTED", "state.pt", "trainer_state.json", "model.safetensors", "optimizer.pt"} <= \
        {p.name for p in newest.iterdir()}
    assert json.loads((newest / "trainer_state.json").read_text())["global_step"] == 12
    assert not scratch_left(hf_undisturbed)


def test_a_hugging_face_trainer_recovers_a_killed_worker_from_memory(hf_undisturbed, tmp_path):
    result, recovered = killed_once(hf_config(tmp_path, "hf", step_sleep_s=0.1), 2, 8)
    assert recovered["steps_lost"] <= 1
    assert [r["step"] for r in result.history] == list(range(1, 13))
    assert_same_weights(result, hf_undisturbed)  # the Trainer resumed exactly where it was
    # The killed worker's output_dir, its Trainer's checkpoints in it, was removed by the next
    # worker on the node; the others' by their own at the end.
    assert not scratch_left(result)
    assert_no_leaks()


class FakeContext:
    """ctx as one worker alone sees it, its reports recorded (state copied as raytrainer does)."""

    def __init__(self, step=0, state=None, max_steps=8, global_batch_size=4, scratch_dir=None):
        self.rank, self.world_size, self.local_rank, self.device = 0, 1, 0, torch.device("cpu")
        self.scratch_dir = scratch_dir
        self.step, self.state, self.checkpoint = step, state, None
        self.max_steps, self.global_batch_size, self.seed = max_steps, global_batch_size, 0
        self.reports = []
        self._loop = types.SimpleNamespace(sampled=lambda: None)  # what LoopContext.sampler counts on

    def report(self, metrics, state=None, checkpoint=None):
        from raytrainer.worker.userloop.userloop import _copy_state

        self.reports.append((dict(metrics), state and _copy_state(state), checkpoint))

    sampler = LoopContext.sampler  # the run's own sampler, at world size 1


@pytest.mark.slow  # transformers' import and two Trainers: out of the quick lane
def test_the_hugging_face_callback_reports_at_the_trainers_steps_and_resumes_exactly_from_a_state(tmp_path):
    """One process, no Ray: a report per logged step with its evaluation merged, the state
    every 3 steps, the saved checkpoints handed over; a Trainer resumed from the state of
    step 6 ends with the same weights."""
    pytest.importorskip("transformers")
    from examples.hf_trainer import train_func

    args = dict(block_size=16, n_embd=16, n_layer=1, n_head=2, max_bytes=20_000, save_steps=4, eval_steps=4,
                state_every=3)
    ctx = FakeContext(scratch_dir=str(tmp_path / "first"))
    first = train_func(ctx, **args).state_dict()
    assert [m["step"] for m, _, _ in ctx.reports] == list(range(1, 9))
    assert all(m["loss"] > 0 for m, _, _ in ctx.reports)
    assert [m["step"] for m, _, _ in ctx.reports if "eval_loss" in m] == [4, 8]
    assert [m["step"] for m, state, _ in ctx.reports if state] == [3, 6]
    assert [os.path.basename(c) for _, _, c in ctx.reports if c] == ["checkpoint-4", "checkpoint-8"]
    # The Trainer's own checkpoints, in the worker's scratch folder (raytrainer removes it).
    assert {os.path.dirname(c) for _, _, c in ctx.reports if c} == {ctx.scratch_dir}
    _, state, _ = ctx.reports[5]
    assert set(state) == {"model", "optimizer", "scheduler", "trainer_state"}
    again = FakeContext(step=6, state=state, scratch_dir=str(tmp_path / "again"))
    second = train_func(again, **args).state_dict()
    assert [m["step"] for m, _, _ in again.reports] == [7, 8]
    assert all(torch.equal(first[k], second[k]) for k in first)


# --------------------------------------------------------------------------- Lightning, accelerate

def loop_config(tmp_path, name, loop, max_steps=30, **args):
    return {"task": {"loop": loop, "args": {"samples": 1024, **args}},
            "trainer": {"max_steps": max_steps, "global_batch_size": 64, "seed": 0},
            "scaling": {"num_workers": 2, "placement_timeout_s": 300},  # a replacement's start, loaded
            "failure": {"step_timeout_s": 120}, "run": {"name": name, "storage": str(tmp_path)}, "loggers": []}


LIGHTNING = "examples.lightning_loop:train_func"
ACCELERATE = "examples.accelerate_loop:train_func"


@pytest.fixture(scope="module")
def lightning_undisturbed(ray_local, tmp_path_factory):
    pytest.importorskip("lightning")
    return raytrainer.train(loop_config(tmp_path_factory.mktemp("pl"), "pl", LIGHTNING), progress=False)


def test_a_lightning_trainer_reports_its_logged_metrics_and_validations(lightning_undisturbed):
    rows = lightning_undisturbed.history
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert all(r["loss"] > 0 and r["world_size"] == 2 for r in rows)
    assert [r["epoch"] for r in rows] == [(s - 1) // 16 for s in range(1, 31)]  # 1024 samples, 64 a step
    assert [r["step"] for r in rows if "val_loss" in r] == [10, 20, 30]
    assert rows[-1]["val_acc"] > 0.8


@pytest.fixture
def one_process_group():
    """A group of one in this process, which Lightning's DDP strategy finds and keeps."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.slow  # ten Lightning fits in one process: out of the quick lane
def test_a_lightning_fit_resumed_from_any_step_s_state_ends_as_the_undisturbed_one(one_process_group, tmp_path):
    """One process, no Ray: the state of every step, the last of an epoch (4, 8) and one with
    a validation run (3, 6, 9) among them, resumes to the same weights. (The state of an
    epoch's last step used to be taken in on_train_epoch_end, which Lightning resumes by
    ending that epoch again: the run went apart two steps later.)"""
    pytest.importorskip("lightning")
    from examples.lightning_loop import train_func

    args = dict(samples=256, val_every=3, ckpt_dir=str(tmp_path))  # 4 steps an epoch of 64 samples
    ctx = FakeContext(max_steps=10, global_batch_size=64)
    first = train_func(ctx, **args).state_dict()
    assert [m["step"] for m, state, _ in ctx.reports if state] == list(range(1, 11))
    losses = [m["loss"] for m, _, _ in ctx.reports]
    for m, state, _ in ctx.reports[:-1]:
        again = FakeContext(step=m["step"], state=state, max_steps=10, global_batch_size=64)
        second = train_func(again, **args).state_dict()
        assert [a["loss"] for a, _, _ in again.reports] == losses[m["step"]:], f"resumed from step {m['step']}"
        assert all(torch.equal(first[k], second[k]) for k in first), f"resumed from step {m['step']}"


def test_a_lightning_trainer_recovers_a_killed_worker_from_memory(lightning_undisturbed, tmp_path):
    """Killed anywhere, maybe in the second epoch: Lightning resumes mid-epoch from the
    survivor's state at the batch it stopped at (raytrainer's dataloader)."""
    ckpt = tmp_path / "ckpt"
    # state_every auto (the callback's default): the state goes as often as its copies cost 2% of the time.
    result, recovered = killed_once(loop_config(tmp_path, "pl", LIGHTNING, step_sleep_s=0.1, ckpt_dir=str(ckpt),
                                                state_every="auto"), 3, 22)
    intervals = [e["steps"] for e in events(result, "snapshot_interval") if e["step"] <= recovered["step"]]
    assert recovered["steps_lost"] <= max([AUTO_FIRST, *intervals])
    assert [r["step"] for r in result.history] == list(range(1, 31))
    assert_same_weights(result, lightning_undisturbed)
    # Every worker resumed from a file there; each was removed once Lightning had read it.
    assert ckpt.is_dir() and not list(ckpt.iterdir())
    assert_no_leaks()


def test_an_accelerate_loop_recovers_a_killed_worker_from_memory(ray_local, tmp_path):
    pytest.importorskip("accelerate")
    undisturbed = raytrainer.train(loop_config(tmp_path, "base", ACCELERATE), progress=False)
    assert [r["step"] for r in undisturbed.history] == list(range(1, 31))
    result, recovered = killed_once(loop_config(tmp_path, "acc", ACCELERATE, step_sleep_s=0.1), 3, 22)
    assert recovered["steps_lost"] <= 1
    assert [r["step"] for r in result.history] == list(range(1, 31))
    assert_same_weights(result, undisturbed)
    assert_no_leaks()
