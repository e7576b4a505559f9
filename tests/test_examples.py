"""The shipped examples train as their configs say, with 2 workers, and the CLI runs them."""

import json
import subprocess
import sys

import pytest

import raytrainer

from .conftest import ROOT


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


def test_cli_trains_and_reports(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "raytrainer", "train", "configs/linear.yaml", "--fast-dev-run", "3",
         "--set", "scaling.num_workers=1", "--set", f"run.storage={tmp_path}", "--set", "run.name=cli"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
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
