"""The local Ray a first run keeps for the next ones: a later run joins it, only raytrainer
finds it, `raytrainer down` or idleness stops it with every process it started, and a run
that finds it in use starts a Ray of its own. A run launched from another directory keeps
its whole run directory where it says, and a Ray the user starts works beside it."""

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from raytrainer.driver import localray

from .ray_procs import (free_ports, live_processes, processes_under, short_temp_dir, start_ray_head,
                        stop_group_at_a_step, token_env, wait_gone)
from .tasks import RegressionTask
from .waits import Deadline, patience, wait_until

pytestmark = pytest.mark.slow  # each test starts a Ray (or two) in subprocesses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class EnvTask(RegressionTask):
    """Writes what its workers see of RAYTRAINER_TEST_MARK to `path`.<pid>."""

    def __init__(self, path, **kw):
        super().__init__(**kw)
        self.path = path

    def train_step(self, model, batch):
        with open(f"{self.path}.{os.getpid()}", "w") as f:
            f.write(os.environ.get("RAYTRAINER_TEST_MARK", "-"))
        return super().train_step(model, batch)


def run_cli(args, env):
    return subprocess.run([sys.executable, "-m", "raytrainer", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def kept_env(folder: str, **extra: str) -> dict[str, str]:
    """This process's environment as a user's whose runs keep a local Ray in `folder`.
    RAY_TMPDIR: where Ray looks for a Ray that `ray start` left (which a run joins first):
    another test's or process's on this machine is not to be found."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env.update(RAYTRAINER_RAY_DIR=folder, RAYTRAINER_KEEP_RAY="5", RAY_TMPDIR=folder, **extra)
    return env


def test_a_later_run_joins_the_ray_the_first_kept_which_only_raytrainer_finds_and_down_stops(tmp_path):
    folder = short_temp_dir()
    # A token, as Ray leaves in ~/.ray after its first local start: the kept Ray runs with
    # token authentication.
    env = kept_env(folder, RAY_AUTH_TOKEN=secrets.token_hex(32))
    config = tmp_path / "env.yaml"
    config.write_text(yaml.safe_dump({
        "task": {"target": "tests.test_localray:EnvTask", "args": {"path": str(tmp_path / "mark")}},
        "trainer": {"max_steps": 2, "global_batch_size": 8}, "scaling": {"num_workers": 1},
        "run": {"storage": str(tmp_path / "runs")}}))
    try:
        first = run_cli(["train", str(config), "--set", "run.name=first", "--no-progress"], env)
        assert first.returncode == 0, first.stderr[-3000:]
        # The whole stderr where it fails: it ends with the keeper's log (why its Ray did not start).
        assert "started a local Ray, kept for the next runs" in first.stderr, first.stderr[-3000:]
        assert "Token authentication is" not in first.stderr  # Ray's notice, about a Ray raytrainer started
        # Its raylet starts its dashboard agent minimal: no HTTP server, nothing to wait long for.
        (agent,) = [arg for _, _, cmd in live_processes() if folder.encode() in cmd
                    for arg in cmd.split(b"\0") if arg.startswith(b"--dashboard_agent_command=")]
        assert b" --minimal" in agent, agent
        keeper = json.loads((Path(folder) / "keeper.json").read_text())
        # Nothing records it where Ray looks: a plain ray.init() elsewhere would not join it.
        found = subprocess.run([sys.executable, "-c", "from ray._private import services; "
                                "print(services.get_ray_address_from_environment(None, None))"],
                               env=env, capture_output=True, text=True, check=True).stdout.strip()
        assert found != keeper["address"]

        # The second run joins it (no second Ray), and its workers see its own environment.
        second = run_cli(["train", str(config), "--set", "run.name=second", "--no-progress"],
                         {**env, "RAYTRAINER_TEST_MARK": "second"})
        assert second.returncode == 0, second.stderr[-3000:]
        assert "started a local Ray" not in second.stderr and "Token authentication is" not in second.stderr
        assert json.loads((Path(folder) / "keeper.json").read_text())["pid"] == keeper["pid"]
        marks = {p.read_text() for p in tmp_path.glob("mark.*")}
        assert marks == {"-", "second"}, marks

        down = run_cli(["down"], env)
        assert down.returncode == 0 and "stopped the local Ray" in down.stdout, down.stderr
    finally:
        localray.down(folder=Path(folder), force=True)
        left = wait_gone(folder)
    assert not left, f"left running: {left}"


def test_the_kept_ray_stops_by_itself_once_idle_and_a_run_that_finds_it_in_use_starts_its_own(monkeypatch):
    folder = short_temp_dir()
    monkeypatch.setenv("RAYTRAINER_RAY_DIR", folder)
    monkeypatch.setenv("RAYTRAINER_KEEP_RAY", "5")
    try:
        # Another run holds it: this one does not wait for it, nor start a second keeper.
        other = localray.try_lock(Path(folder) / "users.lock")
        assert localray._hold_kept() is None and not (Path(folder) / "keeper.json").exists()
        other.close()
        # Idle (no run holds it) for its idle time: it stops, and every process of its Ray.
        localray.up(Path(folder), minutes=0.05)
        assert processes_under(folder)
        deadline = Deadline(120)
        while (Path(folder) / "keeper.json").exists() and not deadline.passed():
            time.sleep(0.5)
        assert not (Path(folder) / "keeper.json").exists()
    finally:
        left = wait_gone(folder)
    assert not left, f"left running: {left}"


SLOW_AGENTS = """
import os, sys, time
if sys.argv and sys.argv[0].endswith(("dashboard/agent.py", "runtime_env/agent/main.py")):
    time.sleep(float(os.environ["RAYTRAINER_TEST_AGENT_DELAY_S"]))
"""
"""A sitecustomize: Ray's two agents start that much later, as on a loaded machine."""

RUNTIME_ENV_JOB = """
import os, ray
from raytrainer.driver import localray
localray.connect()
@ray.remote
def mark():
    return os.environ["RAYTRAINER_TEST_MARK"]
job = mark.options(runtime_env={"env_vars": {"RAYTRAINER_TEST_MARK": "yes"}})
print("served:", ray.get(job.remote(), timeout=120))
"""


def test_the_kept_ray_starts_though_its_agents_start_later_than_its_raylet_waits_for_them(tmp_path):
    """Ray's raylet waits 15 s for its agents' ports, then aborts (driver/_internals.
    agent_ports_given): on a loaded machine the kept Ray's start failed so. Here both agents
    start 16 s late: the kept Ray starts, and a job's runtime env, which the runtime env
    agent serves, works once that agent is up."""
    folder = short_temp_dir()
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_AGENTS)
    env = kept_env(folder, PYTHONPATH=os.pathsep.join([str(site), ROOT]), RAYTRAINER_TEST_AGENT_DELAY_S="16")
    try:
        up = run_cli(["up"], env)
        assert up.returncode == 0, up.stderr[-3000:]
        job = subprocess.run([sys.executable, "-c", RUNTIME_ENV_JOB], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=300)
        assert job.returncode == 0 and "served: yes" in job.stdout, job.stderr[-3000:]
    finally:
        run_cli(["down", "--force"], env)
        left = wait_gone(folder)
    assert not left, f"left running: {left}"


# ---------------------------------------------------------------------------- as a user runs it
#
# The kept Ray where a user's is: under the temp dir, one per installation (here TMPDIR is
# this module's own, so that `raytrainer down` stops this module's Rays, not another
# session's on the machine), and runs launched from directories of their own.

TASK = """
import torch
from raytrainer import Task


class FileTask(Task):
    # Reads data.txt by a relative path, as a user's task opens its dataset: it means the
    # directory the run was launched from.
    def build_model(self):
        return torch.nn.Linear(2, 1)

    def build_optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=0.1)

    def train_dataset(self):
        self.mark = float(open("data.txt").read())
        x = torch.randn(32, 2, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))

    def train_step(self, model, batch):
        x, y = batch
        return {"loss": torch.nn.functional.mse_loss(model(x), y), "mark": self.mark}
"""

# What `ray start --head` takes by default (ray/_private/ray_constants.py, scripts.py): GCS
# 6379, dashboard 8265, dashboard agent 52365, client server 10001, workers 10002-19999.
RAY_START_PORTS = {6379, 8265, 52365, *range(10001, 20000)}


@pytest.fixture(scope="module")
def kept():
    """The environment of a user whose runs keep a local Ray; at the end, every kept Ray
    stopped and its processes gone."""
    tmp = short_temp_dir()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", localray.DIR_ENV)}
    env.update(TMPDIR=tmp, RAYTRAINER_KEEP_RAY="5", RAY_TMPDIR=tmp)
    try:
        yield env
    finally:
        subprocess.run([sys.executable, "-m", "raytrainer", "down", "--force"], env=env, capture_output=True,
                       timeout=120)
        left = wait_gone(tmp)
        assert not left, f"left running: {left}"


def cli(args, cwd, env, python=sys.executable):
    return subprocess.run([python, "-m", "raytrainer", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def project(path: Path, mark: int) -> Path:
    """A user's project directory: a task module, its data file, a config with the default
    relative run.storage."""
    path.mkdir()
    (path / "mytask.py").write_text(TASK)
    (path / "data.txt").write_text(str(mark))
    (path / "run.yaml").write_text(yaml.safe_dump({
        "task": {"target": "mytask:FileTask"}, "trainer": {"max_steps": 3, "global_batch_size": 8},
        "scaling": {"num_workers": 1}, "checkpoint": {"every_n_steps": 2}}))
    return path


def keeper_of(env) -> dict:
    (folder,) = Path(env["TMPDIR"]).glob("raytrainer-*/keeper.json")
    return json.loads(folder.read_text())


def test_a_run_from_another_directory_keeps_its_whole_run_directory_there_and_resumes(kept, tmp_path):
    a, b = project(tmp_path / "a", 1), project(tmp_path / "b", 2)
    first = cli(["train", "run.yaml", "--set", "run.name=one", "--no-progress"], a, kept)
    assert first.returncode == 0, first.stderr[-3000:]
    keeper = keeper_of(kept)

    # Another directory, another spelling of the same interpreter: the same kept Ray.
    python3 = Path(sys.executable).with_name("python3")
    second = cli(["train", "run.yaml", "--set", "run.name=two", "--no-progress"], b, kept,
                 python=str(python3) if python3.exists() else sys.executable)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "started a local Ray" not in second.stderr and keeper_of(kept)["pid"] == keeper["pid"]
    assert f"finished {b / 'runs' / 'two'}:" in second.stdout
    assert not (a / "runs" / "two").exists()
    run = b / "runs" / "two"
    assert {"config.yaml", "metrics.jsonl", "events.jsonl", "model.pt", "checkpoints"} <= {p.name for p in run.iterdir()}
    assert any((run / "checkpoints").iterdir())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["mark"] for r in rows if "mark" in r} == {2.0}  # b's data.txt, read by the worker

    # The printed directory resumes, named as the user would, relative to where they stand.
    resumed = cli(["resume", "runs/two", "--set", "trainer.max_steps=5", "--no-progress"], b, kept)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"finished {run}: step 5" in resumed.stdout
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "resumed"] == [3]  # from its final checkpoint


def test_down_leaves_a_ray_a_run_is_using_and_stops_it_once_the_run_has_stopped(kept, tmp_path):
    """`raytrainer down` while a run trains in another terminal: stopping its Ray would kill
    its workers and lose what it did since its last checkpoint."""
    a = project(tmp_path / "a", 1)
    metrics = a / "runs" / "busy" / "metrics.jsonl"
    run = subprocess.Popen([sys.executable, "-m", "raytrainer", "train", "run.yaml", "--set", "run.name=busy",
                            "--set", "trainer.max_steps=10000000", "--no-progress"], cwd=a, env=kept,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: metrics.exists() and metrics.stat().st_size, "the run's first steps", timeout_s=120,
                   alive=lambda: run.poll() is None)
        down = cli(["down"], tmp_path, kept)
        assert down.returncode == 1 and "a run is using it" in down.stdout, down.stdout + down.stderr
        assert "--force" in down.stdout and keeper_of(kept)
        size = metrics.stat().st_size
        wait_until(lambda: metrics.stat().st_size > size, "the run to train on", timeout_s=60,
                   alive=lambda: run.poll() is None)
        run.send_signal(signal.SIGINT)
        out = run.communicate(timeout=patience(120))[0]
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 130, out
    down = cli(["down"], tmp_path, kept)
    assert down.returncode == 0 and "stopped the local Ray" in down.stdout, down.stdout + down.stderr


def test_a_signal_to_the_runs_whole_process_group_stops_it_with_a_checkpoint_and_the_kept_ray_stays_up(
        kept, tmp_path):
    """Ctrl-C in a terminal, `timeout`, a container stop, `scancel`: every process of the run's
    process group gets the signal. The run stops at a step boundary with a checkpoint there,
    exits with the signal's status and says how to continue; the kept Ray is no process of
    that group, whether this run started it or found it in use by another run (then this run
    started a Ray of its own, which a SIGTERM to the group stopped under the run before)."""
    assert cli(["down", "--force"], tmp_path, kept).returncode == 0  # none up: the first run starts it

    def stopped(name: str) -> str:
        run_dir = tmp_path / "runs" / name
        code, out = stop_group_at_a_step(tmp_path, kept, run_dir, f"run.storage={tmp_path / 'runs'}",
                                         f"run.name={name}", "scaling.num_workers=1")
        # Its Ray was not stopped under it (nor waited on 60 s, then exit 1).
        assert code == 143 and "Failed to connect to GCS" not in out and "Ray's GCS at" not in out, out
        assert f"continue with: raytrainer resume {run_dir}" in out, out
        (stop,) = [e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
                   if e["event"] == "stopped"]
        assert stop["signal"] == "SIGTERM" and stop["checkpoint_step"] == stop["step"], stop
        assert (run_dir / "checkpoints" / stop["checkpoint"]).is_dir()
        return out

    assert "started a local Ray, kept for the next runs" in stopped("first")
    keeper = keeper_of(kept)
    (folder,) = {p.parent for p in Path(kept["TMPDIR"]).glob("raytrainer-*/keeper.json")}
    other_run = localray.try_lock(folder / "users.lock")  # another run is using the kept Ray
    try:
        assert "started a local Ray" not in stopped("beside")
    finally:
        other_run.close()

    # The kept Ray still serves: the next run joins it.
    joins = cli(["train", str(Path(ROOT) / "configs" / "linear.yaml"), "--no-progress",
                 "--set", "trainer.max_steps=2", "--set", "scaling.num_workers=1",
                 "--set", f"run.storage={tmp_path / 'runs'}"], tmp_path, {**kept, "PYTHONPATH": ROOT})
    assert joins.returncode == 0, joins.stderr[-3000:]
    assert "started a local Ray" not in joins.stderr and keeper_of(kept)["pid"] == keeper["pid"]


def listening(pid: int) -> set[int]:
    """The ports that process `pid` and its descendants (a Ray's daemons, agents, workers) listen on."""
    import psutil

    ports = set()
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            ports |= {c.laddr.port for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:  # gone meanwhile (a worker)
            pass
    return ports


def test_a_ray_the_user_starts_beside_the_kept_one_takes_jobs(kept, tmp_path):
    up = cli(["up"], tmp_path, kept)
    assert up.returncode == 0, up.stderr[-3000:]
    keeper = keeper_of(kept)
    # Its dashboard agent is up, with no HTTP server (it records -1 for that port) ...
    session = next(Path(kept["TMPDIR"]).glob("raytrainer-*/ray/session_latest"))
    deadline = time.monotonic() + 120
    while not (agent := [p for p in session.glob("dashboard_agent_listen_port_*") if p.read_text().strip()]):
        assert time.monotonic() < deadline, f"the kept Ray's dashboard agent never started ({session})"
        time.sleep(0.5)
    assert int(agent[0].read_text()) == -1
    # ... and no process of the kept Ray holds a port that `ray start --head` takes by default.
    ports = listening(keeper["pid"])
    assert ports and not ports & RAY_START_PORTS, sorted(ports & RAY_START_PORTS)

    # The user's own head beside it.
    head_dir = short_temp_dir()
    env = token_env()  # as tests/test_job_submit.py: whatever ~/.ray/auth_token holds
    env["RAY_TMPDIR"] = head_dir  # the head records itself there, not where other runs look
    ray_cli = str(Path(sys.executable).with_name("ray"))
    dash, gcs, client, agent, agent_grpc, metrics, runtime_env = free_ports(7)
    proc = start_ray_head(
        [ray_cli, "start", "--head", "--block", f"--port={gcs}", "--num-cpus=1",
         "--node-ip-address=127.0.0.1", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dash}", f"--ray-client-server-port={client}", f"--temp-dir={head_dir}",
         "--disable-usage-stats",
         # Not the agent's default HTTP port (52365), even when free now: the agent of any other
         # Ray started on this machine meanwhile takes it if it is free (the other test session's,
         # a contender's), and an agent that cannot bind it never registers: "No available agent
         # to submit job" for 150 s (seen once in a full run). That the kept Ray holds no port
         # `ray start --head` takes by default is asserted above.
         f"--dashboard-agent-listen-port={agent}",
         # Free ports Ray would pick itself, given: its raylet then does not wait for its agents
         # to record theirs, which on a busy machine outlasts the 30 s a node has to start.
         f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
         f"--runtime-env-agent-port={runtime_env}"],
        head_dir, env, tmp_path / "ray-start.log")
    env["RAY_ADDRESS"] = f"http://127.0.0.1:{dash}"
    try:
        # A job runs once the head's agent has registered (the job server gives up on a
        # submission after 10 s without one: retried until then, as tests/test_job_submit.py).
        deadline = time.monotonic() + 150
        while (job := subprocess.run([ray_cli, "job", "submit", "--", "python", "-c", "print(6 * 7)"], env=env,
                                     cwd=head_dir, capture_output=True, text=True)).returncode:
            assert proc.poll() is None, f"ray start exited {proc.returncode}: {(tmp_path / 'ray-start.log').read_text()}"
            assert time.monotonic() < deadline, job.stdout[-2000:] + job.stderr[-2000:]
            time.sleep(1)
        out = job.stdout + job.stderr
        assert "\n42\n" in out and "succeeded" in out, out[-2000:]
    finally:
        proc.send_signal(signal.SIGTERM)  # --block: stops the node's processes
        proc.wait(timeout=60)
        left = wait_gone(head_dir)
    assert not left, f"ray processes outlived `ray start --block`: {left}"


def test_status_says_what_is_kept_and_down_stops_every_kept_ray(kept, tmp_path):
    mine = cli(["up"], tmp_path, kept)
    assert mine.returncode == 0, mine.stderr[-3000:]
    # Another installation's (another venv, Python or Ray): another state dir under the same temp dir.
    other = Path(kept["TMPDIR"]) / f"raytrainer-{os.getuid()}-other"
    theirs = cli(["up"], tmp_path, {**kept, localray.DIR_ENV: str(other)})
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    keepers = [json.loads(p.read_text()) for p in sorted(Path(kept["TMPDIR"]).glob("raytrainer-*/keeper.json"))]
    assert len(keepers) == 2
    # No idle Ray workers started for a keeper (the first driver, which never makes an actor):
    # Ray's default would start one per CPU, now, and kill them as the first run's workers start.
    procs = list(live_processes())
    raylets = {pid for pid, _, cmd in procs if kept["TMPDIR"].encode() in cmd and b"/raylet/raylet" in cmd}
    assert len(raylets) == 2
    idle = [cmd[:60] for _, ppid, cmd in procs if ppid in raylets
            and (cmd.startswith(b"ray::IDLE") or b"default_worker" in cmd)]
    assert idle == []

    status = cli(["status"], tmp_path, kept)
    assert status.returncode == 0, status.stderr
    for keeper in keepers:
        assert keeper["address"] in status.stdout and f"keeper pid {keeper['pid']}" in status.stdout, status.stdout
    assert str(other) in status.stdout and "idle for" in status.stdout

    down = cli(["down"], tmp_path, kept)
    assert down.returncode == 0 and down.stdout.count("stopped the local Ray") == 2, down.stdout + down.stderr
    assert "no local Ray kept" in cli(["status"], tmp_path, kept).stdout
    deadline = time.monotonic() + 60
    while processes_under(kept["TMPDIR"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_under(kept["TMPDIR"])


def test_a_kept_ray_whose_gcs_is_gone_is_not_joined_and_a_new_one_is_started(kept, tmp_path):
    """`ray stop` ends every Ray process on the machine, the kept Ray's GCS included, while
    its keeper (a driver of it) lives on until Ray ends it a minute later: a run in that
    minute joined the dead address and waited for good."""
    a = project(tmp_path / "a", 1)
    first = cli(["train", "run.yaml", "--set", "run.name=one", "--no-progress"], a, kept)
    assert first.returncode == 0, first.stderr[-3000:]
    keeper = keeper_of(kept)
    (gcs,) = [pid for pid, _, cmd in live_processes() if b"gcs_server" in cmd and kept["TMPDIR"].encode() in cmd]
    os.kill(gcs, signal.SIGKILL)
    second = cli(["train", "run.yaml", "--set", "run.name=two", "--no-progress"], a, kept)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"the local Ray kept at {keeper['address']} no longer answers" in second.stderr
    assert keeper_of(kept)["pid"] != keeper["pid"] and "Failed to get cluster ID" not in second.stderr


def test_an_address_where_no_ray_answers_is_an_error_that_names_it_and_where_it_came_from(monkeypatch):
    from raytrainer.errors import RaytrainerError

    (port,) = free_ports(1)
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    monkeypatch.setattr(localray, "ANSWER_TIMEOUT_S", 1.0)
    with pytest.raises(RaytrainerError, match=rf"no Ray answers at 127.0.0.1:{port} \(from RAY_ADDRESS\).*"
                                              "unset RAY_ADDRESS"):
        localray.connect()
    with pytest.raises(RaytrainerError, match=r"\(from --address\).*leave --address out"):
        localray.connect(f"127.0.0.1:{port}")


def test_the_processes_a_finished_run_kept_end_with_its_driver(kept, tmp_path):
    """A finished run keeps its workers' processes for the next run of its Python process
    (kept.py); they are detached actors (failure.driver_grace_s), so Ray does not end them
    with their driver: they end themselves once its job is gone, holding no state."""
    a = project(tmp_path / "a", 1)
    done = cli(["train", "run.yaml", "--set", "run.name=one", "--no-progress"], a, kept)
    assert done.returncode == 0, done.stderr[-3000:]
    raylet = {pid for pid, _, cmd in live_processes() if kept["TMPDIR"].encode() in cmd and b"/raylet/raylet" in cmd}

    def workers():
        return [pid for pid, ppid, cmd in live_processes() if ppid in raylet and b":Worker" in cmd]

    wait_until(lambda: not workers(), "the kept processes of a driver gone ended", timeout_s=30.0)
