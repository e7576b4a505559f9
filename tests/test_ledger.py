"""The goodput ledger (driver/ledger.py): on synthetic events and rows, each bucket as the
events say; on a real run with a kill, checkpoints and validation, the buckets sum to the
wall time and each matches its events."""

import json
import re

import pytest
import yaml

from raytrainer.driver.cli import main
from raytrainer.driver.ledger import BUCKETS, ledger

from .conftest import assert_no_leaks

STEP = 1.0  # seconds a step, in the synthetic runs


def rows(steps, t0, step_s=STEP):
    return [{"step": s, "epoch": 0, "world_size": 2, "time": t0 + i * step_s, "loss": 1.0} for i, s in enumerate(steps)]


def ev(event, time, step=0, **fields):
    return {"event": event, "time": time, "step": step, **fields}


def test_an_undisturbed_run_is_starting_training_stopping():
    # launched at 90, first step done at 100, steps 1..11 a second apart, finished at 112
    events = [ev("run_started", 95, launched=90), ev("finished", 112, 11)]
    out = ledger(events, rows(range(1, 12), 100))
    assert out.buckets["starting"] == pytest.approx(10)
    assert out.buckets["training"] == pytest.approx(10)
    assert out.buckets["stopping"] == pytest.approx(2)
    assert sum(out.buckets.values()) == pytest.approx(out.wall_s) == pytest.approx(22)
    assert out.step_s == pytest.approx(STEP) and out.goodput == pytest.approx(10 / 22)


def test_a_recovery_is_failure_to_next_step_less_that_step_and_its_lost_steps_are_recomputed():
    # steps 1..5 at 100..104; killed at 104.5; recovered at 107 having lost 2 steps; step 6 at 111
    train = rows(range(1, 6), 100) + rows(range(6, 11), 111)
    events = [ev("run_started", 100), ev("worker_failed", 104.5, 5, kind="died"),
              ev("worker_failed", 104.6, 5, kind="interrupted"),
              ev("recovered", 107, 5, seconds=2.5, steps_lost=2),
              ev("resized", 107, 5, seconds=2.5, old_world_size=2, new_world_size=1),  # the recovery's shrink
              ev("finished", 115, 10)]
    out = ledger(events, train)
    # 104 -> 111 is 7 s, less step 6 (1 s) = 6 s: 2 steps recomputed, 4 s recovering
    assert out.buckets["recomputed"] == pytest.approx(2)
    assert out.buckets["recovering"] == pytest.approx(4)
    assert out.buckets["resizing"] == 0  # not counted twice
    assert out.buckets["training"] == pytest.approx(15 - 6)
    assert out.failures == {"died": 1}  # the interrupted peer is no failure of its own
    assert sum(out.buckets.values()) == pytest.approx(out.wall_s)
    assert "recovering (1 failure: 1 died)" in out.lines()[0]


def test_holds_are_taken_from_training_or_from_stopping_at_the_last_step():
    train = rows(range(1, 11), 100)  # 100..109
    val_here = {"step": 4, "epoch": 0, "world_size": 2, "time": 103.3, "val_loss": 0.5}  # step 4 at 103
    events = [ev("run_started", 100),
              ev("checkpoint_committed", 104.2, 5, blocked_s=0.2, rank=0),
              ev("checkpoint_committed", 104.3, 5, blocked_s=0.1, rank=1),  # the same save: counted once
              ev("validated", 106.5, 6, at_step=7, held_s=0.05, seconds=2.0),
              ev("resized", 107.5, 8, seconds=0.4, old_world_size=1, new_world_size=2),
              ev("checkpoint_committed", 109.5, 10, blocked_s=0.3, rank=0),  # the final save
              ev("finished", 110, 10)]
    out = ledger(events, train + [val_here])
    assert out.buckets["checkpoint"] == pytest.approx(0.5)
    assert out.buckets["validation"] == pytest.approx(0.35)
    assert out.buckets["resizing"] == pytest.approx(0.4)
    assert out.buckets["training"] == pytest.approx(9 - 0.2 - 0.35 - 0.4)
    assert out.buckets["stopping"] == pytest.approx(1 - 0.3)
    assert sum(out.buckets.values()) == pytest.approx(out.wall_s) == pytest.approx(10)


def test_waiting_for_capacity_is_training_below_size_not_a_bucket():
    events = [ev("run_started", 100), ev("waiting_for_capacity", 102, 2, world_size=1, size=2, missing=1),
              ev("resized", 105.2, 5, seconds=0.2, capacity_waited_s=6.0, old_world_size=1, new_world_size=2),
              ev("waiting_for_capacity", 107, 7, world_size=1, size=2, missing=1), ev("finished", 110, 10)]
    out = ledger(events, rows(range(1, 11), 100))
    assert out.below_size_s == pytest.approx(6 + 3)  # the second wait lasted to the end
    assert out.buckets["resizing"] == pytest.approx(0.2)
    assert "trained below its size for 9.0 s" in out.lines()[1]


def test_a_resumed_run_counts_its_attempts_and_leaves_the_time_between_them_out():
    first = [ev("run_started", 100), ev("checkpoint_committed", 104.1, 4, blocked_s=0), ev("stopped", 107, 7)]
    second = [ev("run_started", 1000, launched=998), ev("resumed", 1001, 4, checkpoint="step-00000004"),
              ev("finished", 1010, 10)]
    train = rows(range(1, 8), 100) + rows(range(5, 11), 1002)  # steps 5..7 done again
    out = ledger(first + second, train)
    assert out.attempts == 2
    assert out.down_s == pytest.approx(998 - 107)
    assert out.wall_s == pytest.approx(7 + 12)
    assert out.buckets["starting"] == pytest.approx(0 + 4)
    assert out.buckets["recomputed"] == pytest.approx(3)  # steps 5, 6, 7 again
    assert out.buckets["stopping"] == pytest.approx(1 + 3)
    assert out.buckets["training"] == pytest.approx(6 + 5 - 3)
    assert sum(out.buckets.values()) == pytest.approx(out.wall_s)
    assert "2 attempts" in out.lines()[1]


def test_a_driver_lost_before_any_step_is_all_starting():
    out = ledger([ev("run_started", 100, launched=99), ev("group_formed", 120)], [])
    assert out.buckets["starting"] == pytest.approx(21) and out.wall_s == pytest.approx(21) and out.goodput == 0


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_real_run_with_a_kill_a_checkpoint_and_validation(ray_local, tmp_path, capsys):
    """Through the CLI, which prints the ledger at the end; then `runs` and `show` of it."""
    cfg = {"task": {"target": "tests.tasks:RegressionTask", "args": {}},
           "trainer": {"max_steps": 16, "global_batch_size": 32, "log_every_n_steps": 4,
                       "validation": {"every_n_steps": 5}},
           "scaling": {"num_workers": 2}, "checkpoint": {"every_n_steps": 6},
           "failure": {"chaos": [{"action": "kill", "step": 9, "rank": 1}], "step_timeout_s": 4},
           "run": {"name": "gp", "storage": str(tmp_path)}}
    (tmp_path / "gp.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", str(tmp_path / "gp.yaml"), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    run_dir = tmp_path / "gp"
    saved = json.loads((run_dir / "goodput.json").read_text())
    # goodput.json keeps 4 digits, the line prints from the unrounded share: the same within 0.1%
    shown = re.search(r"goodput ([0-9.]+%) of", printed).group(1)
    assert float(shown[:-1]) == pytest.approx(100 * saved["goodput"], abs=0.06) and "recovering (1 failure: 1 died)" in printed
    events, train = read(run_dir / "events.jsonl"), [r for r in read(run_dir / "metrics.jsonl") if "loss" in r]
    start = events[0]["launched"]
    wall = events[-1]["time"] - start
    buckets = saved["buckets"]
    assert set(buckets) == set(BUCKETS)
    assert sum(buckets.values()) == pytest.approx(wall, rel=0.01) == pytest.approx(saved["wall_s"], rel=0.01)
    assert buckets["starting"] == pytest.approx(train[0]["time"] - start, abs=1e-3)
    assert buckets["stopping"] <= events[-1]["time"] - train[-1]["time"] + 1e-3
    failed = next(e for e in events if e["event"] == "worker_failed")
    after = next(r for r in train if r["time"] > next(e for e in events if e["event"] == "recovered")["time"])
    before = [r for r in train if r["time"] <= failed["time"]][-1]
    assert buckets["recovering"] + buckets["recomputed"] == pytest.approx(
        after["time"] - before["time"] - saved["step_s"], abs=0.05)
    saves = [e for e in events if e["event"] == "checkpoint_committed"]
    assert [e["step"] for e in saves] == [6, 12, 16]
    assert 0 < buckets["checkpoint"] <= sum(e["blocked_s"] for e in saves) + 1e-3
    assert buckets["validation"] > 0 and buckets["training"] > 0
    assert saved["failures"] == {"died": 1} and saved["attempts"] == 1

    assert main(["runs", str(tmp_path)]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[1].split()[:4] == ["gp", "finished", "16", shown]
    assert main(["show", str(run_dir)]) == 0
    shown = capsys.readouterr().out
    assert "finished at step 16" in shown and "1 recovered from: 1 lost worker(s)" in shown
    assert_no_leaks()


def test_a_slow_rank_is_a_note_of_the_training_it_held_back_until_its_replacement():
    # steps 1..21 a second apart; rank 1 judged 2x slow from step 1 (found at step 11), replaced at 111
    events = [ev("run_started", 100), ev("slow_worker", 110, 11, rank=1, ratio=2.0, since_step=1),
              ev("slow_worker_replaced", 111, 11, rank=1, steps_lost=0), ev("finished", 120, 21)]
    out = ledger(events, rows(range(1, 22), 100))
    assert out.slowed_s == {"1": pytest.approx(11 * 0.5)}  # from step 1's row (100) to the move (111), half of it
    assert sum(out.buckets.values()) == pytest.approx(out.wall_s)  # training, slower: no bucket
    assert any("slowed by rank 1: 27.5%" in line for line in out.lines())


def test_a_ledger_that_fails_warns_once_and_never_fails_the_run(tmp_path, monkeypatch):
    """It runs on the way out of every run and inside the controller's event log: a bug or an
    unreadable event there must not replace the run's outcome, nor stop its training."""
    from raytrainer.driver import api
    from raytrainer.driver import ledger as ledger_module

    def broken(*args):
        raise KeyError("step")

    warned = []
    monkeypatch.setattr(api, "_warn", warned.append)
    monkeypatch.setattr(ledger_module, "write", broken)
    monkeypatch.setattr(ledger_module, "ledger", broken)
    api._write_ledger(tmp_path)
    assert len(warned) == 1 and "could not be written" in warned[0] and "KeyError" in warned[0]

    class Sink:
        on, published = True, []

        def gauge(self, name, value):
            self.published.append(value)

    publish = api._goodput_series(Sink(), type("Events", (), {"events": []})(), type("Hub", (), {"history": []})())
    for kind in ("group_formed", "recovered", "finished"):
        publish({"event": kind})
    assert len(warned) == 2 and "goodput series stops" in warned[1] and Sink.published == []
