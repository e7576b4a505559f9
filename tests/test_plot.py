"""`raytrainer plot`: PNGs of runs written by hand in the run-directory format."""

import json
import math

import pytest

from raytrainer.driver.cli import main
from raytrainer.errors import ConfigError
from raytrainer.driver.plot import COLUMNS, DPI, PANEL_H, PANEL_W, plot_runs


def write_run(path, *, steps=20, failure=True, val_metrics=("loss", "accuracy"), partial_last_line=False):
    """A 2-worker run that loses a worker at step 8, recovers, and grows to 3 at step 14."""
    path.mkdir(parents=True)
    t0 = 1_700_000_000.0
    events = [{"event": "run_started", "time": t0, "step": 0, "num_workers": 2},
              {"event": "group_formed", "time": t0 + 2, "step": 0, "world_size": 2}]
    rows = []
    for step in range(1, steps + 1):
        size = 3 if failure and step > 14 else 2
        t = t0 + 2 + step * 0.1 + (3 if failure and step > 8 else 0)
        rows.append({"step": step, "epoch": (step - 1) // 10, "world_size": size, "time": t,
                     "loss": 1.0 / step, "accuracy": 1 - 1.0 / step, "lr": 0.1 * (1 - step / steps),
                     "samples_per_s": 640.0 + step})
        if step % 10 == 0:
            val = {f"val_{k}": 0.5 / step for k in val_metrics}
            rows.append({"step": step, "epoch": (step - 1) // 10, "world_size": size, "time": t, **val})
    if failure:
        events += [{"event": "worker_failed", "time": t0 + 3, "step": 8, "rank": 1, "world_size": 1},
                   {"event": "recovered", "time": t0 + 5.5, "step": 8, "seconds": 2.5, "lost_steps": 0,
                    "world_size": 2},
                   {"event": "resized", "time": t0 + 6.5, "step": 14, "old_world_size": 2,
                    "new_world_size": 3}]
    events.append({"event": "finished", "time": rows[-1]["time"] + 0.5, "step": steps})
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if partial_last_line:
        text += '{"step": 21, "lo'
    (path / "metrics.jsonl").write_text(text)
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def read_png(path):
    import matplotlib.image

    return matplotlib.image.imread(str(path))


def expected_shape(panels):
    rows = math.ceil(panels / COLUMNS)
    return round(PANEL_H * rows * DPI), round(PANEL_W * COLUMNS * DPI)


def test_one_run_with_failure_and_resize(tmp_path):
    run = write_run(tmp_path / "run-a")
    result = plot_runs([run])
    assert result.path == run / "plot.png" and result.path.stat().st_size > 0
    # loss (+val_loss), accuracy (+val_accuracy), lr, throughput, world size, the ledger's timeline
    assert result.panels == ["loss", "accuracy", "learning rate", "throughput", "world size", "where the time went"]
    assert read_png(result.path).shape[:2] == expected_shape(6)


def test_two_runs_overlaid_and_the_cli(tmp_path, capsys):
    a = write_run(tmp_path / "a")
    # A second run that logs a different validation metric, and was cut off mid-line.
    b = write_run(tmp_path / "b", steps=30, failure=False, val_metrics=("loss", "mae"), partial_last_line=True)
    out = tmp_path / "out" / "both.png"
    assert main(["plot", str(a), str(b), "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    # Panels are the union: loss, accuracy, mae, lr, throughput, world size, timeline.
    assert read_png(out).shape[:2] == expected_shape(7)
    assert plot_runs([a, b], tmp_path / "again.png").panels[:3] == ["loss", "accuracy", "mae"]


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(ConfigError, match="not a directory"):
        plot_runs([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="not a run directory"):
        plot_runs([tmp_path / "empty"])
    run = write_run(tmp_path / "run")
    with pytest.raises(ConfigError, match="PNG"):
        plot_runs([run], tmp_path / "plot.svg")
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err
