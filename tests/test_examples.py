"""The shipped examples train as their configs say, with 2 workers, and the CLI runs them."""

import json
import os
import shutil
import subprocess
import sys

import pytest

import raytrainer

from .conftest import ROOT, assert_no_leaks
from .ray_procs import free_ports, own_ray_env


@pytest.mark.parametrize("name, overrides, check", [
    ("linear", ["trainer.max_epochs=4"], lambda m: m["val_accuracy"] >= 0.9),
    ("sine", ["trainer.max_epochs=10"], lambda m: m["val_loss"] < 0.05),
    ("digits", [], lambda m: m["val_accuracy"] >= 0.95),
])
def test_example_learns(ray_local, tmp_path, name, overrides, check):
    result = raytrainer.train(f"configs/{name}.yaml", overrides + [f"run.storage={tmp_path}"],
                              progress=False)
    train = [r for r in result.history if "loss" in r and "val_loss" not in r]
    assert train[-1]["world_size"] == 2
    first, last = (sum(r["loss"] for r in rows) / len(rows) for rows in (train[:10], train[-10:]))
    assert last < 0.7 * first, (first, last)
    assert check(result.metrics), result.metrics


def test_charlm_beats_the_unigram_baseline(ray_local, tmp_path):
    """40 steps of the character LM (warmup + cosine, 2 accumulated micro-batches per
    worker, clipping) on a 200 kB slice already predict the validation bytes far better
    than their frequencies do. fp32: bf16 is many times slower on CPUs without bf16 units."""
    result = raytrainer.train("configs/charlm.yaml", [
        "trainer.max_steps=40", "trainer.lr_schedule.warmup_steps=10", "trainer.precision=fp32",
        "task.args.max_bytes=200000", f"run.storage={tmp_path}"], progress=False)
    m = result.metrics
    assert m["world_size"] == 2 and m["step"] == 40
    assert m["val_loss"] < 0.85 * m["val_unigram_loss"], m  # measured: 2.28 vs 2.96
    train = [r for r in result.history if "loss" in r and "val_loss" not in r]
    assert [r["step"] for r in train] == list(range(1, 41))
    for r in train:  # tokens_per_sample = block_size, and clipping logs the pre-clip norm
        assert r["tokens_per_s"] == pytest.approx(128 * r["samples_per_s"]) and r["grad_norm"] > 0
    assert_no_leaks()


@pytest.mark.slow  # a CLI run that starts a Ray of its own
def test_cli_trains_and_reports(tmp_path):
    # Where Ray looks for a `ray start` head to join: this test's own folder, holding the
    # address file of a head that is gone (stopped without `ray stop`). A plain ray.init()
    # would wait minutes on that address; the run says so and starts its own Ray.
    env = own_ray_env()
    ray_tmp = env["RAY_TMPDIR"]
    dead = f"127.0.0.1:{free_ports(1)[0]}"
    os.makedirs(os.path.join(ray_tmp, "ray"))
    with open(os.path.join(ray_tmp, "ray", "ray_current_cluster"), "w") as f:
        f.write(dead)
    proc = subprocess.run(
        [sys.executable, "-m", "raytrainer", "train", "configs/linear.yaml", "--fast-dev-run", "3",
         "--set", "scaling.num_workers=1", "--set", f"run.storage={tmp_path}", "--set", "run.name=cli"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )
    shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count(f"names a Ray at {dead} that is not running") == 1, proc.stderr
    assert "Token authentication is" not in proc.stderr  # Ray's notice about a Ray the run started itself
    assert f"finished {tmp_path}/cli: step 3, epoch 1" in proc.stdout
    assert "step 3/3" in proc.stderr  # the progress line, driver only
    rows = [json.loads(line) for line in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 3] and "val_accuracy" in rows[-1]
    assert (tmp_path / "cli" / "model.pt").stat().st_size > 0


def test_cli_config_error_exits_2_before_starting_anything(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "raytrainer", "train", "configs/linear.yaml", "--set", "trainer.epochs=3",
         "--set", f"run.storage={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown key 'trainer.epochs'" in proc.stderr and "max_epochs" in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing written
