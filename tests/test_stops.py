"""Stops a user meets: a non-finite loss from a bad record (trainer.nonfinite), and a
signal to the CLI (SIGINT, SIGTERM, SIGHUP), which stops at a step boundary and commits a
checkpoint there. Both leave a run that `raytrainer resume` continues."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import raytrainer
from raytrainer.checkpoint import Checkpoints, Storage
from raytrainer.config import CheckpointConfig
from raytrainer.errors import NonFiniteLoss

from .conftest import assert_no_leaks
from .ray_procs import live_processes, own_ray_env, stop_group_at_a_step, wait_gone
from .waits import join, wait_until


def config(tmp_path, name, **trainer):
    return {
        "task": {"target": "tests.tasks:BadRecordTask", "args": {"bad_sample": 37}},
        "trainer": {"max_steps": 12, "global_batch_size": 32, **trainer},
        "scaling": {"num_workers": 2},
        "checkpoint": {"every_n_steps": 2},
        "run": {"name": name, "storage": str(tmp_path)},
    }


def log(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def finite(path):
    """Whether every floating-point tensor in a saved state (or weights) file is finite."""
    def tensors(obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from tensors(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from tensors(v)

    found = [t for t in tensors(torch.load(path, weights_only=True)) if t.is_floating_point()]
    return found and all(torch.isfinite(t).all() for t in found)


def test_a_bad_record_stops_the_run_at_its_step_and_a_resume_with_skip_trains_through(ray_local, tmp_path):
    with pytest.raises(NonFiniteLoss) as info:
        raytrainer.train(config(tmp_path, "nan"), progress=False)
    found = re.match(r"step (\d+): the loss is nan on rank\(s\) (\d)\.", str(info.value))
    assert found, str(info.value)
    step, rank = int(found[1]), int(found[2])
    run_dir = tmp_path / "nan"
    events = log(run_dir)
    assert "recovered" not in [e["event"] for e in events]  # a property of the data: never retried
    assert events[-1]["event"] == "failed" and events[-1]["error"] == "NonFiniteLoss"
    assert not (run_dir / "model.pt").exists()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(math.isfinite(r["loss"]) and r["step"] < step for r in rows if "loss" in r)
    checkpoints = Checkpoints(Storage(str(tmp_path)), "nan", CheckpointConfig()).committed()
    assert checkpoints and all(c.step < step for c in checkpoints)
    for c in checkpoints:
        assert finite(run_dir / "checkpoints" / c.name / "state.pt")

    # The same run resumed from its newest checkpoint, skipping: through the bad record
    # (once per epoch of 8 steps) to the end, each skip counted.
    result = raytrainer.train(config(tmp_path, "nan", nonfinite="skip"), progress=False)
    skipped = [e for e in result.events if e["event"] == "nonfinite_skipped"]
    assert skipped and skipped[0]["step"] == step and f"rank(s) {rank}" in skipped[0]["why"]
    assert result.metrics["nonfinite_skips"] == len(skipped)
    assert finite(result.run_dir / "model.pt")
    assert_no_leaks()


def test_a_nonfinite_loss_your_own_loop_reports_is_warned_of_once_and_the_loop_decides(ray_local, tmp_path):
    from .tasks import nan_loss_loop

    result = raytrainer.train_loop(nan_loss_loop, {"scaling": {"num_workers": 2},
                                                   "run": {"name": "loop", "storage": str(tmp_path)}},
                                   progress=False)
    said = [e for e in result.events if e["event"] == "nonfinite_loss"]
    assert [e["step"] for e in said] == [3] and "check for it in your loop" in said[0]["why"]
    assert result.events[-1]["event"] == "finished" and result.metrics["step"] == 6
    assert_no_leaks()


# ---------------------------------------------------------------------- signals, from outside

USER_TASK = '''
import os, time
import torch
from torch.utils.data import TensorDataset
from raytrainer import Task


class SlowTask(Task):
    """A user's task in their own directory; each step sleeps sleep_s, and on while the file
    `hold` exists (for at most a minute): a stop then cannot reach its step boundary until
    the test lets it."""

    def __init__(self, sleep_s=0.05, hold=None):
        self.sleep_s, self.hold = sleep_s, hold

    def build_model(self):
        return torch.nn.Linear(4, 1)

    def build_optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=0.01)

    def train_dataset(self):
        x = torch.randn(512, 4, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x, x.sum(1, keepdim=True))

    def train_step(self, model, batch):
        x, y = batch
        time.sleep(self.sleep_s)
        held = time.monotonic()
        while self.hold and os.path.exists(self.hold) and time.monotonic() - held < 60:
            open(f"{self.hold}.{os.getpid()}", "w").close()  # this rank is held
            time.sleep(self.sleep_s)
        return {"loss": torch.nn.functional.mse_loss(model(x), y)}
'''


def cli_command(tmp_path, name, progress=False):
    """`raytrainer train` of a user's slow task from their directory (tmp_path), on the tests' Ray."""
    import ray

    (tmp_path / "usertask.py").write_text(USER_TASK)
    (tmp_path / "slow.yaml").write_text(
        "task: {target: usertask:SlowTask, args: {hold: %s}}\n" % (tmp_path / "hold")
        + "trainer: {max_steps: 100000, global_batch_size: 32}\n"
        + "scaling: {num_workers: 2}\ncheckpoint: {every_n_steps: 20}\n"
        + f"run: {{name: {name}, storage: {tmp_path / 'runs'}}}\n")  # absolute: workers on the tests' Ray run elsewhere
    address = ray.get_runtime_context().gcs_address
    return [sys.executable, "-m", "raytrainer", "train", "slow.yaml", "--address", address,
            *([] if progress else ["--no-progress"])]


def start_cli(tmp_path, name, *extra, prefix=()):
    """`raytrainer train` from the user's directory, as a user runs it, on the tests' Ray
    (after `prefix`: nohup, say)."""
    return subprocess.Popen([*prefix, *cli_command(tmp_path, name), *extra], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def last_step(run_dir):
    """The step of metrics.jsonl's last whole row (0 before the first)."""
    path = run_dir / "metrics.jsonl"
    lines = [line for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []
    return json.loads(lines[-1])["step"] if lines else 0


def wait_for_step(run_dir, step, proc):
    """Until metrics.jsonl has a row past `step` (the run trains: past its first checkpoint)."""
    while True:
        assert proc.poll() is None, proc.stdout.read()
        if (seen := last_step(run_dir)) > step:
            return seen
        time.sleep(0.2)


def resume_cli(tmp_path, run_dir, *overrides):
    import ray

    command = [sys.executable, "-m", "raytrainer", "resume", str(run_dir), "--no-progress",
               "--address", ray.get_runtime_context().gcs_address]
    for item in overrides:
        command += ["--set", item]
    return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)


def test_sigint_stops_at_a_step_boundary_with_a_checkpoint_there_and_resume_continues_from_it(ray_local, tmp_path):
    run_dir = tmp_path / "runs" / "int"
    proc = start_cli(tmp_path, "int")
    seen = wait_for_step(run_dir, 25, proc)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=300)[0]
    print(f"SIGINT to exit: {time.monotonic() - sent:.2f} s")  # a figure for the docs, not a check
    assert proc.returncode == 130, out
    assert f"continue with: raytrainer resume {run_dir}" in out
    stopped = [e for e in log(run_dir) if e["event"] == "stopped"]
    assert len(stopped) == 1 and stopped[0]["signal"] == "SIGINT"
    step = stopped[0]["step"]
    assert step >= seen and stopped[0]["checkpoint_step"] == step  # not the last periodic one (20, 40, ...)
    assert_no_leaks()

    done = resume_cli(tmp_path, run_dir, f"trainer.max_steps={step + 3}")
    assert done.returncode == 0, done.stdout + done.stderr
    resumed = [e for e in log(run_dir) if e["event"] == "resumed"]
    assert resumed[-1]["step"] == step and resumed[-1]["checkpoint"] == stopped[0]["checkpoint"]
    assert log(run_dir)[-1]["event"] == "finished" and (run_dir / "model.pt").exists()
    assert_no_leaks()


def test_sigterm_stops_the_same_way_with_exit_status_143(ray_local, tmp_path):
    run_dir = tmp_path / "runs" / "term"
    proc = start_cli(tmp_path, "term")
    wait_for_step(run_dir, 5, proc)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 143, out
    stopped = [e for e in log(run_dir) if e["event"] == "stopped"]
    assert stopped and stopped[0]["signal"] == "SIGTERM" and stopped[0]["checkpoint_step"] == stopped[0]["step"]
    assert_no_leaks()


def test_a_gcs_that_dies_beside_a_stopped_run_does_not_hold_its_exit(tmp_path):
    """A signal to a whole container or allocation may stop Ray beside the run: once the
    stop's checkpoint is committed, the driver exits with the signal's status, saying how to
    continue, without waiting on Ray's dead GCS (60 s, then exit 1: driver/stopexit.py). Here
    the run's own Ray's GCS is killed as the run's group gets SIGTERM."""
    env = own_ray_env()  # RAYTRAINER_KEEP_RAY=0 (conftest): a Ray started for this run, in RAY_TMPDIR
    ray_dir = env["RAY_TMPDIR"].encode()

    def kill_gcs():
        (gcs,) = [pid for pid, _, cmdline in live_processes()
                  if ray_dir in cmdline and cmdline.split(b"\0")[0].endswith(b"gcs_server")]
        os.kill(gcs, signal.SIGKILL)

    run_dir = tmp_path / "runs" / "gone"
    try:
        code, out = stop_group_at_a_step(tmp_path, env, run_dir, f"run.storage={tmp_path / 'runs'}", "run.name=gone",
                                         "scaling.num_workers=2", beside=kill_gcs)
    finally:
        wait_gone(env["RAY_TMPDIR"], timeout_s=5)  # what is left of that Ray: its workers wait on its GCS
    assert code == 143 and "Failed to connect to GCS" not in out, out
    assert f"continue with: raytrainer resume {run_dir}" in out, out
    (stopped,) = [e for e in log(run_dir) if e["event"] == "stopped"]
    assert stopped["signal"] == "SIGTERM" and stopped["checkpoint_step"] == stopped["step"], stopped
    assert (run_dir / "checkpoints" / stopped["checkpoint"]).is_dir()


def test_the_terminal_closing_stops_the_same_way_with_exit_status_129(ray_local, tmp_path):
    """An SSH session dropped, a terminal window closed: the kernel hangs up the run's
    terminal (SIGHUP, then every write to it fails). The run stops at a step boundary with
    a checkpoint there, as for SIGTERM, progress bar and all."""
    import fcntl
    import pty
    import termios

    run_dir = tmp_path / "runs" / "hup"
    master, terminal = pty.openpty()

    def own_terminal():  # a session of its own, with the pty as its controlling terminal
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        # As a shell in a terminal starts it: not with the SIGHUP this test may inherit ignored
        # (a suite run under nohup; the nohup test below is that case).
        signal.signal(signal.SIGHUP, signal.SIG_DFL)

    proc = subprocess.Popen(cli_command(tmp_path, "hup", progress=True), cwd=tmp_path, stdin=terminal,
                            stdout=terminal, stderr=terminal, preexec_fn=own_terminal)
    os.close(terminal)
    shown = []

    def read():  # what the terminal shows, until it is gone
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                return
            if not chunk:
                return
            shown.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        seen = wait_until(lambda: (step := last_step(run_dir)) > 25 and step, "25 steps", timeout_s=120,
                          alive=lambda: proc.poll() is None)
        os.close(master)  # the hang-up
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = b"".join(shown).decode(errors="replace")
    assert proc.returncode == 129, out
    stopped = [e for e in log(run_dir) if e["event"] == "stopped"]
    assert len(stopped) == 1 and stopped[0]["signal"] == "SIGHUP", out
    assert stopped[0]["step"] >= seen and stopped[0]["checkpoint_step"] == stopped[0]["step"]
    assert_no_leaks()


def test_a_second_run_of_a_run_name_in_use_fails_and_touches_nothing_of_the_first(ray_local, tmp_path):
    """The same command launched twice (a resubmitted job, a second terminal): the second
    would resume from the first's checkpoints and write the same ones as it trains."""
    run_dir = tmp_path / "runs" / "same"
    first = start_cli(tmp_path, "same")
    wait_for_step(run_dir, 5, first)
    before = {name: (run_dir / name).read_bytes() for name in ("config.yaml", "events.jsonl")}
    second = start_cli(tmp_path, "same")
    out = second.communicate(timeout=300)[0]
    assert second.returncode == 2, out
    assert f"run directory '{run_dir}' is in use by another run (pid {first.pid} on " in out, out
    assert (run_dir / "config.yaml").read_bytes() == before["config.yaml"]
    assert not [e for e in log(run_dir) if e["event"] in ("failed", "resumed")]  # nothing of the second's
    seen = wait_for_step(run_dir, 5, first)
    first.send_signal(signal.SIGINT)
    out = first.communicate(timeout=300)[0]
    assert first.returncode == 130, out
    assert [e["step"] for e in log(run_dir) if e["event"] == "stopped"][0] >= seen
    assert_no_leaks()


def test_under_nohup_a_hang_up_is_ignored_as_nohup_promises(ray_local, tmp_path):
    run_dir = tmp_path / "runs" / "nohup"
    proc = start_cli(tmp_path, "nohup", prefix=["nohup"])
    seen = wait_for_step(run_dir, 5, proc)
    proc.send_signal(signal.SIGHUP)
    wait_for_step(run_dir, seen + 5, proc)  # trains on
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 143, out
    assert [e["signal"] for e in log(run_dir) if e["event"] == "stopped"] == ["SIGTERM"]
    assert_no_leaks()


def test_a_second_sigint_aborts_at_once_leaving_nothing_behind(ray_local, tmp_path):
    run_dir = tmp_path / "runs" / "abort"
    proc = start_cli(tmp_path, "abort")
    wait_for_step(run_dir, 5, proc)
    (tmp_path / "hold").touch()  # the step in flight waits: the stop is still on its way to a boundary
    wait_until(lambda: len(list(tmp_path.glob("hold.*"))) == 2, "both ranks held inside a step")
    lines: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc.send_signal(signal.SIGINT)
    # Again once the first is handled, as a user presses it after the message: two signals
    # before the driver's handler runs are one (a loaded machine delays the handler).
    wait_until(lambda: any("press Ctrl-C again" in line for line in lines), "the first SIGINT's message")
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=300)
    join(reader, 60)
    out = "".join(lines)
    assert proc.returncode == 130, out
    assert "interrupted" in out
    events = log(run_dir)
    assert "stopped" not in [e["event"] for e in events]
    assert events[-1]["event"] == "failed" and events[-1]["cause"] == "interrupted"
    assert_no_leaks()


def test_ctrl_c_in_python_stops_your_own_loop_at_a_report_with_its_state_committed(ray_local, tmp_path):
    from raytrainer.errors import Stopped

    from .tasks import regression_loop

    config = {"scaling": {"num_workers": 2}, "trainer": {"global_batch_size": 32},
              "run": {"name": "loop", "storage": str(tmp_path)}}
    marker = tmp_path / "slow"
    marker.touch()
    run_dir = tmp_path / "loop"

    def interrupt():  # Ctrl-C, once the loop has reported a few steps
        while not (run_dir / "metrics.jsonl").exists() or len((run_dir / "metrics.jsonl").read_text().splitlines()) < 4:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(Stopped) as info:
        raytrainer.train_loop(regression_loop, config, args={"steps": 400, "sleep_s": 0.05, "marker": str(marker)},
                              progress=False)
    stop = info.value
    assert isinstance(stop, KeyboardInterrupt) and stop.signum == signal.SIGINT
    assert stop.checkpoint_step == stop.step >= 4 and stop.run_dir == str(run_dir)
    assert_no_leaks()

    marker.unlink()
    result = raytrainer.train_loop(regression_loop, config, args={"steps": stop.step + 4}, progress=False)
    resumed = [e for e in result.events if e["event"] == "resumed"]
    assert resumed and resumed[-1]["step"] == stop.step and result.metrics["step"] == stop.step + 4
    assert_no_leaks()
