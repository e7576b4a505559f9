"""A rerun continues its run: the same command run again after its driver died (a SLURM
requeue, a RayJob retry, up-arrow after an OOM kill) finds the run by its identity and takes
over the workers the dead driver left, paused with the state in memory
(failure.driver_grace_s); with no worker left, it continues from the newest checkpoint. A
finished run's rerun is a new run; different configs never share one."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from raytrainer.config import load_config, resolve_paths
from raytrainer.driver import identity

from .conftest import assert_no_leaks
from .test_stops import USER_TASK
from .waits import Deadline


STEPS = 150


def user_dir(path, max_steps=STEPS):
    """A user's directory: their task and a config with no run.name and a relative storage."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "usertask.py").write_text(USER_TASK)
    (path / "run.yaml").write_text(
        "task: {target: usertask:SlowTask, args: {sleep_s: 0.02}}\n"
        f"trainer: {{max_steps: {max_steps}, global_batch_size: 32}}\n"
        "scaling: {num_workers: 2}\ncheckpoint: {every_n_steps: 10}\nrun: {storage: runs}\n")
    return path


def command(*extra):
    import ray

    return [sys.executable, "-m", "raytrainer", "train", "run.yaml", "--no-progress",
            "--address", ray.get_runtime_context().gcs_address, *extra]


def run(path, *extra):
    return subprocess.run(command(*extra), cwd=path, capture_output=True, text=True, timeout=600)


def run_dirs(path):
    return sorted(p for p in (path / "runs").iterdir() if p.is_dir()) if (path / "runs").exists() else []


def events(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def last_step(run_dir):
    path = run_dir / "metrics.jsonl"
    lines = [line for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []
    return json.loads(lines[-1])["step"] if lines else 0


def start_and_kill_driver(path, after_step, *extra):
    """The command started, and its process SIGKILLed once metrics.jsonl has a row past
    `after_step`; the run directory, the last step its driver recorded, the workers' pids."""
    proc = subprocess.Popen(command(*extra), cwd=path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = Deadline(300)
    while not run_dirs(path) or last_step(run_dirs(path)[0]) <= after_step:
        assert proc.poll() is None, proc.stdout.read()
        assert not deadline.passed(), "the run did not reach its step"
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    (run_dir,) = run_dirs(path)
    pids = [e for e in events(run_dir) if e["event"] == "group_formed"][-1]["pids"]
    return run_dir, last_step(run_dir), pids


def weights(run_dir):
    return torch.load(run_dir / "model.pt", weights_only=True)


def identical(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def reference(ray_local, tmp_path_factory):
    """The undisturbed run's weights."""
    path = user_dir(tmp_path_factory.mktemp("reference"))
    done = run(path)
    assert done.returncode == 0, done.stderr
    return weights(run_dirs(path)[0])


def test_the_same_command_after_its_driver_was_killed_takes_over_its_workers_and_ends_bit_identical(
        reference, tmp_path):
    path = user_dir(tmp_path / "user")
    run_dir, killed_at, pids = start_and_kill_driver(path, 40)
    # run.resume never on that directory: an error, and the workers are left to their run.
    never = run(path, "--set", f"run.name={run_dir.name}", "--set", "run.resume=never")
    assert never.returncode == 2 and "already holds a run and run.resume=never" in never.stderr, never.stderr

    done = run(path)
    assert done.returncode == 0, done.stderr
    assert run_dirs(path) == [run_dir], "the rerun made a second run directory"
    formed = [e for e in events(run_dir) if e["event"] == "group_formed"]
    assert formed[-1].get("taken_over") and formed[-1]["pids"] == pids  # the same processes
    assert formed[-1]["step"] >= killed_at - 1
    assert f"continuing {run_dir} at step {formed[-1]['step']} from its 2 workers' memory" in done.stderr
    assert "its driver was lost" in done.stderr
    assert not [e for e in events(run_dir) if e["event"] == "resumed"]  # no checkpoint read
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert steps == list(range(1, STEPS + 1)), "a step's row is missing or written twice"
    assert identical(weights(run_dir), reference), "the taken-over run's weights differ from the undisturbed run's"
    assert_no_leaks()

    # Finished: the same command again is a new run, and says so.
    again = run(path, "--set", "trainer.max_steps=3")  # another config: a new run too, never this one
    assert again.returncode == 0, again.stderr
    assert len(run_dirs(path)) == 2 and "new run" in again.stderr
    same = run(path)
    assert same.returncode == 0, same.stderr
    assert f"the last run of this config, {run_dir}, finished at step {STEPS}: starting a new run" in same.stderr
    assert len(run_dirs(path)) == 3
    assert_no_leaks()


def test_with_its_workers_killed_too_the_rerun_continues_from_the_newest_checkpoint(reference, tmp_path):
    path = user_dir(tmp_path / "user")
    run_dir, _, pids = start_and_kill_driver(path, 40)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)

    done = run(path)
    assert done.returncode == 0, done.stderr
    assert run_dirs(path) == [run_dir]
    resumed = [e for e in events(run_dir) if e["event"] == "resumed"]
    assert len(resumed) == 1 and resumed[0]["step"] >= 40
    assert f"from checkpoint {resumed[0]['checkpoint']}" in done.stderr
    assert identical(weights(run_dir), reference)
    assert_no_leaks()


def test_workers_no_driver_takes_over_end_after_the_grace_and_release_ends_them_at_once(ray_local, tmp_path):
    grace = 3
    path = user_dir(tmp_path / "user", max_steps=100000)
    _, _, pids = start_and_kill_driver(path, 5, "--set", f"failure.driver_grace_s={grace}")
    assert all(alive(pid) for pid in pids)  # they outlive their driver...
    deadline = Deadline(grace + 10)
    while any(alive(pid) for pid in pids):  # ...for the grace, then end by themselves
        assert not deadline.passed(), "the workers outlived their grace"
        time.sleep(0.2)
    assert_no_leaks(timeout_s=5)  # with their placement groups

    other = user_dir(tmp_path / "other", max_steps=100000)
    run_dir, _, pids = start_and_kill_driver(other, 5)  # the default grace: minutes
    time.sleep(2)
    assert all(alive(pid) for pid in pids)
    # Another run that needs 3 finds no room (the tests' Ray has 4 CPUs; they hold 2): its error
    # says who holds it.
    crowded = run(user_dir(tmp_path / "third"), "--set", "scaling.num_workers=3", "--set", "scaling.min_workers=3",
                  "--set", "scaling.placement_timeout_s=3")
    assert crowded.returncode == 1 and f"The workers of {run_dir}, whose driver was lost" in crowded.stderr, \
        crowded.stderr
    import ray

    released = subprocess.run([sys.executable, "-m", "raytrainer", "release", str(run_dir), "--address",
                               ray.get_runtime_context().gcs_address], capture_output=True, text=True, timeout=120)
    assert released.returncode == 0, released.stderr
    assert re.search(r"ended [23] worker\(s\)", released.stdout), released.stdout  # its warm spare too
    assert_no_leaks()
    assert not any(alive(pid) for pid in pids)


def config_at(tmp_path, **trainer):
    config = load_config({"task": {"target": "examples.linear:LinearTask"},
                          "trainer": {"max_steps": 10, **trainer}, "run": {"storage": "runs"}})
    resolve_paths(config, str(tmp_path))
    return config


def test_a_run_is_identified_by_its_config_and_its_scheduler_job_not_by_its_name_or_resume(tmp_path):
    key = identity.of(config_at(tmp_path), {}).key
    assert identity.of(config_at(tmp_path), {}).key == key
    assert identity.of(config_at(tmp_path, max_steps=11), {}).key != key
    assert identity.of(config_at(tmp_path / "elsewhere"), {}).key != key  # another storage and directory
    named = config_at(tmp_path)
    named.run.name, named.run.resume = "mine", "never"
    assert identity.of(named, {}).key == key
    slurm = identity.of(config_at(tmp_path), {"SLURM_JOB_ID": "123"})
    assert slurm.key != key and slurm.source == "SLURM job 123 and the config"
    assert identity.of(config_at(tmp_path), {"SLURM_JOB_ID": "124"}).key != slurm.key
    array = identity.of(config_at(tmp_path), {"SLURM_JOB_ID": "130", "SLURM_ARRAY_JOB_ID": "129",
                                              "SLURM_ARRAY_TASK_ID": "1"})
    assert array.source.startswith("SLURM job 129_1")
    assert identity.of(config_at(tmp_path), {"RAYTRAINER_RUN_ID": "nightly"}).source.startswith(
        "RAYTRAINER_RUN_ID=nightly")


def test_how_a_runs_last_attempt_ended_is_read_from_its_events():
    start = {"event": "run_started", "step": 0}
    assert identity.last_end([start, {"event": "finished", "step": 9}]) == ("finished", "finished at step 9")
    assert identity.last_end([start, {"event": "stopped", "step": 4, "signal": "SIGTERM"}])[1] == \
        "stopped by SIGTERM at step 4"
    assert identity.last_end([start, {"event": "failed", "step": 3, "cause": "ValueError: bad\nmore"}])[1] == \
        "failed at step 3: ValueError: bad"
    # An end of an earlier attempt does not count for the last one.
    ended, how = identity.last_end([start, {"event": "finished", "step": 9}, start,
                                    {"event": "group_formed", "step": 12}])
    assert ended is None and how == "its driver was lost near step 12, with no end recorded"
