"""trainer.strategy=fsdp (FSDP2) through the whole stack on Gloo/CPU: the same maths as
DDP, sharded checkpoints that resume at another world size, and recovery from the
newest checkpoint when a worker is killed."""

import json

import pytest
import torch

import raytrainer

from .conftest import assert_no_leaks

STEPS = 8


def config(tmp_path, name, workers=2, strategy="fsdp", chaos=(), resume="auto", max_steps=STEPS,
           async_save=False, **trainer):
    return {
        "task": {"target": "tests.tasks:RegressionTask", "args": {}},  # no dropout: its masks differ by rank, so by worker count
        "trainer": {"max_steps": max_steps, "global_batch_size": 32, "micro_batch_size": 8, "grad_clip_norm": 0.5,
                    "ema_decay": 0.9, "val_every_n_steps": 4, "strategy": strategy, **trainer},
        "scaling": {"num_workers": workers},
        "checkpoint": {"every_n_steps": 3, "keep_last": 5, "async": async_save},
        # No warm spare: a sharded run restarts every worker, and the idle process would only
        # compete for the two cores while the runs start.
        "failure": {"chaos": list(chaos), "max_failures": 2, "warm_spare": False},
        "run": {"name": name, "storage": str(tmp_path), "resume": resume},
    }


def weights(result):
    return torch.load(result.run_dir / "model.pt", weights_only=True)


def losses(result):
    return {r["step"]: r["loss"] for r in result.history if "loss" in r}


def assert_close(a, b, atol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=1e-4), (k, (a[k] - b[k]).abs().max())


@pytest.fixture(scope="module")
def fsdp2(ray_local, tmp_path_factory):
    """An undisturbed FSDP run on 2 workers: accumulation (2 micro-batches of 8 per rank),
    global-norm clipping over shards, EMA, validation every 4 steps, a sharded checkpoint
    every 3 steps."""
    return raytrainer.train(config(tmp_path_factory.mktemp("fsdp"), "fsdp2"), progress=False)


def test_fsdp_rows(fsdp2):
    """Every step logged once with its pre-clip norm, validation at 4 and 8. (That the maths
    is DDP's on one worker, accumulation, clipping and EMA included, is test_strategy's.)"""
    assert sorted(losses(fsdp2)) == list(range(1, STEPS + 1))
    assert all("grad_norm" in r for r in fsdp2.history if "loss" in r)
    assert [r["step"] for r in fsdp2.history if "val_loss" in r] == [4, 8]


def test_fsdp_checkpoints_are_sharded_and_committed(fsdp2):
    root = fsdp2.run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-00000003", "step-00000006", "step-00000008"]
    for ckpt in root.iterdir():
        manifest = json.loads((ckpt / "COMMITTED").read_text())
        assert manifest["format"] == "dcp"
        files = {p.name: p.stat().st_size for p in ckpt.iterdir() if p.name != "COMMITTED"}
        assert {n: f["size"] for n, f in manifest["files"].items()} == files
        assert sum(n.endswith(".distcp") for n in files) == 2  # one file of shards per rank
        assert ".metadata" in files and "state.pt" not in files


@pytest.mark.parametrize("workers", [1, 3])
def test_a_checkpoint_from_two_workers_resumes_on_another_world_size(fsdp2, tmp_path, workers):
    """Resharded on load: the run from step 3 on 1 or 3 workers continues the loss curve of
    the 2-worker run and ends with its weights (the same global batch and sample order)."""
    ckpt = fsdp2.run_dir / "checkpoints" / "step-00000003"
    result = raytrainer.train(config(tmp_path, f"on{workers}", workers=workers, resume=str(ckpt)),
                              progress=False)
    resumed = [e for e in result.events if e["event"] == "resumed"]
    assert resumed and resumed[0]["step"] == 3
    a, b = losses(result), losses(fsdp2)
    assert sorted(a) == list(range(4, STEPS + 1)) and all(abs(a[s] - b[s]) < 1e-5 for s in a)
    assert_close(weights(result), weights(fsdp2))
    assert_no_leaks()


def test_a_killed_fsdp_worker_recovers_from_the_newest_checkpoint(fsdp2, tmp_path):
    """The lost rank's shards exist on no survivor: the group restarts from the checkpoint
    of step 3 (written with DCP's async save, committed from its thread) and redoes
    steps 4-5; the run ends as the undisturbed one did."""
    chaos = [{"action": "kill", "step": 5, "rank": 1, "at": "random"}]
    result = raytrainer.train(config(tmp_path, "killed", chaos=chaos, async_save=True), progress=False)
    manifests = [json.loads((p / "COMMITTED").read_text()) for p in (result.run_dir / "checkpoints").iterdir()]
    assert sorted(m["step"] for m in manifests) == [3, 6, 8] and {m["format"] for m in manifests} == {"dcp"}
    recovered = [e for e in result.events if e["event"] == "recovered"]
    assert len(recovered) == 1 and recovered[0]["from_checkpoint"] == "step-00000003"
    assert recovered[0]["step"] == 3 and recovered[0]["steps_lost"] in (1, 2)
    assert_close(weights(result), weights(fsdp2), atol=0)  # the same world size: the same sums
    assert sorted(losses(result)) == list(range(1, STEPS + 1))
    assert_no_leaks()
