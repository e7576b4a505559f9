"""The local Ray a first run keeps for the next ones: a later run joins it, only raytrainer
finds it, `raytrainer down` or idleness stops it with every process it started, and a run
that finds it in use starts a Ray of its own."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from raytrainer.driver import localray

from .ray_procs import processes_under, short_temp_dir, wait_gone
from .tasks import RegressionTask
from .waits import Deadline

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


def test_a_later_run_joins_the_ray_the_first_kept_which_only_raytrainer_finds_and_down_stops(tmp_path):
    folder = short_temp_dir()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # RAY_TMPDIR: where Ray looks for a Ray that `ray start` left (which a run joins first):
    # another test's or process's on this machine is not to be found.
    env.update(RAYTRAINER_RAY_DIR=folder, RAYTRAINER_KEEP_RAY="5", RAY_TMPDIR=folder)
    config = tmp_path / "env.yaml"
    config.write_text(yaml.safe_dump({
        "task": {"target": "tests.test_localray:EnvTask", "args": {"path": str(tmp_path / "mark")}},
        "trainer": {"max_steps": 2, "global_batch_size": 8}, "scaling": {"num_workers": 1},
        "run": {"storage": str(tmp_path / "runs")}}))
    try:
        first = run_cli(["train", str(config), "--set", "run.name=first", "--no-progress"], env)
        assert first.returncode == 0, first.stderr[-3000:]
        assert "started a local Ray, kept for the next runs" in first.stderr
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
        assert "started a local Ray" not in second.stderr
        assert json.loads((Path(folder) / "keeper.json").read_text())["pid"] == keeper["pid"]
        marks = {p.read_text() for p in tmp_path.glob("mark.*")}
        assert marks == {"-", "second"}, marks

        down = run_cli(["down"], env)
        assert down.returncode == 0 and "stopped the local Ray" in down.stdout, down.stderr
    finally:
        localray.down(folder=Path(folder))
        left = wait_gone(folder)
    assert not left, f"left running: {left}"


def test_the_kept_ray_stops_by_itself_once_idle_and_a_run_that_finds_it_in_use_starts_its_own(monkeypatch):
    folder = short_temp_dir()
    monkeypatch.setenv("RAYTRAINER_RAY_DIR", folder)
    monkeypatch.setenv("RAYTRAINER_KEEP_RAY", "5")
    try:
        # Another run holds it: this one does not wait for it, nor start a second keeper.
        other = localray._lock(Path(folder) / "users.lock")
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
