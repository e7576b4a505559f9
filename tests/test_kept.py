"""Worker processes kept from a finished run for the next run of the same driver process
(driver/group/kept.py, worker/process/keeping.py): taken, they train as fresh ones do; a process
that holds something of its run, or whose code changed, is never taken."""

import importlib
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import raytrainer
from raytrainer.driver.group import kept
from raytrainer.worker.process import keeping

from .conftest import assert_no_leaks
from .waits import wait_until


def config(tmp_path, name, **task_args):
    return {"task": {"target": "tests.tasks:RegressionTask", "args": task_args},
            "trainer": {"max_steps": 6, "global_batch_size": 32},
            "scaling": {"num_workers": 2}, "failure": {"warm_spares": 0},
            "run": {"name": name, "storage": str(tmp_path)}}


def formed(run_dir):
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return next(e for e in events if e["event"] == "group_formed")


def worker_pids():
    from ray._private import state

    return {a["Pid"] for a in state.actors(actor_state_name="ALIVE").values() if a["ActorClassName"] == "Worker"}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_second_run_trains_in_the_first_runs_processes_and_ends_the_same(ray_local, tmp_path, strategy):
    kept.end_all()
    for name in ("first", "second"):
        cfg = config(tmp_path, name)
        cfg["trainer"]["strategy"] = strategy
        raytrainer.train(cfg, progress=False)
        if name == "first":
            first = formed(tmp_path / "first")["pids"]
            assert len(kept.kept_actors()) == 2
            assert_no_leaks()  # nothing but the two kept
    assert sorted(formed(tmp_path / "second")["pids"]) == sorted(first)
    one, two = (torch.load(tmp_path / name / "model.pt", weights_only=True) for name in ("first", "second"))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    rows = [json.loads(line) for line in (tmp_path / "second" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 7))


def test_a_run_too_short_for_a_spare_starts_none_cold_and_a_kept_process_serves_as_one(ray_local, tmp_path):
    """Default failure settings (one warm spare). A spare started cold is up a cold start
    later; a run that will end before one could be up for as long again starts none (spares.py).
    A kept process is up already: the next, smaller run takes it as its spare."""
    from ray._private import state

    def made():
        return sum(a["ActorClassName"] == "Worker" for a in state.actors().values())

    kept.end_all()
    wait_until(lambda: not worker_pids(), "the kept processes to end", 15)
    before = made()
    cfg = config(tmp_path, "three", sleep_s=0.05)
    cfg["failure"], cfg["trainer"]["max_steps"], cfg["scaling"]["num_workers"] = {}, 20, 3
    raytrainer.train(cfg, progress=False)
    assert made() - before == 3  # the workers, started cold; no spare
    assert len(kept.kept_actors()) == 3

    cfg = config(tmp_path, "two", sleep_s=0.1)
    cfg["failure"], cfg["trainer"]["max_steps"] = {}, 60
    done = []
    thread = threading.Thread(target=lambda: done.append(raytrainer.train(cfg, progress=False)))
    thread.start()
    try:  # two kept processes serve as workers, the third as the spare once training runs
        wait_until(lambda: not kept.kept_actors(), "the third kept process taken as the spare", 60,
                   alive=lambda: not done)
    finally:
        thread.join(120)
    assert done and made() - before == 3 and len(kept.kept_actors()) == 3
    assert_no_leaks()


@pytest.mark.parametrize("leave", ["thread", "env"])
def test_a_process_its_run_left_something_in_is_not_kept(ray_local, tmp_path, leave):
    kept.end_all()
    cfg = config(tmp_path, leave)
    cfg["task"] = {"target": "tests.tasks:LeakyTask", "args": {"leave": leave}}
    raytrainer.train(cfg, progress=False)
    assert kept.kept_actors() == []
    wait_until(lambda: not worker_pids(), "the workers to end", 10)
    assert_no_leaks()


def test_a_failed_run_keeps_nothing(ray_local, tmp_path):
    kept.end_all()
    with pytest.raises(raytrainer.WorkerError):
        raytrainer.train(config(tmp_path, "fails", fail_at_step=3), progress=False)
    assert kept.kept_actors() == []
    assert_no_leaks()


def test_kept_processes_end_once_unused_for_a_while(ray_local, tmp_path, monkeypatch):
    kept.end_all()
    monkeypatch.setenv("RAYTRAINER_KEEP_WORKERS", "1")
    raytrainer.train(config(tmp_path, "idle"), progress=False)
    assert len(kept.kept_actors()) == 2 and len(worker_pids()) == 2
    wait_until(lambda: not kept.kept_actors() and not worker_pids(), "the kept processes to end", 15)

    monkeypatch.setenv("RAYTRAINER_KEEP_WORKERS", "0")  # none kept
    raytrainer.train(config(tmp_path, "none"), progress=False)
    assert kept.kept_actors() == []
    assert_no_leaks()


def test_a_changed_module_or_another_directory_is_not_renewed(tmp_path, monkeypatch):
    """In this process, as a kept worker's: a module of the user's edited since it was
    imported, or a run from another directory, gets a fresh process instead."""
    (tmp_path / "usermod_kept.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("usermod_kept")

    forgotten = []  # the run's objects, dropped before the collection (a Worker's fields)

    monkeypatch.setattr(keeping, "_baseline", {})
    # This process's children before (a local Ray's daemons, started by an earlier test) are not a run's.
    before, children = set(keeping._children()), keeping._children
    monkeypatch.setattr(keeping, "_children", lambda: [pid for pid in children() if pid not in before])
    keeping.note_start()
    assert keeping.release(lambda: forgotten.append(1)) is None and forgotten == [1]
    assert keeping.renewable(os.getcwd()) is None  # taken: released again before the next
    assert keeping.renewable(os.getcwd()) == "it was not released"

    assert keeping.release(lambda: forgotten.append(1)) is None
    assert keeping.renewable(str(tmp_path)) == "the run starts from another directory"
    assert keeping.release(lambda: forgotten.append(1)) is None
    stamp = os.stat(tmp_path / "usermod_kept.py").st_mtime
    os.utime(tmp_path / "usermod_kept.py", (stamp + 5, stamp + 5))
    assert keeping.renewable(os.getcwd()) == "code it imported has changed"
    sys.modules.pop("usermod_kept")

    # What a run leaves: a thread of its own, a variable, torch's settings.
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="a-run's-thread")
    thread.start()
    try:
        assert keeping.release(lambda: forgotten.append(1)) == "threads left running: [\"a-run's-thread\"]"
    finally:
        stop.set()
        thread.join()
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert keeping.release(lambda: forgotten.append(1)) == f"child processes left running: [{child.pid}]"
    finally:
        child.kill()
        child.wait()
    monkeypatch.setenv("SET_BY_A_RUN", "1")
    assert keeping.release(lambda: forgotten.append(1)) == "environment variables changed: ['SET_BY_A_RUN']"
    monkeypatch.delenv("SET_BY_A_RUN")
    torch.set_default_dtype(torch.float64)
    try:
        assert keeping.release(lambda: forgotten.append(1)) == "torch's global settings changed"
    finally:
        torch.set_default_dtype(torch.float32)
    assert keeping.release(lambda: forgotten.append(1)) is None


def test_a_bad_keep_setting_is_a_clear_error_before_the_run_starts(ray_local, tmp_path, monkeypatch):
    monkeypatch.setenv("RAYTRAINER_KEEP_WORKERS", "soon")
    with pytest.raises(raytrainer.ConfigError, match=r"RAYTRAINER_KEEP_WORKERS='soon' must be a number of seconds"):
        raytrainer.train(config(tmp_path, "bad"), progress=False)
    assert_no_leaks()


def test_the_bench_of_a_later_run_sets_kept_processes_against_new_ones(ray_local):
    from raytrainer.bench import again

    figures = again.measure(runs=1, workers=2, steps=4)
    assert figures["runs"] == 1 and kept.kept_actors() == []  # it leaves nothing kept
    for name in ("new_run_s", "kept_run_s", "new_formed_s", "kept_formed_s"):
        assert 0 < figures[name]["min"] <= figures[name]["median"] <= figures[name]["max"], name
    assert figures["kept_over_new"] == pytest.approx(figures["kept_run_s"]["median"] / figures["new_run_s"]["median"])
    table = again.format_figures(figures)
    assert f"| {figures['new_run_s']['median']:.2f} (" in table and "kept over new (the run):" in table
    assert os.environ.get("RAYTRAINER_KEEP_WORKERS") is None  # as it found it
    assert_no_leaks()
