"""Helpers for tests that start Ray with its CLI: each such Ray gets its own short
temp dir, which every one of its processes carries on its command line, so we can
find and stop exactly those processes and never another test's (no `ray stop`)."""

import atexit
import contextlib
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .waits import Deadline, wait_until

SESSION_TAG = "RAYTRAINER_TEST_SESSION"
"""Set by conftest.py for the session: every process it starts inherits it."""


def parent(pid: int) -> int:
    """The parent pid of a process (a Ray worker's is its node's raylet)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


FREE_PORTS = range(20000, 32768)
"""Where free_ports looks: above Ray's worker ports (10002-19999 by default) and below the
kernel's ephemeral ports (32768-60999 by default), which every outgoing connection of the
Rays beside the test takes from: a port bound to 0 and released comes from there, and may
be taken again before the component it was meant for binds it."""


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports (see FREE_PORTS): each socket held until all are chosen (one
    closed at once may be handed out again by the next bind: `ray start` refused two
    components on one port)."""
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < n:
            s = stack.enter_context(socket.socket())
            port = random.choice(FREE_PORTS)
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue  # in use
            ports.append(port)
        return ports


def short_temp_dir() -> str:
    # Ray puts unix sockets under it: keep the path short (pytest's tmp_path is too long).
    return tempfile.mkdtemp(prefix="rt-", dir="/tmp")


def own_ray_env(**extra: str) -> dict:
    """The environment for a `raytrainer` command that starts a Ray of its own, as on a
    machine with no other Ray: no RAY_ADDRESS, and a RAY_TMPDIR of its own, where no
    `ray start` or cluster_utils head of this session has recorded an address to join."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    folder = short_temp_dir()
    atexit.register(shutil.rmtree, folder, True)  # the command's Ray has stopped by then
    env.update(RAY_TMPDIR=folder, **extra)
    return env


def token_env() -> dict:
    """Token auth with a fresh token: deterministic whatever ~/.ray/auth_token holds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    return env


def live_processes(ours_only: bool = False):
    """(pid, parent pid, command line) of every live (not zombie) process but this one; with
    `ours_only`, of those this test session started (they inherit its SESSION_TAG: another
    session, pytest-xdist's other worker, runs the same code beside it)."""
    tag = f"{SESSION_TAG}={os.environ.get(SESSION_TAG)}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            if ours_only:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if tag not in f.read().split(b"\0"):
                        continue
        except OSError:
            continue
        if int(pid) != os.getpid() and state != "Z":
            yield int(pid), int(ppid), cmdline


def processes_under(temp_dir: str) -> list[int]:
    """Pids of live processes whose command line names temp_dir."""
    return [pid for pid, _, cmdline in live_processes() if temp_dir.encode() in cmdline]


# What `ray start` ends with when Ray gives up on its own start, not on anything the test
# asked of it: on a loaded machine the head's raylet may not register with its GCS within
# the 30 s Ray allows (ray/_private/node.py, raylet_start_wait_time_s), or the GCS may not
# answer that check in time ("Failed to get node info: RPC error: Deadline Exceeded", seen
# once after 33 s in a full run). A user starts it again.
RAY_GAVE_UP_ON_ITS_START = ("Deadline Exceeded", "timed out during startup")


def start_ray_head(argv: list[str], temp_dir: str, env: dict, log: Path, timeout_s: float = 150.0):
    """`ray start --head --block ...` (argv, with --temp-dir=temp_dir) from temp_dir, its output
    in `log`, once it says it has started; started again, on the same ports, when Ray gives up
    on its own start. A `ray start` that fails otherwise (a port taken, a bad flag) fails the
    test with its output."""
    deadline = Deadline(timeout_s)
    while True:
        with log.open("a") as out:
            proc = subprocess.Popen(argv, cwd=temp_dir, env=env, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None and "Ray runtime started." not in log.read_text():
            if deadline.passed():
                said = log.read_text()
                proc.send_signal(signal.SIGTERM)  # --block: stops what it started
                proc.wait(timeout=60)
                wait_gone(temp_dir)
                raise AssertionError(f"`ray start` did not start in {timeout_s:.0f} s: {said[-3000:]}")
            time.sleep(0.5)
        if proc.poll() is None:
            return proc
        said = log.read_text()
        assert any(s in said for s in RAY_GAVE_UP_ON_ITS_START) and not deadline.passed(), (
            f"ray start exited {proc.returncode}: {said[-3000:]}")
        for pid in processes_under(temp_dir):  # what the failed start left (its GCS, its raylet)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not processes_under(temp_dir), "the failed `ray start`'s processes to exit", 30)
        log.write_text(said + "\n--- Ray gave up on its start (above): started again ---\n")


def wait_gone(temp_dir: str, timeout_s: float = 40.0) -> list[int]:
    """Wait for temp_dir's processes to exit; SIGKILL (by pid) and return any that did not."""
    deadline = time.monotonic() + timeout_s
    while (left := processes_under(temp_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(temp_dir, ignore_errors=True)  # Ray's logs and sockets
    return left


@contextlib.contextmanager
def local_cluster(nodes: int):
    """A multi-node Ray on this machine, like a cloud cluster: a head with no CPUs for
    workers and `nodes` 1-CPU worker nodes; this process is connected to it. Its own
    short temp dir: in the default /tmp/ray, any other process's plain ray.init() on
    this machine would find and join it."""
    import ray

    from raytrainer.bench.rt import local_cluster as head_only

    temp_dir = short_temp_dir()
    # Its nodes get longer than Ray's fixed 30 s to register with its GCS, which on a slow
    # day (a load of 35 on 2 cores) was too short (driver/_internals.patient_node_start).
    cluster = head_only(temp_dir)
    for _ in range(nodes):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING")
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        assert wait_gone(temp_dir) == []


LINEAR = ["configs/linear.yaml", "--no-progress", "--set", "trainer.max_steps=100000",
          "--set", "trainer.max_epochs=1000", "--set", "trainer.log_every_n_steps=1"]
"""`raytrainer train` arguments for a run that trains until it is stopped (a config of
the repo: run from elsewhere with the repo on PYTHONPATH, as a source checkout is)."""


def stop_group_at_a_step(cwd, env: dict, run_dir: Path, *overrides: str, sig=signal.SIGTERM, beside=None,
                         timeout_s: float = 300.0) -> tuple[int, str]:
    """`raytrainer train` of LINEAR (with `--set` overrides) from `cwd`, leading a process
    group of its own as a shell or a scheduler starts a job; once metrics.jsonl in run_dir
    has rows, `sig` to that whole group (os.killpg: Ctrl-C, `timeout`, a container stop,
    `scancel`), then `beside()` if given. Its exit status and output."""
    root = str(Path(__file__).resolve().parents[1])
    argv = [sys.executable, "-m", "raytrainer", "train", f"{root}/{LINEAR[0]}", *LINEAR[1:]]
    for item in overrides:
        argv += ["--set", item]
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))}
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        rows = run_dir / "metrics.jsonl"
        wait_until(lambda: proc.poll() is not None or (rows.exists() and rows.read_text().count("\n") > 2),
                   "the run's first steps", 240)
        assert proc.poll() is None, proc.communicate()[0]
        os.killpg(proc.pid, sig)
        if beside is not None:
            beside()
        out = proc.communicate(timeout=timeout_s)[0]
        return proc.returncode, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
