"""cluster/slurm/raytrainer.sbatch under a faked SLURM: `srun` and `scontrol` are
small scripts that run the step here, so the allocation's two "nodes" are two
raylets on this machine. The script must start both, train across them, pass the
run's exit status on and leave no Ray process behind."""

import contextlib
import json
import os
import signal
import stat
import subprocess
import types

import pytest

from .conftest import ROOT
from .ray_procs import free_ports, live_processes, short_temp_dir, token_env, wait_gone
from .waits import patience, wait_until

pytestmark = pytest.mark.slow  # a Ray of its own, in subprocesses

FAKE_SRUN = """#!/usr/bin/env bash
# Fake srun: drop the step's options, run its command on this machine.
while [[ $# -gt 0 && $1 == -* ]]; do
    case $1 in -w|-N|-n|--nodelist|--nodes|--ntasks) shift 2 ;; *) shift ;; esac
done
exec "$@"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
# Fake `scontrol show hostnames A,B`: one name a line.
[[ $1 == show && $2 == hostnames ]] || { echo "fake scontrol: $*" >&2; exit 1; }
tr , '\\n' <<< "$3"
"""


def job(tmp_path, nodes):
    """The job's environment under the fake SLURM, and the temp dir its Rays run in."""
    temp_dir = short_temp_dir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    env, ports = token_env(), free_ports(2)
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        # The job's environment has this checkout installed: driver and workers import it.
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])),
        SLURM_JOB_ID="4242", SLURM_JOB_NODELIST=nodes,
        SLURM_NNODES=str(len(nodes.split(","))), SLURM_GPUS_ON_NODE="0", SLURM_CPUS_PER_TASK="1",
        RAY_PORT=str(ports[0]), RAY_TMPDIR=temp_dir,
        # Two raylets on one machine must not share the agent's and Ray Client's fixed ports.
        RAY_START_ARGS="--dashboard-agent-listen-port=0",
        RAY_HEAD_ARGS=f"--ray-client-server-port={ports[1]} --include-dashboard=false",
    )
    return env, temp_dir


def command(tmp_path, *overrides):
    return ["bash", "cluster/slurm/raytrainer.sbatch", "configs/linear.yaml",
            "--set", "trainer.max_epochs=1", "--set", f"run.storage={tmp_path}", *overrides]


# What `ray start --block` says when one of the processes it started exits: on a loaded
# machine the head's Ray client server once exited 1 as the job waited for its nodes.
RAY_LOST_A_PROCESS = "Some Ray subprocesses exited unexpectedly"


def sbatch(tmp_path, *overrides, nodes="n1,n2"):
    """The job run to its end (it must leave no Ray process). One that failed before it
    trained because Ray lost a process of its own is submitted again, as a user would."""
    for attempt in (1, 2):
        env, temp_dir = job(tmp_path, nodes)
        try:
            proc = subprocess.run(command(tmp_path, *overrides), cwd=ROOT, env=env, capture_output=True,
                                  text=True, timeout=240)
        finally:
            left = wait_gone(temp_dir, timeout_s=5)
            assert left == [], f"the script left Ray processes behind: {left}"
        out = proc.stdout + proc.stderr
        if attempt == 1 and RAY_LOST_A_PROCESS in out and "Ray nodes up at" not in out:
            print(f"Ray lost a process of its own before the run (exit {proc.returncode}); submitted again:\n{out}")
            continue
        return proc


def test_trains_across_the_allocation_and_stops_ray(tmp_path):
    proc = sbatch(tmp_path, "--set", "run.name=slurm")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 Ray nodes up" in proc.stdout
    events = [json.loads(line) for line in (tmp_path / "slurm" / "events.jsonl").read_text().splitlines()]
    # Two workers of 1 CPU on two 1-CPU nodes: one per node, and storage was checked.
    assert events[1]["event"] == "storage_checked" and events[1]["nodes"] == 2
    assert events[-1]["event"] == "finished" and (tmp_path / "slurm" / "model.pt").is_file()


def test_the_runs_exit_status_is_the_jobs(tmp_path):
    proc = sbatch(tmp_path, "--set", "scaling.max_workers=65", nodes="n1")  # one node: quicker
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "up to 65 workers (scaling.max_workers" in proc.stderr


@contextlib.contextmanager
def one_node_job(tmp_path, name, *overrides, **env_changes):
    """A job on one node with one worker training run.name `name` for long, under way; on the
    way out it is killed if still running, and `.left` says which Ray processes it left."""
    env, temp_dir = job(tmp_path, "n1")
    env.update(env_changes)
    running = types.SimpleNamespace(env=env, metrics=tmp_path / name / "metrics.jsonl", left=None)
    running.proc = subprocess.Popen(command(tmp_path, "--set", f"run.name={name}", "--set", "scaling.num_workers=1",
                                         *overrides),
                                 cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield running
    finally:
        if running.proc.poll() is None:
            running.proc.kill()
        running.left = wait_gone(temp_dir, timeout_s=5)


def wait_for_metrics(running):
    wait_until(lambda: running.metrics.exists() and running.metrics.stat().st_size, "the run's first metrics",
               timeout_s=120, alive=lambda: running.proc.poll() is None)


@pytest.mark.parametrize("moment", ["as-the-nodes-join", "mid-run"])
def test_a_job_whose_head_loses_a_ray_process_ends_and_leaves_nothing(tmp_path, moment):
    """The head's Ray client server dies (it exited 1 under load in CI): `ray start --block`
    then kills the head's other processes, its GCS among them, and with Ray 2.60 may never
    exit; a driver without its GCS retries for ever. Either held the job to its time limit.
    The job must end, failed, with every Ray process it started gone."""
    with one_node_job(tmp_path, "lost", "--set", "trainer.max_epochs=200", RAY_STOP_TIMEOUT_S="5") as running:
        port = running.env["RAY_HEAD_ARGS"].split("--ray-client-server-port=")[1].split()[0]
        if moment == "mid-run":
            wait_for_metrics(running)
        server = wait_until(lambda: [pid for pid, _, cmdline in live_processes()
                                     if b"ray.util.client.server" in cmdline and f"--port={port}".encode() in cmdline],
                            "the head's Ray client server", timeout_s=120, alive=lambda: running.proc.poll() is None)
        os.kill(server[0], signal.SIGKILL)
        out, _ = running.proc.communicate(timeout=patience(120))
    assert running.proc.returncode != 0, out
    # Ray's line, then the script's: it saw the head go down and stopped (or outlived) the step.
    assert "Remaining processes will be killed" in out and "raytrainer.sbatch: the Ray head on n1 " in out, out
    assert running.left == [], f"the job left Ray processes behind: {running.left}\n{out}"


def test_a_sigterm_to_the_job_stops_the_run_with_a_checkpoint_before_ray(tmp_path):
    """What `scancel --batch --signal=TERM`, or the script's `--signal=B:TERM@180` before
    the time limit, sends: SIGTERM to the batch shell only. The run must stop at a step
    boundary with a checkpoint there, and only then Ray; the job's status is the run's."""
    with one_node_job(tmp_path, "term", "--set", "trainer.max_epochs=5000") as running:
        wait_for_metrics(running)
        running.proc.send_signal(signal.SIGTERM)
        out, _ = running.proc.communicate(timeout=patience(120))
    assert running.proc.returncode == 143, out
    events = [json.loads(line) for line in (tmp_path / "term" / "events.jsonl").read_text().splitlines()]
    (stopped,) = [e for e in events if e["event"] == "stopped"]
    assert stopped["signal"] == "SIGTERM" and stopped["checkpoint_step"] == stopped["step"] > 0, out
    assert "continue with: raytrainer resume" in out, out
    assert running.left == [], f"the job left Ray processes behind: {running.left}\n{out}"
