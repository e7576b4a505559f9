"""A slow worker is not a hung one: the clock the hang check reads a worker by (its working
thread's time running or waiting for a core), the decision it makes with it, and the test
suite's own waits and hang check on a slow day (docs/slow-day.md). No Ray here."""

import json
import threading
import time

import pytest

from raytrainer.contract import Status
from raytrainer.driver.policy import BUSY_SHARE, progressed
from raytrainer.worker.busy import busy_seconds

from .conftest import unexpected_hangs
from .waits import Deadline, patience, slowness, wait_until


def _thread_share(target) -> float:
    """The share of a second that a thread running `target` (until told to stop) was busy."""
    ids, stop = {}, threading.Event()

    def run():
        ids["ids"] = (threading.get_native_id(), threading.get_ident())
        target(stop)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_until(lambda: "ids" in ids, "the thread to start")
    b0, t0 = busy_seconds(*ids["ids"]), time.monotonic()
    time.sleep(1.0)
    share = (busy_seconds(*ids["ids"]) - b0) / (time.monotonic() - t0)
    stop.set()
    thread.join()
    return share


def test_a_thread_that_works_is_busy_and_one_that_waits_is_not():
    """However loaded the machine: a thread that wants to run either runs or waits in the
    run queue, and both count; one blocked (a stuck read, a hung kernel) counts nothing."""

    def spin(stop):
        while not stop.is_set():
            sum(range(1000))

    assert _thread_share(spin) >= BUSY_SHARE
    assert _thread_share(lambda stop: stop.wait()) < BUSY_SHARE


def test_a_thread_gone_has_no_clock():
    assert busy_seconds(2**31 - 1, None) is None


def test_progress_is_a_move_or_work_on_the_worker_own_clock():
    at = Status(5, 40, "user", busy_s=10.0)
    assert progressed(None, at, 1.0)  # a first answer
    assert progressed(at, Status(5, 41, "user", busy_s=10.0), 1.0)  # a batch
    assert progressed(at, Status(5, 40, "collective", busy_s=10.0), 1.0)  # a phase
    # Slow, not stuck: it ran (or waited for a core) most of the 2 s, and finished nothing.
    assert progressed(at, Status(5, 40, "user", busy_s=11.5), 2.0)
    # Stuck: blocked the whole time (a stuck read polled every 0.1 s counts a little).
    assert not progressed(at, Status(5, 40, "user", busy_s=10.05), 2.0)
    # A worker that cannot tell its clock (another platform) is judged by its moves alone.
    assert not progressed(Status(5, 40, "user"), Status(5, 40, "user"), 2.0)


def test_waits_follow_the_machine(monkeypatch):
    monkeypatch.setenv("RAYTRAINER_TEST_SLOW", "3")
    assert slowness() >= 3 and patience(10) >= 30
    monkeypatch.setenv("RAYTRAINER_TEST_SLOW", "")
    assert slowness() >= 1
    monkeypatch.setenv("RAYTRAINER_TEST_SLOW", "fast")
    with pytest.raises(ValueError, match="RAYTRAINER_TEST_SLOW='fast' must be a number"):
        slowness()
    monkeypatch.delenv("RAYTRAINER_TEST_SLOW")
    deadline = Deadline(0.0)
    assert deadline.passed()
    with pytest.raises(AssertionError, match="timed out waiting for nothing"):
        wait_until(lambda: False, "nothing", 0.0)


def test_a_hung_worker_in_any_run_is_found_once(tmp_path):
    """The check every test gets (conftest._no_healthy_worker_hung) reads each run's new
    events: a `hung` failure is reported once, other failures not at all."""
    unexpected_hangs(tmp_path)  # what other tests wrote is theirs
    run = tmp_path / "run"
    run.mkdir()
    events = [{"event": "worker_failed", "time": time.time(), "step": 3, "rank": 1, "kind": "died", "cause": "x"},
              {"event": "worker_failed", "time": time.time(), "step": 4, "rank": 2, "kind": "hung",
               "cause": "no progress for 3 s"}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (found,) = unexpected_hangs(tmp_path)
    assert found.startswith("run: rank 2 at step 4: no progress")
    assert unexpected_hangs(tmp_path) == []
