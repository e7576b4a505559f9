"""trainer.validation: async validation on validation actors (worker/loop/validation.py), on a
local Ray, 2 Gloo workers; the config's two names for one setting, without Ray."""

import json
import os
import signal
import time

import pytest

import raytrainer
from raytrainer.config import load_config
from raytrainer.errors import ConfigError

from .conftest import assert_no_leaks
from .faults import Run
from .tasks import RegressionTask


def config(tmp_path, name, **sections):
    cfg = {
        "task": {"target": "tests.tasks:RegressionTask", "args": {}},
        "trainer": {"max_steps": 7, "global_batch_size": 32, "log_every_n_steps": 3, "ema_decay": 0.9,
                    "validation": {"every_n_steps": 2}},
        "scaling": {"num_workers": 2},
        "run": {"name": name, "storage": str(tmp_path)},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def val_rows(run_dir):
    return {r["step"]: r for r in read(run_dir / "metrics.jsonl") if "val_loss" in r}


def test_val_every_n_steps_is_validation_every_n_steps():
    base = {"task": {"target": "tests.tasks:RegressionTask"}, "trainer": {"max_steps": 3}}
    old = load_config({**base, "trainer": {"max_steps": 3, "val_every_n_steps": 5}})
    assert old.trainer.validation.every_n_steps == 5 and not old.trainer.validation.async_
    new = load_config({**base, "trainer": {"max_steps": 3, "validation": {"every_n_steps": 4, "async": True}}})
    assert new.trainer.val_every_n_steps == 4 and new.trainer.validation.async_
    # A resolved config holds both; --set of either name replaces both.
    assert load_config(new.to_dict(), ["trainer.val_every_n_steps=6"]).trainer.validation.every_n_steps == 6
    with pytest.raises(ConfigError, match="trainer.val_every_n_steps=5 and trainer.validation.every_n_steps=4"):
        load_config({**base, "trainer": {"max_steps": 3, "val_every_n_steps": 5, "validation": {"every_n_steps": 4}}})
    with pytest.raises(ConfigError, match="trainer.validation.num_workers=0"):
        load_config({**base, "trainer": {"max_steps": 3, "validation": {"num_workers": 0}}})


def test_a_checkpoint_waiting_for_its_validation_is_kept_then_ranked(tmp_path):
    from raytrainer.checkpoint import VALIDATION_PENDING, Checkpoints, Storage
    from raytrainer.config import CheckpointConfig, KeepBestConfig

    ckpts = Checkpoints(Storage(str(tmp_path)), "r", CheckpointConfig(
        keep_last=1, keep_best=KeepBestConfig(metric="val_loss", k=1)))
    ckpts.write(2, {"w": 2}, {"val_loss": 0.5})
    ckpts.write(4, {"w": 4}, {VALIDATION_PENDING: 1})  # its validation on its way
    ckpts.write(6, {"w": 6}, {"val_loss": 0.9})
    assert [c.step for c in ckpts.committed()] == [2, 4, 6]  # 4 waits for its validation
    assert ckpts.rescore(4, {"val_loss": 0.1})
    assert [c.step for c in ckpts.committed()] == [4, 6]  # the best now, 2 dropped
    assert ckpts.committed()[0].manifest["metrics"] == {"val_loss": 0.1}
    assert not ckpts.rescore(4, {"val_loss": 7.0})  # ranked once only
    assert not ckpts.rescore(3, {"val_loss": 0.0})  # no such checkpoint


def test_async_metrics_equal_sync_and_the_last_step_is_validated(ray_local, tmp_path):
    """The same run validated in the loop and on 2 validation actors (EMA weights): every
    validation's metrics bit-identical, at the same steps; the last step (7, not a multiple
    of 2) validated at the end in both."""
    sync = raytrainer.train(config(tmp_path, "sync"), progress=False)
    run = raytrainer.train(config(tmp_path, "async", trainer={"validation": {
        "every_n_steps": 2, "async": True, "num_workers": 2}}), progress=False)
    a, b = val_rows(sync.run_dir), val_rows(run.run_dir)
    assert sorted(a) == sorted(b) == [2, 4, 6, 7]
    for step in a:
        assert (a[step]["val_loss"], a[step]["val_index"]) == (b[step]["val_loss"], b[step]["val_index"]), step
    events = read(run.run_dir / "events.jsonl")
    validated = [e for e in events if e["event"] == "validated"]
    assert [e["step"] for e in validated] == [2, 4, 6]  # the async ones; 7 ran in the loop
    assert all(e["at_step"] >= e["step"] for e in validated)
    assert result_metrics_match(run, b[7])
    assert_no_leaks()


def result_metrics_match(result, row):
    return result.metrics["val_loss"] == row["val_loss"]


def test_keep_best_ranks_checkpoints_when_their_validation_arrives(ray_local, tmp_path):
    """keep_last 1 + the best 1 by val_loss: a checkpoint is written before its validation
    arrives, kept until it does, then ranked by its own step's val_loss."""
    cfg = config(tmp_path, "best", trainer={"max_steps": 12, "validation": {"every_n_steps": 2, "async": True}},
                 task={"args": {"lr": 0.3}},  # large: val_loss goes up and down
                 checkpoint={"every_n_steps": 2, "keep_last": 1, "keep_best": {"metric": "val_loss", "k": 1}})
    result = raytrainer.train(cfg, progress=False)
    val = val_rows(result.run_dir)
    kept = sorted((result.run_dir / "checkpoints").glob("step-*/COMMITTED"))
    manifests = {json.loads(p.read_text())["step"]: json.loads(p.read_text()) for p in kept}
    assert all("validation_pending" not in m["metrics"] for m in manifests.values())
    for step, manifest in manifests.items():  # each ranked by its own step's validation
        assert manifest["metrics"]["val_loss"] == val[step]["val_loss"]
    best = min((val[s]["val_loss"], s) for s in val if s % 2 == 0)[1]
    assert set(manifests) == {best, 12}


class GatedValidation(RegressionTask):
    """Its val_step waits while the file `gate` exists, in validation actors only (no
    process group there): a validation is under way when the test kills its actor."""

    def __init__(self, gate=None, **kwargs):
        super().__init__(**kwargs)
        self.gate = gate

    def val_step(self, model, batch):
        import torch.distributed as dist

        while self.gate and os.path.exists(self.gate) and not dist.is_initialized():
            time.sleep(0.05)
        return super().val_step(model, batch)


def test_a_validation_actor_killed_is_retried_and_the_run_succeeds(ray_local, tmp_path):
    gate = tmp_path / "gate"
    gate.touch()
    cfg = config(tmp_path, "kill", trainer={"max_steps": 40, "validation": {"every_n_steps": 8, "async": True}},
                 task={"target": "tests.test_validation:GatedValidation", "args": {"gate": str(gate)}})
    run = Run(cfg)
    pids = None
    deadline = time.monotonic() + 240
    while pids is None and time.monotonic() < deadline:
        time.sleep(0.2)
        try:
            pids = next((e["pids"] for e in run.events() if e["event"] == "validation_workers"), None)
        except FileNotFoundError:
            pass
    assert pids, "no validation_workers event"
    os.kill(pids[0], signal.SIGKILL)  # in the validation of step 8, held at the gate
    time.sleep(1.0)
    gate.unlink()
    result = run.result()
    assert result.events[-1]["event"] == "finished"
    val = val_rows(result.run_dir)
    assert sorted(val) == [8, 16, 24, 32, 40]  # none lost, the last waited for
    assert [e["step"] for e in result.events if e["event"] == "validated"] == [8, 16, 24, 32]
    assert not [e for e in result.events if e["event"] in ("validation_failed", "worker_failed")]
    assert_no_leaks()


def test_early_stopping_on_async_validation_stops_every_rank(ray_local, tmp_path):
    """Frozen weights: val_loss never improves, so the third validation to arrive stops the
    run, on both ranks at the step it arrives at (the run ends; it does not hang)."""
    cfg = config(tmp_path, "early", task={"args": {"lr": 0.0, "sleep_s": 0.05, "num_samples": 4096}},
                 trainer={"max_steps": 400, "validation": {"every_n_steps": 2, "async": True},
                          "early_stopping": {"metric": "val_loss", "patience": 2}})
    result = raytrainer.train(cfg, progress=False)
    finished = result.events[-1]
    assert finished["event"] == "finished" and finished["reason"].startswith("early_stopping: val_loss")
    assert finished["step"] < 400
    val = val_rows(result.run_dir)
    assert finished["step"] in val  # the last weights validated
    assert len(val) >= 3


# --------------------------------------------------------------------------- your own loop

def loop_with_validation(ctx, steps=9):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    wrapped = ctx.prepare_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(ctx.step + 1, steps + 1):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step * 10 + ctx.rank))
        loss = wrapped(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.report({"loss": loss.item(), "step": step, "wsum": float(model.weight.detach().sum())},
                   state={"model": model, "step": step}, validate=check_state if step % 3 == 0 else None)


def check_state(state):
    return {"seen_step": state["step"], "wsum": float(state["model"]["weight"].sum())}


def test_your_loop_asks_for_validations_of_reported_state(ray_local, tmp_path):
    result = raytrainer.train_loop(loop_with_validation, {
        "trainer": {"max_steps": 9}, "scaling": {"num_workers": 2}, "loggers": [],
        "run": {"name": "loop", "storage": str(tmp_path)}}, progress=False)
    rows = read(result.run_dir / "metrics.jsonl")
    train = {r["step"]: r for r in rows if "loss" in r}
    val = {r["step"]: r for r in rows if "val_wsum" in r}
    assert sorted(val) == [3, 6, 9]
    for step, row in val.items():  # the state of that step, not a later one
        assert row["val_seen_step"] == step and row["val_wsum"] == train[step]["wsum"]
