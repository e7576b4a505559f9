"""Bad storage and bad input, from outside, with default settings.

A full disk (a real one: a small tmpfs, where this process may mount one) and an S3
endpoint that goes down (moto's server, stopped mid-run and started again): training goes
on, a failed save is one warning and a checkpoint_failed event, nothing half-written is
committed, the previous checkpoint is kept (retention too), and saves commit again once
the storage is back. A missing dataset file and a task whose __init__ raises fail the run
at once (exit 1) with the file or the task, the rank and the traceback: no retry loop."""

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch

import raytrainer
from raytrainer.checkpoint import Checkpoints, Storage
from raytrainer.config import CheckpointConfig

from .conftest import ROOT, assert_no_leaks
from .ray_procs import own_ray_env


@contextlib.contextmanager
def small_disk(path, size="6m"):
    """A real file system of `size` (tmpfs), mounted at `path`; skips where mounting is not
    allowed (not root, or no CAP_SYS_ADMIN in a container)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(disk, leave=64 * 1024):
    """Take all but `leave` bytes of the disk's free space: the file that does it."""
    stat = os.statvfs(disk)
    filler = disk / f"filler-{uuid.uuid4().hex[:6]}"
    with open(filler, "wb") as f:
        with contextlib.suppress(OSError):
            f.write(b"\0" * max(0, stat.f_bavail * stat.f_frsize - leave))
    return filler


def events_of(path):
    with contextlib.suppress(FileNotFoundError):
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return []


def state(step, size=300_000):
    return {"model": {"w": torch.full((size,), float(step))}, "loop": {"step": step}}


def test_a_write_that_fills_the_disk_leaves_nothing_and_keeps_the_last_good_checkpoint(tmp_path):
    with small_disk(tmp_path / "disk", "4m") as disk:
        ckpts = Checkpoints(Storage(str(disk)), "run", CheckpointConfig(keep_last=1))
        ckpts.write(1, state(1), {})  # about 1.2 MB
        filler = fill(disk)
        with pytest.raises(OSError, match="No space left on device"):
            ckpts.write(2, state(2), {})
        names = sorted(p.name for p in (disk / "run" / "checkpoints").iterdir())
        assert names == ["step-00000001"]  # the partial step-2 is gone, step 1 (keep_last=1) is kept
        assert ckpts.load_latest()[0].step == 1
        filler.unlink()
        ckpts.write(3, state(3), {})
        assert [c.step for c in ckpts.committed()] == [3]


def run_config(storage, name, **task_args):
    return {
        # ~1 MB of state (20000 hidden units, SGD momentum); 0.1 s a step: time to act
        "task": {"target": "tests.tasks:RegressionTask",
                 "args": {"num_samples": 4096, "hidden": 20000, "sleep_s": 0.1, **task_args}},
        "trainer": {"max_steps": 80, "global_batch_size": 32},
        "scaling": {"num_workers": 2},
        "checkpoint": {"every_n_steps": 5, "keep_last": 1},
        "run": {"name": name, "storage": str(storage)},
        "loggers": [],
    }


def test_a_full_disk_mid_run_skips_saves_keeps_the_last_checkpoint_and_commits_again(ray_local, tmp_path, recwarn):
    with small_disk(tmp_path / "disk", "8m") as disk:
        run = disk / "full"
        seen = {}

        def disk_fills_then_frees():  # from outside, on what the run's events say
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not any(e["event"] == "checkpoint_committed"
                                                          for e in events_of(run / "events.jsonl")):
                time.sleep(0.05)
            filler = fill(disk)
            while time.monotonic() < deadline:
                failed = [e for e in events_of(run / "events.jsonl") if e["event"] == "checkpoint_failed"]
                if failed:
                    seen["failed"] = failed[0]
                    seen["kept"] = [c.step for c in Checkpoints(Storage(str(disk)), "full",
                                                                CheckpointConfig()).committed()]
                    break
                time.sleep(0.05)
            filler.unlink()

        watcher = threading.Thread(target=disk_fills_then_frees, daemon=True)
        watcher.start()
        result = raytrainer.train(run_config(disk, "full"), progress=False)
        watcher.join()
        warned = [str(w.message) for w in recwarn if "the checkpoint of step" in str(w.message)]
        events = events_of(run / "events.jsonl")
        failed = [e for e in events if e["event"] == "checkpoint_failed"]
        committed = [e["step"] for e in events if e["event"] == "checkpoint_committed"]
        assert failed and "No space left on device" in failed[0]["cause"] and failed[0]["rank"] == 0
        # The last good checkpoint outlived the failed save (keep_last 1), and a later one committed.
        assert seen["kept"] and seen["kept"][-1] < failed[0]["step"] and seen["kept"][-1] in committed
        assert committed[-1] == 80 and events[-1]["event"] == "finished" and (run / "model.pt").is_file()
        # One warning per failed save, saying what is kept; nothing half-written left
        assert len(warned) == len(failed) and all("training goes on" in w for w in warned)
        assert all((p / "COMMITTED").is_file() for p in (run / "checkpoints").iterdir())
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if "loss" in r] == list(range(1, 81))  # the metrics too
        assert result.metrics["step"] == 80
    assert_no_leaks()


CONFIG = """
task: {target: tests.tasks:RegressionTask, args: {num_samples: 4096, hidden: 20000, sleep_s: 0.1}}
trainer: {max_steps: 80, global_batch_size: 32}
scaling: {num_workers: 2}
checkpoint: {every_n_steps: 5, keep_last: 1, async: %s}
run: {name: %s, storage: "s3://bucket/runs"}
loggers: []
"""


@pytest.mark.slow  # its CLI starts a Ray of its own: workers read the endpoint from their environment
@pytest.mark.parametrize("async_save", [False, True])
def test_an_s3_endpoint_down_mid_run_skips_saves_and_later_saves_commit_again(tmp_path, monkeypatch, async_save):
    from moto.server import ThreadedMotoServer
    import pyarrow.fs as pafs

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    for key, value in {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test",
                       "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    fs = pafs.S3FileSystem(endpoint_override=f"http://{host}:{port}", access_key="test", secret_key="test",
                           region="us-east-1", allow_bucket_creation=True)
    fs.create_dir("bucket")
    storage = Storage("s3://bucket/runs")
    name = f"down-{uuid.uuid4().hex[:8]}"  # moto's buckets live as long as this process
    (tmp_path / "down.yaml").write_text(CONFIG % (str(async_save).lower(), name))
    proc = subprocess.Popen([sys.executable, "-m", "raytrainer", "train", str(tmp_path / "down.yaml"), "--no-progress"],
                            cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=own_ray_env())
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        def committed():
            return [c.step for c in Checkpoints(storage, name, CheckpointConfig()).committed()]

        deadline = time.monotonic() + 300
        while not committed() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        kept = committed()
        server.stop()  # the endpoint goes down
        while not any("could not be written" in line for line in lines) and time.monotonic() < deadline \
                and proc.poll() is None:
            time.sleep(0.1)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)  # back, with what it held
        server.start()
        assert proc.wait(timeout=300) == 0, "".join(lines)
        reader.join(timeout=10)
        events = [json.loads(line) for line in fs.open_input_stream(f"bucket/runs/{name}/events.jsonl").read()
                  .decode().splitlines()]
        failed = [e for e in events if e["event"] == "checkpoint_failed"]
        done = [e["step"] for e in events if e["event"] == "checkpoint_committed"]
        assert kept and failed and all(e["step"] > kept[-1] for e in failed)
        assert "NETWORK_CONNECTION" in failed[0]["cause"] or "connect" in failed[0]["cause"].lower()
        assert done[-1] == 80 and committed() == [80] and kept[-1] in done
        err = "".join(lines)
        assert err.count("raytrainer: warning: the checkpoint of step") == len(failed)
        names = [i.base_name for i in fs.get_file_info(pafs.FileSelector(f"bucket/runs/{name}/checkpoints"))]
        assert names == ["step-00000080"]  # nothing half-written left behind
        assert fs.get_file_info(f"bucket/runs/{name}/model.pt").type == pafs.FileType.File
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server.stop()


def test_a_missing_dataset_file_fails_at_once_naming_the_file_the_rank_and_the_traceback(ray_local, tmp_path):
    started = time.monotonic()
    with pytest.raises(raytrainer.WorkerError) as info:
        raytrainer.train({**run_config(tmp_path, "nodata"), "task": {
            "target": "tests.bad_tasks:DatasetFileTask", "args": {"path": str(tmp_path / "train.pt")}}},
            progress=False)
    text = str(info.value)
    assert "FileNotFoundError" in text and str(tmp_path / "train.pt") in text and "rank " in text
    assert "bad_tasks.py" in info.value.traceback and "in train_dataset" in info.value.traceback
    events = events_of(tmp_path / "nodata" / "events.jsonl")
    assert not any(e["event"] == "recovered" for e in events) and events[-1]["event"] == "failed"
    print(f"missing dataset file: failed in {time.monotonic() - started:.1f} s")
    assert_no_leaks()


def test_a_task_whose_init_raises_fails_at_once_naming_the_task_and_the_traceback(ray_local, tmp_path):
    with pytest.raises(raytrainer.RaytrainerError) as info:
        raytrainer.train({**run_config(tmp_path, "noinit"), "task": {"target": "tests.bad_tasks:BrokenInitTask"}},
                         progress=False)
    text = str(info.value)
    assert "BrokenInitTask" in text and "no tokenizer configured" in text and "bad_tasks.py" in text
    events = events_of(tmp_path / "noinit" / "events.jsonl")
    assert not any(e["event"] == "recovered" for e in events)
    assert_no_leaks()


# ---------------------------------------------------------------------------- time-based checkpoints


def test_the_requests_ride_the_reduction_as_one_number_that_keeps_both():
    from raytrainer.worker.state.carrier import decode_flags, encode_flags

    for world in (1, 2, 3, 8, 512):
        for pauses in sorted({0, 1, world}):
            for saves in sorted({0, 1, world}):
                total = sum(encode_flags(r < pauses, r < saves, world) for r in range(world))
                mean = float(torch.tensor(total, dtype=torch.float32) / world)  # as the ranks read it
                assert decode_flags(mean, world) == (pauses > 0, saves > 0), (world, pauses, saves)


def test_the_time_trigger_backs_off_after_a_failed_save_and_never_waits_longer_than_the_interval(tmp_path):
    from raytrainer.worker.state.saver import CheckpointSaver

    from .writers import FailingCheckpoints

    cfg = CheckpointConfig(every_n_minutes=30)
    saver = CheckpointSaver(FailingCheckpoints(Storage(str(tmp_path)), "run", cfg, fail_from=2), cfg,
                            lambda ckpt, path: None)
    assert saver.retry_in() == 1800 and not saver.time_due()
    saver.last_attempt -= 1801
    assert saver.time_due()
    saver.save(1, lambda: state(1, 10), {})
    assert not saver.time_due() and saver.committed_step == 1
    waits = []
    for step in range(2, 9):
        saver.save(step, lambda: state(step, 10), {})
        waits.append(saver.retry_in())
    assert waits == [60, 120, 240, 480, 960, 1800, 1800]  # 1, 2, 4 ... minutes, at most every_n_minutes
    assert CheckpointSaver(None, CheckpointConfig(every_n_minutes=None), lambda c, p: None).retry_in() is None


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_time_based_checkpoint_is_saved_mid_run_at_one_step_on_every_rank(ray_local, tmp_path, strategy):
    """No every_n_steps: rank 0's clock asks, every rank saves at the step the reduction
    agreed (under FSDP every rank writes its shards: ranks that disagreed would hang)."""
    cfg = run_config(tmp_path, strategy, sleep_s=0.05, hidden=16)
    cfg["trainer"] = {"max_steps": 40, "global_batch_size": 32, "strategy": strategy}
    cfg["checkpoint"] = {"every_n_minutes": 0.01, "keep_last": 100}  # 0.6 s
    raytrainer.train(cfg, progress=False)
    events = events_of(tmp_path / strategy / "events.jsonl")
    steps = [e["step"] for e in events if e["event"] == "checkpoint_committed"]
    rows = [json.loads(line) for line in (tmp_path / strategy / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) >= 2 and steps[-1] == 40 and steps == sorted(set(steps)), (
        events, rows[-1]["time"] - rows[0]["time"])
    assert not any(e["event"] in ("worker_failed", "checkpoint_failed") for e in events)
    assert [c.step for c in Checkpoints(Storage(str(tmp_path)), strategy, CheckpointConfig()).committed()] == steps
    assert_no_leaks()
