"""Stops a user meets: a non-finite loss from a bad record (trainer.nonfinite), and a
signal to the CLI (SIGINT, SIGTERM), which stops at a step boundary and commits a
checkpoint there. Both leave a run that `raytrainer resume` continues."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import raytrainer
from raytrainer.checkpoint import Checkpoints, Storage
from raytrainer.config import CheckpointConfig
from raytrainer.errors import NonFiniteLoss

from .conftest import ROOT, assert_no_leaks


def config(tmp_path, name, **trainer):
    return {
        "task": {"target": "tests.tasks:BadRecordTask", "args": {"bad_sample": 37}},
        "trainer": {"max_steps": 12, "global_batch_size": 32, **trainer},
        "scaling": {"num_workers": 2},
        "checkpoint": {"every_n_steps": 2},
        "run": {"name": name, "storage": str(tmp_path)},
    }


def log(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def finite(path):
    """Whether every floating-point tensor in a saved state (or weights) file is finite."""
    def tensors(obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from tensors(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from tensors(v)

    found = [t for t in tensors(torch.load(path, weights_only=True)) if t.is_floating_point()]
    return found and all(torch.isfinite(t).all() for t in found)


def test_a_bad_record_stops_the_run_at_its_step_and_a_resume_with_skip_trains_through(ray_local, tmp_path):
    with pytest.raises(NonFiniteLoss) as info:
        raytrainer.train(config(tmp_path, "nan"), progress=False)
    found = re.match(r"step (\d+): the loss is nan on rank\(s\) (\d)\.", str(info.value))
    assert found, str(info.value)
    step, rank = int(found[1]), int(found[2])
    run_dir = tmp_path / "nan"
    events = log(run_dir)
    assert "recovered" not in [e["event"] for e in events]  # a property of the data: never retried
    assert events[-1]["event"] == "failed" and events[-1]["error"] == "NonFiniteLoss"
    assert not (run_dir / "model.pt").exists()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(math.isfinite(r["loss"]) and r["step"] < step for r in rows if "loss" in r)
    checkpoints = Checkpoints(Storage(str(tmp_path)), "nan", CheckpointConfig()).committed()
    assert checkpoints and all(c.step < step for c in checkpoints)
    for c in checkpoints:
        assert finite(run_dir / "checkpoints" / c.name / "state.pt")

    # The same run resumed from its newest checkpoint, skipping: through the bad record
    # (once per epoch of 8 steps) to the end, each skip counted.
    result = raytrainer.train(config(tmp_path, "nan", nonfinite="skip"), progress=False)
    skipped = [e for e in result.events if e["event"] == "nonfinite_skipped"]
    assert skipped and skipped[0]["step"] == step and f"rank(s) {rank}" in skipped[0]["why"]
    assert result.metrics["nonfinite_skips"] == len(skipped)
    assert finite(result.run_dir / "model.pt")
    assert_no_leaks()


def test_a_nonfinite_loss_your_own_loop_reports_is_warned_of_once_and_the_loop_decides(ray_local, tmp_path):
    from .tasks import nan_loss_loop

    result = raytrainer.train_loop(nan_loss_loop, {"scaling": {"num_workers": 2},
                                                   "run": {"name": "loop", "storage": str(tmp_path)}},
                                   progress=False)
    said = [e for e in result.events if e["event"] == "nonfinite_loss"]
    assert [e["step"] for e in said] == [3] and "check for it in your loop" in said[0]["why"]
    assert result.events[-1]["event"] == "finished" and result.metrics["step"] == 6
    assert_no_leaks()
