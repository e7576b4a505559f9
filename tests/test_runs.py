"""`raytrainer runs [STORAGE]` and `raytrainer show RUN_DIR` (driver/runs.py) on hand-written run
directories: each state from the last event and the run's lock, the ledger, failures by cause."""

import json

import pytest
import yaml

from raytrainer.driver import localray
from raytrainer.driver.cli import main


def write_run(storage, name, events, rows=(), workers=2):
    run = storage / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({
        "task": {"target": "tests.tasks:RegressionTask"}, "scaling": {"num_workers": workers},
        "trainer": {"max_steps": 10, "global_batch_size": 32, "strategy": "ddp"}}))
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def rows(steps, t0=100.0):
    return [{"step": s, "epoch": 0, "world_size": 2, "time": t0 + i, "loss": 1.0 / s} for i, s in enumerate(steps)]


def ev(event, time, step=0, **fields):
    return {"event": event, "time": time, "step": step, **fields}


@pytest.fixture
def storage(tmp_path):
    start = ev("run_started", 95)
    write_run(tmp_path, "a-done", [start, ev("finished", 110, 10, reason="completed")], rows(range(1, 11)))
    write_run(tmp_path, "b-failed", [start, ev("failed", 104, 4, cause="rank 0 raised ValueError\ntraceback")],
              rows(range(1, 5)))
    write_run(tmp_path, "c-stopped", [start, ev("stopped", 103, 3, signal="SIGTERM")], rows(range(1, 4)))
    write_run(tmp_path, "d-lost", [start, ev("group_formed", 99)], rows(range(1, 3)))  # its driver was killed
    write_run(tmp_path, "e-live", [start], rows(range(1, 3)))
    (tmp_path / "not-a-run").mkdir()
    return tmp_path


def test_runs_lists_each_run_with_its_state_step_and_goodput(storage, capsys):
    lock = localray.try_lock(storage / "e-live" / ".lock")  # a live driver holds its run's lock
    lock.write("pid 4242 on nodeA, since 2026-12-07 10:00:00\n")
    lock.flush()
    try:
        assert main(["runs", str(storage)]) == 0
    finally:
        lock.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "STATE", "STEP", "GOODPUT", "WHERE"]
    table = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(table) == {"a-done", "b-failed", "c-stopped", "d-lost", "e-live"}  # not-a-run has no config.yaml
    assert {name: row[1] for name, row in table.items()} == {
        "a-done": "finished", "b-failed": "failed", "c-stopped": "stopped", "d-lost": "unfinished", "e-live": "running"}
    assert table["a-done"][2:5] == ["10", "60.0%", str(storage / "a-done")]  # 9 s of 15 trained
    assert "(pid 4242 on nodeA" in lines[-1]
    # released: the same run now shows as unfinished (no end event, nobody holds it)
    assert main(["runs", str(storage)]) == 0
    live = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("e-live"))
    assert live.split()[1] == "unfinished"


def test_runs_of_an_empty_or_missing_storage_says_so(tmp_path, capsys):
    assert main(["runs", str(tmp_path / "none")]) == 0
    assert capsys.readouterr().out.strip() == f"no runs in {tmp_path / 'none'}"


def test_show_prints_config_metrics_ledger_and_failures_by_cause(tmp_path, capsys):
    failures = [ev("worker_failed", 104.5, 5, kind="died", rank=1),
                ev("recovered", 105, 5, seconds=0.5, steps_lost=0, failures=1, losses=1, faults=0, cause="rank 1 died"),
                ev("worker_failed", 107.5, 7, kind="error", rank=0),
                ev("recovered", 108, 7, seconds=0.5, steps_lost=1, failures=2, losses=1, faults=1,
                   cause="rank 0 raised RuntimeError")]
    train = rows(range(1, 6)) + rows(range(6, 11), 106.0)
    val = [{"step": 10, "epoch": 0, "world_size": 2, "time": 115.5, "val_loss": 0.25}]
    run = write_run(tmp_path, "shown", [ev("run_started", 95), *failures, ev("finished", 116, 10)], train + val)
    assert main(["show", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{run}: finished at step 10"
    assert out[1] == "config: tests.tasks:RegressionTask, 2 workers, 10 steps, global batch 32, ddp"
    assert out[2].startswith("last metrics: step 10, epoch 1, workers 2") and "val_loss=0.25" in out[2]
    assert out[3].startswith("goodput ") and "(2 failures: 1 died, 1 error)" in out[3]
    assert out[4] == "failures: 2 recovered from: 1 lost worker(s), 1 fault(s) of the run's own"
    assert sorted(out[5:]) == ["  1 x rank 0 raised RuntimeError", "  1 x rank 1 died"]


def test_show_of_a_directory_that_is_not_a_run_is_a_config_error(tmp_path, capsys):
    assert main(["show", str(tmp_path)]) == 2
    assert "is not a run directory" in capsys.readouterr().err


def test_runs_and_show_take_a_uri(storage, capsys):
    assert main(["runs", f"file://{storage}"]) == 0
    assert "a-done" in capsys.readouterr().out
    assert main(["show", f"file://{storage}/a-done"]) == 0
    assert "finished at step 10" in capsys.readouterr().out
