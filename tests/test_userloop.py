"""Your code as it is: a Task passed by value (from a script's __main__, a notebook-like
namespace), your own loop (raytrainer.train_loop) recovered from a survivor's memory (or,
under FSDP, from its peers' snapshots), and the config errors of both."""

import json
import os
import random
import subprocess
import sys
import threading
import time
from unittest import mock

import pytest
import torch

import raytrainer
from raytrainer.config import load_config
from raytrainer.driver.api import resolve_use_gpu
from raytrainer.driver.cli import main as cli
from raytrainer.errors import ConfigError
from raytrainer.task import describe

from .conftest import ROOT, assert_no_leaks
from .faults import Run, kill

TASK_SOURCE = '''
import torch
import raytrainer
from torch.utils.data import TensorDataset


class {name}(raytrainer.Task):
    def __init__(self, lr=0.05):
        self.lr = lr

    def build_model(self):
        return torch.nn.Linear(4, 1)

    def build_optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=self.lr)

    def train_dataset(self):
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x, x.sum(1, keepdim=True))

    def train_step(self, model, batch):
        x, y = batch
        return {{"loss": torch.nn.functional.mse_loss(model(x), y)}}
'''


def small(tmp_path, name, task, **sections):
    return {"task": task, "trainer": {"max_steps": 4, "global_batch_size": 16}, "scaling": {"num_workers": 2},
            "run": {"name": name, "storage": str(tmp_path)}, "loggers": [], **sections}


def events(result, name):
    return [e for e in result.events if e["event"] == name]


# --------------------------------------------------------------------------- tasks by value

def test_a_task_class_from_the_main_of_a_script_trains_on_2_workers(ray_local, tmp_path):
    """`python script.py`: the class is __main__'s, which no worker can import."""
    script = tmp_path / "script.py"
    script.write_text(TASK_SOURCE.format(name="ScriptTask") + f'''
if __name__ == "__main__":
    result = raytrainer.train({{"task": ScriptTask(lr=0.1), "trainer": {{"max_steps": 4, "global_batch_size": 16}},
                              "scaling": {{"num_workers": 2}}, "run": {{"storage": {str(tmp_path)!r}}},
                              "loggers": []}}, progress=False)
    print("RUN_DIR", result.run_dir)
''')
    # The script joins this module's Ray as a second driver; its own directory, not the
    # repository's, is its working directory and sys.path[0].
    env = dict(os.environ, RAY_ADDRESS=ray_local.get_runtime_context().gcs_address, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = proc.stdout.split("RUN_DIR ")[1].split()[0]
    assert os.path.basename(run_dir).startswith("ScriptTask-")  # run.name from the class name
    rows = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["world_size"] == 2 and r["lr"] == 0.1 for r in rows)
    recorded = load_config(f"{run_dir}/config.yaml").task  # config.yaml stays a YAML config others read
    assert recorded.target == "__main__:ScriptTask" and "instance of ScriptTask" in recorded.by_value
    assert os.path.isfile(f"{run_dir}/model.pt")


def test_a_task_class_from_a_notebook_namespace_trains_and_its_run_resumes_only_from_python(ray_local, tmp_path,
                                                                                           capsys):
    namespace = {}
    exec(TASK_SOURCE.format(name="NotebookTask"), namespace)  # as a notebook cell defines it
    cls = namespace["NotebookTask"]
    result = raytrainer.train(small(tmp_path, "nb", {"target": cls, "args": {"lr": 0.1}}), progress=False)
    assert result.metrics["step"] == 4 and result.metrics["lr"] == 0.1
    assert "class NotebookTask" in load_config(result.run_dir / "config.yaml").task.by_value
    # The CLI cannot rebuild an object from YAML: it says how to go on instead.
    assert cli(["resume", str(result.run_dir), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "task.by_value" in err and "passing the same object again" in err
    # From Python, with the same class: run.resume auto continues from its last checkpoint.
    more = small(tmp_path, "nb", {"target": cls, "args": {"lr": 0.1}})
    more["trainer"]["max_steps"] = 6
    resumed = raytrainer.train(more, progress=False)
    assert [e["step"] for e in events(resumed, "resumed")] == [4] and resumed.metrics["step"] == 6
    assert_no_leaks()


def test_a_task_the_workers_can_import_is_named_by_its_path():
    from tests.tasks import RegressionTask

    assert describe(RegressionTask, {"lr": 0.1}) == ({"target": "tests.tasks:RegressionTask", "args": {"lr": 0.1}},
                                                     None)
    section, payload = describe(RegressionTask(lr=0.2))  # an instance carries its settings: by value
    assert section["target"] == "tests.tasks:RegressionTask" and payload and "instance of" in section["by_value"]
    from raytrainer.driver.api import _by_value  # run.name's default: the class or function name

    assert _by_value({"task": RegressionTask})[2] == "RegressionTask"
    assert _by_value({"task": {"loop": lambda ctx: None}})[2] == "lambda"


def test_a_task_that_cannot_be_pickled_is_a_config_error_naming_the_attribute(tmp_path):
    from tests.tasks import RegressionTask

    task = RegressionTask()
    task.settings = {"lock": threading.Lock()}
    with pytest.raises(ConfigError, match=r"RegressionTask\.settings\['lock'\] .*cannot be pickled"):
        raytrainer.train(small(tmp_path, "bad", task), progress=False)
    lock = threading.Lock()

    def loop(ctx):
        with lock:
            pass

    with pytest.raises(ConfigError, match=r"loop \(closure variable 'lock'\).*cannot be pickled"):
        raytrainer.train_loop(loop, {"run": {"storage": str(tmp_path)}}, progress=False)
    assert not (tmp_path / "bad").exists()


# --------------------------------------------------------------------------- config errors

def test_gpus_asked_of_a_cluster_without_any_are_config_errors_before_any_worker_starts(ray_local, tmp_path):
    cfg = small(tmp_path, "gpu", {"target": "tests.tasks:RegressionTask"}, )
    with pytest.raises(ConfigError, match=r"scaling.use_gpu=true but there is no GPU.*use_gpu: false"):
        raytrainer.train({**cfg, "scaling": {"num_workers": 2, "use_gpu": True}}, progress=False)
    with pytest.raises(ConfigError, match=r"scaling.backend=nccl runs on GPUs only.*backend: gloo"):
        raytrainer.train({**cfg, "scaling": {"num_workers": 2, "backend": "nccl"}}, progress=False)
    assert not (tmp_path / "gpu").exists()  # nothing started, nothing written
    assert_no_leaks()


def test_use_gpu_and_backend_are_checked_against_the_cluster():
    scaling = load_config({"task": {"target": "a:B"}, "trainer": {"max_steps": 1}}).scaling
    assert resolve_use_gpu(scaling, 0, can_grow=False) is False and resolve_use_gpu(scaling, 2, can_grow=False)
    scaling.use_gpu = True
    warned = []
    assert resolve_use_gpu(scaling, 0, can_grow=True, warn=warned.append) and "placement_timeout_s" in warned[0]
    with pytest.raises(ConfigError, match="use_gpu: false"):
        resolve_use_gpu(scaling, 0, can_grow=False)
    with pytest.raises(ConfigError, match="scaling.backend=nccl needs GPU workers but scaling.use_gpu is false"):
        load_config({"task": {"target": "a:B"}, "trainer": {"max_steps": 1},
                     "scaling": {"use_gpu": False, "backend": "nccl"}})


@pytest.mark.parametrize("key, words", [
    ("trainer.precision=bf16", ["trainer.precision applies to a Task's loop", "torch.autocast"]),
    ("data.num_workers=2", ["data.num_workers", "ctx.sampler"]),
    ("failure.chaos=[{action: kill, step: 2}]", ["failure.chaos", "kill a worker from outside"]),
    ("task.target=a:B", ["exactly one of target", "loop"]),
])
def test_a_loop_rejects_the_keys_of_a_tasks_loop(key, words):
    with pytest.raises(ConfigError) as err:
        load_config({"task": {"loop": "a:train"}}, [key])
    assert all(w in str(err.value) for w in words), str(err.value)


# --------------------------------------------------------------------------- your own loop

def loop_config(tmp_path, name, **args):
    return {"task": {"loop": "tests.tasks:regression_loop", "args": {"steps": 30, **args}},
            "trainer": {"global_batch_size": 32, "max_steps": 30}, "scaling": {"num_workers": 2},
            "failure": {"step_timeout_s": 60}, "run": {"name": name, "storage": str(tmp_path)}, "loggers": []}


def weights(result):
    return torch.load(result.run_dir / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def undisturbed(ray_local, tmp_path_factory):
    return raytrainer.train(loop_config(tmp_path_factory.mktemp("base"), "base", state_every=3), progress=False)


def killed_mid_run(config, marker):
    """Run `config` (each step held while `marker` exists), SIGKILL a random rank by pid at a
    random step from 4 to 12, anywhere in it, and let the run finish at full speed once it
    recovered: (its result, the rank killed, its one recovered event)."""
    marker.touch()
    run = Run(config)
    rng = random.Random()
    run.wait_for_step(rng.randint(4, 12))
    time.sleep(rng.uniform(0, 0.05))  # anywhere in a step: the forward, the backward, a report
    victim = rng.randrange(2)
    kill(run.pids()[victim])
    run.wait_for(lambda: any(e["event"] == "recovered" for e in run.events()), "the recovery")
    marker.unlink()
    result = run.result()
    (failed,), (recovered,) = events(result, "worker_failed"), events(result, "recovered")
    assert failed["kind"] == "died" and failed["rank"] == victim
    return result, victim, recovered


def assert_redone_since_the_last_state_report(result, recovered, undisturbed):
    assert not events(result, "resumed")  # no checkpoint was read
    assert recovered["steps_lost"] <= 3 and recovered["step"] % 3 == 0  # since the last state report
    restarted = [r for r in result.history if r["started_at"] > 0]
    assert restarted and restarted[0]["started_at"] == recovered["step"]  # fn ran again from ctx.state
    assert [r["step"] for r in result.history] == list(range(1, 31))
    a, b = weights(result), weights(undisturbed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the same bits
    assert_no_leaks()


def test_your_loop_survives_a_sigkill_with_its_state_from_a_survivor(undisturbed, tmp_path):
    marker = tmp_path / "slow"
    result, victim, recovered = killed_mid_run(loop_config(tmp_path, "kill", state_every=3, sleep_s=0.05,
                                                           marker=str(marker)), marker)
    assert recovered["state_from"] == "memory" and recovered["source_rank"] == 1 - victim
    assert_redone_since_the_last_state_report(result, recovered, undisturbed)


def test_your_loop_reports_rows_and_commits_a_checkpoint(undisturbed):
    rows = [json.loads(line) for line in (undisturbed.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert all(r["world_size"] == 2 and r["epoch"] == (r["step"] - 1) // 8 and "loss" in r for r in rows)
    assert [e["step"] for e in events(undisturbed, "checkpoint_committed")] == [30]  # at the end, as a Task's
    assert undisturbed.run_dir.joinpath("config.yaml").read_text().startswith("task:\n  target: null\n  loop: tests")


def test_your_loop_resumes_from_its_newest_checkpoint(undisturbed, tmp_path):
    """No survivor (here: a new run of the same run directory): ctx.state comes from the
    newest committed checkpoint, and the sampler goes on at its step."""
    import shutil

    shutil.copytree(undisturbed.run_dir, tmp_path / "base")
    result = raytrainer.train(loop_config(tmp_path, "base", steps=34, state_every=3), progress=False)
    assert [e["step"] for e in events(result, "resumed")] == [30]
    new = [r for r in result.history if r["step"] > 30]
    assert [r["step"] for r in new] == [31, 32, 33, 34] and all(r["started_at"] == 30 for r in new)
    assert_no_leaks()


def test_your_loop_pauses_at_a_report_with_state_and_goes_on_from_it(ray_local, tmp_path):
    """A resize's pause (the group's, as the controller asks it): every rank stops at the
    first report with state after the ask, and fn runs again from that state."""
    from raytrainer.contract import ReformPlan
    from raytrainer.driver.group import RayWorkerGroup

    cfg = loop_config(tmp_path, "pause", state_every=4, sleep_s=0.02, marker=str(tmp_path / "slow"))
    (tmp_path / "slow").touch()
    group = RayWorkerGroup(load_config(cfg), use_gpu=False, cluster_can_grow=False)
    try:
        group.start()
        assert group.setup().replicated
        group.launch()
        rows, paused = [], {}
        while not rows:
            rows += group.poll(0.2).rows
        group.pause()
        while len(paused) < 2:
            poll = group.poll(0.2)
            assert not poll.failures and not poll.done
            rows += poll.rows
            paused.update(poll.paused)
        assert {end.step for end in paused.values()} == {rows[-1]["step"]} and rows[-1]["step"] % 4 == 0
        reformed = group.reform(ReformPlan())
        assert reformed.step == rows[-1]["step"] and reformed.state_from == "memory"
        (tmp_path / "slow").unlink()
        group.launch()
        while not (poll := group.poll(0.5)).done:
            assert not (poll.failures or poll.paused)
            rows += poll.rows
        rows += poll.rows
    finally:
        group.shutdown()
    after = [r for r in rows if r["started_at"] > 0]
    assert after and after[0]["started_at"] == reformed.step and after[-1]["step"] == 30
    assert_no_leaks()


# --------------------------------------------------------------------------- your own loop under FSDP

def sharded_config(tmp_path, name, **args):
    cfg = loop_config(tmp_path, name, **args)
    cfg["task"]["loop"] = "tests.tasks:sharded_regression_loop"
    cfg["trainer"]["strategy"] = "fsdp"
    cfg["checkpoint"] = {"every_n_steps": 15}
    return cfg


@pytest.fixture(scope="module")
def sharded(ray_local, tmp_path_factory):
    return raytrainer.train(sharded_config(tmp_path_factory.mktemp("fsdp"), "fsdp", state_every=3), progress=False)


def test_your_loop_under_fsdp_ends_with_ddps_weights_and_writes_sharded_checkpoints(sharded, undisturbed):
    """ctx.prepare_model shards the model as a Task's FSDP run does: the same loop ends
    within float tolerance of its DDP run, model.pt whole; its checkpoints are sharded."""
    a, b = weights(sharded), weights(undisturbed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5, rtol=1e-4), (k, (a[k] - b[k]).abs().max())
    rows = [r for r in sharded.history if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 31)) and {r["world_size"] for r in rows} == {2}
    assert [e["step"] for e in events(sharded, "checkpoint_committed")] == [15, 30]
    ckpt = sharded.run_dir / "checkpoints" / "step-00000015"
    assert json.loads((ckpt / "COMMITTED").read_text())["format"] == "dcp"
    assert sum(p.name.endswith(".distcp") for p in ckpt.iterdir()) == 2  # every rank wrote its shards


def test_your_loop_under_fsdp_survives_a_sigkill_from_its_peers_snapshots(sharded, tmp_path):
    """Every report with state is a peer snapshot: the killed rank's shards come from the
    copy its neighbour holds, the survivor's from its own; no checkpoint is read, the steps
    since the last report with state are redone, and the run ends with the undisturbed
    run's weights."""
    marker = tmp_path / "slow"
    result, victim, recovered = killed_mid_run(sharded_config(tmp_path, "kill", state_every=3, sleep_s=0.05,
                                                              marker=str(marker)), marker)
    assert recovered["state_from"] == "peers" and recovered["peers"] == {str(victim): 1 - victim}
    assert recovered["replaced"] == [victim] and recovered["snapshot_step"] == recovered["step"]
    assert_redone_since_the_last_state_report(result, recovered, sharded)


def test_your_loop_under_fsdp_resumes_from_a_sharded_checkpoint(sharded, tmp_path):
    """No snapshot to go back to (here: a new run from the checkpoint of step 15): each rank
    reads its shards of it, and the run ends with the undisturbed run's weights."""
    cfg = sharded_config(tmp_path, "resumed", state_every=3)
    cfg["run"]["resume"] = str(sharded.run_dir / "checkpoints" / "step-00000015")
    result = raytrainer.train(cfg, progress=False)
    assert [e["step"] for e in events(result, "resumed")] == [15]
    assert {r["started_at"] for r in result.history if r["step"] > 15} == {15}
    a, b = weights(result), weights(sharded)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert_no_leaks()


def test_a_scratch_folder_is_this_workers_and_the_next_one_removes_those_of_processes_gone(tmp_path, monkeypatch):
    """ctx.scratch_dir: named by pid and node under the temp dir; a new one removes this
    node's folders whose process is gone (killed workers'), and keeps a live process's, a
    zombie's (killed, not yet reaped: gone), another node's and what raytrainer did not make."""
    from raytrainer.worker import scratch

    monkeypatch.setattr(scratch.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(scratch.socket, "gethostname", lambda: "node-a")
    dead = subprocess.Popen(["true"])
    dead.wait()
    zombie = subprocess.Popen(["true"])  # exits at once; not waited for: a zombie until it is
    deadline = time.monotonic() + 30
    while scratch.running(zombie.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    root = tmp_path / scratch.ROOT
    names = {"dead": f"{dead.pid}@node-a.x1", "zombie": f"{zombie.pid}@node-a.x2", "live": f"{os.getppid()}@node-a.x3",
             "other node": f"{dead.pid}@node-b.x4", "not ours": "notes"}
    for name in names.values():
        (root / name).mkdir(parents=True)
        (root / name / "checkpoint-1").mkdir()
    made = scratch.make()
    zombie.wait()
    assert made.parent == root and made.name.startswith(f"{os.getpid()}@node-a.") and made.is_dir()
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [made.name, names["live"], names["other node"], names["not ours"]])


def test_ctx_state_due_is_the_auto_interval_of_the_reports_with_state():
    """One rank, no Ray: the integrations' state_every="auto" asks ctx.state_due; the state
    goes with the first report, then every AUTO_FIRST steps until a copy's cost is agreed
    (the third copy's interval follows from it: config.failure.auto_interval)."""
    from raytrainer.config import load_config
    from raytrainer.config.failure import AUTO_FIRST
    from raytrainer.worker.userloop.userloop import UserLoop

    carried = []

    def fn(ctx):
        for step in range(1, 3 * AUTO_FIRST + 2):
            due = ctx.state_due(step)
            carried.extend([step] if due else [])
            ctx.report({"step": step, "loss": 1.0}, state={"w": torch.zeros(4)} if due else None)

    config = load_config({"task": {"loop": "tests.tasks:regression_loop"}, "trainer": {"max_steps": 20}})
    # A UserLoop sets torchrun's variables (LOCAL_RANK, ...) in its process, a worker's: here
    # the test's, where they would make later tests' Hugging Face or accelerate set up a group.
    with mock.patch.dict(os.environ):
        loop = UserLoop(fn, config, rank=0, world_size=1, device=torch.device("cpu"), report=lambda rows: None,
                        notify=lambda event: None, checkpoints=None)
        loop.fit()
    assert carried[:2] == [1, 1 + AUTO_FIRST] and len(carried) >= 3
    assert loop.state_interval.agreed is not None and loop.step == carried[-1]


def test_a_loops_validate_takes_trainer_validation_resources_and_nothing_else_of_it():
    """ctx.report(validate=fn) runs fn in a Ray task with trainer.validation.resources, as
    documented; the rest of trainer.validation is a Task loop's."""
    config = load_config({"task": {"loop": "a:train"}}, ["trainer.validation.resources={CPU: 0.5}"])
    assert config.trainer.validation.resources == {"CPU": 0.5}
    with pytest.raises(ConfigError, match=r"trainer.validation.async applies to a Task's loop.*takes "
                                          r"trainer.validation.resources"):
        load_config({"task": {"loop": "a:train"}}, ["trainer.validation.async=true"])
