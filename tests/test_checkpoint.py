"""Checkpoints: atomic commit, corruption fallback, retention, S3, exact resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import raytrainer
from raytrainer.checkpoint import Checkpoints, Storage
from raytrainer.config import CheckpointConfig, KeepBestConfig

from .conftest import ROOT, assert_no_leaks
from .ray_procs import own_ray_env
from .waits import Deadline


def store(tmp_path, **cfg):
    return Checkpoints(Storage(str(tmp_path)), "run", CheckpointConfig(**cfg))


def state(step):
    return {"model": {"w": torch.full((3,), float(step))}, "loop": {"step": step}}


def loaded_step(found):
    ckpt, data = found
    import io

    return ckpt.step, torch.load(io.BytesIO(data), weights_only=True)["loop"]["step"]


def saver(checkpoints, commits, **cfg):
    from raytrainer.worker.state.saver import CheckpointSaver

    return CheckpointSaver(checkpoints, CheckpointConfig(**cfg), lambda ckpt, path: commits.append(ckpt.step))


def test_an_async_save_writes_what_a_sync_one_does_from_a_process_of_its_own(tmp_path):
    model = torch.nn.Linear(64, 32)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()

    def full_state():
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "loop": {"step": 1},
                "flags": torch.tensor([True, False]), "scalar": torch.tensor(3.5, dtype=torch.float64)}

    commits = []
    sync = saver(store(tmp_path / "sync", keep_last=5), commits)
    sync.save(1, full_state, {"loss": 1.0})
    writer = saver(store(tmp_path / "async", keep_last=5), commits, async_save=True)
    writer.save(1, full_state, {"loss": 1.0})
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():  # training goes on: the save holds the state as it was
        model.weight.add_(1.0)
    writer.save(2, full_state, {"loss": 0.5})
    writer.close()
    assert commits == [1, 1, 2] and set(writer.blocked_s) == {1, 2}
    import io

    (_, one_sync), (_, one_async) = (store(tmp_path / d, keep_last=5).load_latest() if d == "sync" else
                                     (None, store(tmp_path / d).storage.read("run/checkpoints/step-00000001/state.pt"))
                                     for d in ("sync", "async"))
    a, b = (torch.load(io.BytesIO(data), weights_only=True) for data in (one_sync, one_async))
    assert a["model"].keys() == b["model"].keys() and a["loop"] == b["loop"]
    assert all(torch.equal(a["model"][k], b["model"][k]) and torch.equal(b["model"][k], expected[k]) for k in expected)
    assert torch.equal(a["optimizer"]["state"][0]["exp_avg"], b["optimizer"]["state"][0]["exp_avg"])
    assert torch.equal(a["flags"], b["flags"]) and b["scalar"].dtype == torch.float64 and b["scalar"].item() == 3.5
    # each tensor a storage of its own, as a synchronous save writes it
    assert b["model"]["weight"].untyped_storage().nbytes() == b["model"]["weight"].numel() * 4
    two = torch.load(io.BytesIO(store(tmp_path / "async").load_latest()[1]), weights_only=True)
    assert torch.equal(two["model"]["weight"], expected["weight"] + 1)
    assert writer._writer._proc is None  # closed: its process is gone


@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_save_is_reported_and_skipped_and_only_a_failed_final_save_raises(tmp_path, monkeypatch,
                                                                                async_save):
    from raytrainer.errors import StorageError
    from raytrainer import checkpoint as checkpoint_module

    from .writers import FailingCheckpoints

    monkeypatch.setattr(checkpoint_module, "FINAL_BACKOFF_S", (0.01, 0.01))
    commits, failures = [], []
    checkpoints = FailingCheckpoints(Storage(str(tmp_path)), "run", CheckpointConfig(), fail_from=2)
    writer = saver(checkpoints, commits, async_save=async_save)
    writer.on_failure = lambda step, path, cause: failures.append((step, cause))
    writer.save(1, lambda: state(1), {})
    writer.save(2, lambda: state(2), {})  # fails: reported, not raised
    writer.save(3, lambda: state(3), {})
    writer.finish()
    assert commits == [1] and [step for step, _ in failures] == [2, 3]
    assert all("no space left on device" in cause for _, cause in failures)
    assert writer.failures_in_row == 2 and [c.step for c in checkpoints.committed()] == [1]
    with pytest.raises(StorageError, match=r"final checkpoint \(step 4\) could not be written to .*step-00000004 "
                       r"\(3 tries.*no space left on device.*Kept: the checkpoint of step 1, .*step-00000001"):
        writer.save(4, lambda: state(4), {}, final=True)
    assert [c.step for c in checkpoints.committed()] == [1]  # retention never ran for a failed save
    checkpoints.fail_from = 99  # the storage is back: the final save succeeds on a retry
    writer.save(4, lambda: state(4), {}, final=True)
    assert commits == [1, 4] and writer.failures_in_row == 0
    if not async_save:
        return
    # A saver no one holds any more (its loop replaced after a recovery) lets its writer go.
    import gc

    from .ray_procs import live_processes

    pid = writer._writer._proc.pid
    del writer
    gc.collect()
    deadline = Deadline(30)
    while any(p == pid for p, _, _ in live_processes()) and not deadline.passed():
        time.sleep(0.1)
    assert all(p != pid for p, _, _ in live_processes())


KILLED_MID_WRITE = """
import sys, time
from raytrainer.checkpoint import Storage
from raytrainer.config import CheckpointConfig
from raytrainer.worker.state.saver import CheckpointSaver
from tests.writers import SlowCheckpoints

if __name__ == "__main__":
    checkpoints = SlowCheckpoints(Storage(sys.argv[1]), "run", CheckpointConfig(), marker=sys.argv[2])
    saver = CheckpointSaver(checkpoints, CheckpointConfig(async_save=True), lambda ckpt, path: None)
    saver.save(1, lambda: {"w": __import__("torch").ones(1000)}, {})
    time.sleep(600)
"""


class FakeCudart:
    """torch.cuda.cudart()'s two calls the async writer's pinning makes, with the codes a real
    runtime answers (712: cudaErrorHostMemoryAlreadyRegistered)."""

    def __init__(self, register_code=0):
        self.register_code, self.registered, self.unregistered = register_code, [], []

    def cudaHostRegister(self, ptr, size, flags):
        self.registered.append(ptr)
        return self.register_code

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


def test_the_async_writers_pinned_buffer_is_unpinned_when_it_dies_and_a_failed_pin_leaves_no_cuda_error(
        monkeypatch):
    # On an H100 (the GPU check): a buffer freed while registered made the next CUDA call in the
    # process fail ("resource already mapped"), and a failed cudaHostRegister stayed as the
    # runtime's last error, raised by the next kernel launch: a training step failing for a pin
    # that was only an optimisation. The CUDA side is faked here; the GPU check runs it for real.
    import gc

    from raytrainer.worker.state import writer

    cleared = []
    monkeypatch.setattr(writer, "_clear_cuda_error", lambda: cleared.append(1))
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    buffer = torch.empty(4096, dtype=torch.uint8).share_memory_()
    ptr = buffer.data_ptr()
    assert writer._pin(buffer) is True and cudart.registered == [ptr] and cudart.unregistered == []
    del buffer
    gc.collect()
    assert cudart.unregistered == [ptr] and cleared == []

    cudart = FakeCudart(register_code=712)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    buffer = torch.empty(4096, dtype=torch.uint8).share_memory_()
    assert writer._pin(buffer) is False and cleared == [1]
    del buffer
    gc.collect()
    assert cudart.unregistered == []  # nothing was registered, nothing to undo


def test_a_writer_dies_with_its_worker_killed_mid_write(tmp_path):
    from .ray_procs import live_processes

    marker = tmp_path / "writing"
    script = tmp_path / "worker.py"
    script.write_text(KILLED_MID_WRITE)
    worker = subprocess.Popen([sys.executable, str(script), str(tmp_path), str(marker)], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": ROOT})
    try:
        deadline = Deadline(120)
        while not marker.exists() and not deadline.passed() and worker.poll() is None:
            time.sleep(0.1)
        writer = int(marker.read_text())  # it is writing now
    finally:
        worker.kill()
        worker.wait()
    deadline = Deadline(30)
    while any(pid == writer for pid, _, _ in live_processes()) and not deadline.passed():
        time.sleep(0.1)
    assert all(pid != writer for pid, _, _ in live_processes()), "the writer outlived its worker"
    assert not list(tmp_path.glob("run/checkpoints/*/COMMITTED"))


def test_default_run_names_started_in_the_same_second_are_two_directories(tmp_path):
    from raytrainer.driver.api import _new_name

    storage = Storage(str(tmp_path / "runs"))
    first, second = _new_name(storage, "digits"), _new_name(storage, "digits")
    assert first != second and (tmp_path / "runs" / first).is_dir() and (tmp_path / "runs" / second).is_dir()
    assert second.startswith(first + "-") or second > first  # -2 in the same second, else a later second


def test_a_run_directory_is_held_by_one_run_and_left_only_where_something_was_written(tmp_path):
    from raytrainer.driver.api import _held
    from raytrainer.errors import ConfigError

    run_dir = tmp_path / "run"
    with _held(run_dir / ".lock", str(run_dir)):
        assert f"pid {os.getpid()} on " in (run_dir / ".lock").read_text()
        with pytest.raises(ConfigError, match=f"'{run_dir}' is in use by another run \\(pid {os.getpid()} on "):
            with _held(run_dir / ".lock", str(run_dir)):
                pass
    assert not run_dir.exists()  # a run that failed before it wrote anything leaves no directory
    with _held(run_dir / ".lock", str(run_dir)):
        (run_dir / "config.yaml").write_text("x")
    assert (run_dir / "config.yaml").exists()
    with _held(run_dir / ".lock", str(run_dir)):  # released: the next run of the name holds it
        pass


def test_a_checkpoint_without_its_marker_is_invisible(tmp_path):
    ckpts = store(tmp_path, keep_last=5)
    ckpts.write(2, state(2), {})
    # A kill during the write of step 4: its state.pt is (half) there, the marker is not.
    partial = tmp_path / "run" / "checkpoints" / "step-00000004"
    partial.mkdir()
    (partial / "state.pt").write_bytes(b"\x80half a pickle")
    assert [c.step for c in ckpts.committed()] == [2]
    assert loaded_step(ckpts.load_latest()) == (2, 2)


def test_a_corrupt_newest_checkpoint_falls_back_with_a_warning(tmp_path):
    ckpts = store(tmp_path, keep_last=5)
    for step in (2, 4, 6):
        ckpts.write(step, state(step), {})
    newest = tmp_path / "run" / "checkpoints" / "step-00000006" / "state.pt"
    newest.write_bytes(newest.read_bytes()[:-10])  # truncated
    warnings = []
    assert loaded_step(ckpts.load_latest(warn=warnings.append)) == (4, 4)
    assert len(warnings) == 1 and "step-00000006 is corrupt" in warnings[0]


def test_retention_keeps_the_last_and_the_best(tmp_path):
    ckpts = store(tmp_path, keep_last=2, keep_best=KeepBestConfig(metric="val_loss", mode="min", k=2))
    losses = {1: 0.9, 2: 0.3, 3: 0.5, 4: 0.2, 5: 0.8, 6: 0.7}
    for step, loss in losses.items():
        ckpts.write(step, state(step), {"val_loss": loss})
    assert [c.step for c in ckpts.committed()] == [2, 4, 5, 6]  # best two: 4, 2; last two: 5, 6
    plain = Checkpoints(Storage(str(tmp_path)), "plain", CheckpointConfig(keep_last=1))
    for step in range(1, 4):
        plain.write(step, state(step), {})
    assert [c.step for c in plain.committed()] == [3]


def test_retention_removes_what_a_failed_write_or_an_interrupted_deletion_left(tmp_path):
    """A deletion cut short after its marker went (the storage failing mid-prune), or a
    write that failed and could not be discarded, leaves a directory that is no checkpoint:
    the next commit removes it; a directory newer than the newest commit (a write in
    flight) stays."""
    ckpts = store(tmp_path, keep_last=1)
    ckpts.write(1, state(1), {})
    ckpts.write(2, state(2), {})
    half_deleted = tmp_path / ckpts.prefix / "step-00000001"
    half_deleted.mkdir()
    (half_deleted / "state.pt").write_bytes(b"left")
    failed = tmp_path / ckpts.prefix / "step-00000002" / ".." / "step-00000003"
    failed.mkdir()
    (failed / "state.pt").write_bytes(b"partial")
    in_flight = tmp_path / ckpts.prefix / "step-00000009"
    in_flight.mkdir()
    ckpts.write(4, state(4), {})
    names = sorted(p.name for p in (tmp_path / ckpts.prefix).iterdir())
    assert names == ["step-00000004", "step-00000009"]
    assert [c.step for c in ckpts.committed()] == [4]


@pytest.fixture(scope="module")
def s3_server():
    """A real S3-protocol server (moto's) on loopback, and the environment AWS tools read."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import pyarrow.fs as pafs

    pafs.S3FileSystem(endpoint_override=env["AWS_ENDPOINT_URL"], allow_bucket_creation=True).create_dir("bucket")
    yield env
    for key, value in saved.items():
        os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    server.stop()


def test_s3_round_trip(s3_server):
    ckpts = Checkpoints(Storage("s3://bucket/runs"), "s3run", CheckpointConfig(keep_last=2))
    for step in (1, 2, 3):
        ckpts.write(step, state(step), {"loss": 1.0 / step})
    assert [c.step for c in ckpts.committed()] == [2, 3]
    assert loaded_step(ckpts.load_latest()) == (3, 3)


@pytest.mark.slow  # a CLI run that starts a Ray of its own
def test_a_run_on_s3_storage(s3_server, tmp_path):
    """The whole path: workers write checkpoints to S3, the driver uploads its files."""
    proc = subprocess.run(
        [sys.executable, "-m", "raytrainer", "train", "configs/linear.yaml", "--no-progress",
         "--set", "trainer.max_steps=6", "--set", "scaling.num_workers=1",
         "--set", "run.storage=s3://bucket/runs", "--set", "run.name=full",
         "--set", "checkpoint.every_n_steps=3"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=own_ray_env(**s3_server),
    )
    assert proc.returncode == 0, proc.stderr
    storage = Storage("s3://bucket/runs")
    assert [c.step for c in Checkpoints(storage, "full", CheckpointConfig()).committed()] == [3, 6]
    for name in ("config.yaml", "metrics.jsonl", "events.jsonl", "model.pt"):
        assert storage.exists(f"full/{name}"), name
    rows = storage.read("full/metrics.jsonl").decode().splitlines()
    assert json.loads(rows[-1])["step"] == 6


def config(tmp_path, name, **sections):
    cfg = {
        "task": {"target": "tests.tasks:RegressionTask", "args": {"dropout": 0.2}},
        "trainer": {"max_epochs": 2, "global_batch_size": 32, "log_every_n_steps": 4},
        "scaling": {"num_workers": 2},
        "checkpoint": {"every_n_steps": 3, "keep_last": 10},
        "run": {"name": name, "storage": str(tmp_path)},
    }
    for section, values in sections.items():
        cfg[section].update(values)
    return cfg


def weights(run_dir):
    return torch.load(run_dir / "model.pt", weights_only=True)


def test_resume_with_another_world_size_repeats_and_skips_no_sample(ray_local, tmp_path):
    record = str(tmp_path / "seen")
    task = {"args": {"record": record}}
    raytrainer.train(config(tmp_path, "reshard", task=task, trainer={"max_steps": 5}), progress=False)
    result = raytrainer.train(config(tmp_path, "reshard", task=task, scaling={"num_workers": 1},
                                     trainer={"max_steps": 16, "micro_batch_size": 8}), progress=False)
    resumed = [e for e in result.events if e["event"] == "resumed"]
    assert resumed and resumed[0]["step"] == 5
    def lines(rank):
        with open(f"{record}.{rank}") as f:
            return [[int(i) for i in line.split()] for line in f]

    rank0, rank1 = lines(0), lines(1)
    # Before the resume: steps 1-5, one micro-batch of 16 per rank. After it: one worker,
    # micro-batches of 8 (4 per step): steps 6-8 finish epoch 0, steps 9-16 are epoch 1.
    assert len(rank1) == 5 and len(rank0) == 5 + 4 * 11
    epoch0 = sum(rank0[:5] + rank1 + rank0[5:17], [])
    epoch1 = sum(rank0[17:], [])
    for seen in (epoch0, epoch1):  # every sample exactly once per epoch
        assert len(seen) == 256 and set(seen) == set(range(256))
    assert [r["world_size"] for r in result.history if r["step"] in (5, 6)] == [1]  # step 6 on 1 worker
    assert_no_leaks()


def test_cli_resume_at_another_size_trains_on_that_many_workers(ray_local, tmp_path):
    """`raytrainer resume RUN --set scaling.num_workers=1` of a 2-worker run: its config.yaml
    holds min_workers and max_workers resolved from num_workers, and they follow it."""
    from raytrainer.driver.cli import main

    raytrainer.train(config(tmp_path, "resize", trainer={"max_steps": 3, "log_every_n_steps": 1}), progress=False)
    assert main(["resume", str(tmp_path / "resize"), "--no-progress", "--set", "scaling.num_workers=1",
                 "--set", "trainer.max_steps=5"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "resize" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["world_size"]) for r in rows if "loss" in r] == [(1, 2), (2, 2), (3, 2), (4, 1), (5, 1)]
    assert_no_leaks()


def test_a_corrupt_newest_checkpoint_is_skipped_on_resume_with_one_warning(ray_local, tmp_path, capfd):
    from raytrainer.driver.cli import main

    raytrainer.train(config(tmp_path, "corrupt", trainer={"max_steps": 6}), progress=False)
    newest = tmp_path / "corrupt" / "checkpoints" / "step-00000006" / "state.pt"
    newest.write_bytes(b"garbage")
    with pytest.warns(RuntimeWarning, match="step-00000006 is corrupt") as caught:
        result = raytrainer.train(config(tmp_path, "corrupt", trainer={"max_steps": 8}), progress=False)
    assert [e["step"] for e in result.events if e["event"] == "resumed"] == [3]
    assert len([w for w in caught if "is corrupt" in str(w.message)]) == 1
    assert "is corrupt" not in capfd.readouterr().err  # a warning, not also a print
    # From the CLI: one line on stderr, not the warning and a print of it
    (tmp_path / "corrupt" / "checkpoints" / "step-00000008" / "state.pt").write_bytes(b"garbage")
    assert main(["resume", str(tmp_path / "corrupt"), "--no-progress", "--set", "trainer.max_steps=9"]) == 0
    err = capfd.readouterr().err
    assert err.count("step-00000008 is corrupt") == 1, err
    assert "raytrainer: warning: checkpoint step-00000008 is corrupt" in err


def test_driver_sigkill_then_resume_is_bit_identical(ray_local, tmp_path):
    task = {"args": {"dropout": 0.2, "sleep_s": 0.02}}
    trainer = {"max_epochs": 8}  # 64 steps of >= 20 ms: the stall comes well before the end
    reference = raytrainer.train(config(tmp_path, "reference", task=task, trainer=trainer), progress=False)

    # Its workers stall in their steps once the driver is to die: they outlive it by a moment
    # (until Ray's fate-sharing takes them), and must not train on to the end meanwhile.
    stall = tmp_path / "stall"
    cfg = config(tmp_path, "killed", task={"args": {**task["args"], "stall_step_file": str(stall)}},
                 trainer=trainer)
    path = tmp_path / "killed.yaml"
    import yaml

    path.write_text(yaml.safe_dump(cfg))
    # Each driver starts its own local Ray (a plain ray.init() would join whichever Ray it
    # finds on the machine, and fail where it finds several).
    env = {**os.environ, "RAY_ADDRESS": "local"}
    driver = subprocess.Popen([sys.executable, "-m", "raytrainer", "train", str(path), "--no-progress"],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    events = tmp_path / "killed" / "events.jsonl"
    deadline = Deadline(120)
    while not deadline.passed():
        lines = events.read_text().splitlines() if events.exists() else []
        if sum('"checkpoint_committed"' in line for line in lines) >= 2:
            break
        assert driver.poll() is None, driver.stderr.read()
        time.sleep(0.1)
    # The local Ray it started runs its workers at nice 0, not Ray's 15, and with the malloc
    # settings that keep freed memory for the next step (localray.RAY_SETTINGS), where the
    # user's environment sets none of its own.
    (pids,) = [json.loads(line)["pids"] for line in lines if '"group_formed"' in line]
    assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in pids] == [0, 0]
    from raytrainer.driver.localray import MALLOC_SETTINGS

    malloc = {k: os.environ.get(k, v) for k, v in MALLOC_SETTINGS.items()}
    assert malloc and all(_environ(pid, malloc) == malloc for pid in pids)
    stall.write_text("!")  # every worker
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    # Its workers go with its Ray (Ray's fate-sharing), but not at once on a loaded machine:
    # one still training would go on committing checkpoints and pruning older ones under
    # the resume's feet. A user resumes a dead run; wait until it is one, and none is left.
    deadline = Deadline(60)
    while (alive := [pid for pid in pids if _alive(pid)]) and not deadline.passed():
        time.sleep(0.2)
    assert alive == [], f"the killed driver's workers {alive} outlived it by 60 s"
    assert not (tmp_path / "killed" / "model.pt").exists()  # it really died mid-run
    stall.unlink()

    # The resume joins the tests' Ray (a run given RAY_ADDRESS), as a user's on a cluster would.
    env["RAY_ADDRESS"] = ray_local.get_runtime_context().gcs_address
    proc = subprocess.run([sys.executable, "-m", "raytrainer", "resume", str(tmp_path / "killed"),
                           "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    log = [json.loads(line) for line in events.read_text().splitlines()]
    assert [e["event"] for e in log].count("resumed") == 1
    a, b = weights(reference.run_dir), weights(tmp_path / "killed")
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the undisturbed run"


def _environ(pid: int, keys) -> dict[str, str | None]:
    """The values of `keys` in process `pid`'s environment (Linux's /proc)."""
    entries = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e)
    return {k: entries.get(k) for k in keys}


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
