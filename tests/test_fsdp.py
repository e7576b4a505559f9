"""trainer.strategy=fsdp (FSDP2) through the whole stack on Gloo/CPU: the same maths as
DDP, sharded checkpoints that resume at another world size, recovery from peer snapshots
when a worker is killed from outside, and from the newest checkpoint when a worker and the
peer holding its snapshot are both lost (or snapshots are off)."""

import json
import random
import time

import pytest
import torch

import raytrainer

from .conftest import assert_no_leaks
from .faults import Run, freeze, kill

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
        "failure": {"chaos": list(chaos), "max_failures": 2, "warm_spares": 0},
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


# ---------------------------------------------------------------------- peer snapshots

PEER_STEPS = 16


def peer_config(tmp_path, name, workers=3, recovery="fast"):
    """3 workers, a snapshot every 4 steps, a checkpoint every 5; slow enough steps for a
    kill from outside to land in the middle of the run."""
    cfg = config(tmp_path, name, workers=workers, max_steps=PEER_STEPS)
    cfg["task"]["args"] = {"sleep_s": 0.03, "steps_to": str(tmp_path / f"{name}-at-")}
    cfg["checkpoint"]["every_n_steps"] = 5
    cfg["failure"].update(snapshot_every_n_steps=4, collective_timeout_s=60, recovery=recovery)
    return cfg


def at_step(run, tmp_path, step):
    """Until a worker of a peer_config run has trained `step`, as the workers write it (the
    driver's rows trail them by seconds on a loaded machine, and 16 short steps would be
    over before a kill meant for the middle): 2 micro-batches a step (a share of 11 of the
    global 32 in micro-batches of 8)."""
    run.wait_for_worker_step(tmp_path / f"{run.run_dir.name}-at-", 2 * step)


@pytest.fixture(scope="module")
def fsdp3_run(ray_local, tmp_path_factory):
    return raytrainer.train(peer_config(tmp_path_factory.mktemp("fsdp3"), "fsdp3"), progress=False)


@pytest.fixture(scope="module")
def fsdp3(fsdp3_run):
    return weights(fsdp3_run)


def assert_same(a, b):
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def of(events, name):
    return [e for e in events if e["event"] == name]


def test_a_worker_killed_from_outside_is_recovered_from_its_peers_snapshot(fsdp3, tmp_path):
    """failure.recovery exact: SIGKILL at a random moment after step 6: the survivors go
    back to their own snapshot of step 4 or 8, the replacement of rank 1 takes the copy rank
    2 holds, nothing is read from storage, and the replayed run ends bit-identical to the
    undisturbed one."""
    run = Run(peer_config(tmp_path, "peers", recovery="exact"))
    at_step(run, tmp_path, 6)
    time.sleep(random.uniform(0, 0.1))
    kill(run.pids()[1])
    result = run.result()
    recovered = of(result.events, "recovered")
    assert len(recovered) == 1, recovered
    back = recovered[0]
    assert back["state_from"] == "peers" and back["peers"] == {"1": 2} and back["replaced"] == [1]
    assert back["snapshot_step"] in (4, 8, 12) and back["step"] == back["snapshot_step"]
    assert back["steps_lost"] <= 4  # replayed: at most snapshot_every_n_steps
    assert not of(result.events, "resumed")  # no checkpoint was read
    assert_same(weights(result), fsdp3)
    assert sorted(losses(result)) == list(range(1, PEER_STEPS + 1))
    assert_no_leaks()


@pytest.mark.hangs
def test_a_frozen_worker_is_replaced_and_recovered_from_its_peers_snapshot(fsdp3, tmp_path):
    """SIGSTOP: the others wait for it in a sharded collective; after step_timeout_s it alone
    is blamed and killed, and its replacement takes the copy rank 2 holds."""
    cfg = peer_config(tmp_path, "frozen", recovery="exact")
    cfg["failure"]["step_timeout_s"] = 3
    run = Run(cfg)
    at_step(run, tmp_path, 6)
    time.sleep(random.uniform(0, 0.1))
    freeze(run.pids()[1])
    result = run.result()
    failed, recovered = of(result.events, "worker_failed"), of(result.events, "recovered")
    assert [(f["kind"], f["rank"]) for f in failed] == [("hung", 1)]
    assert len(recovered) == 1 and recovered[0]["state_from"] == "peers" and recovered[0]["peers"] == {"1": 2}
    assert_same(weights(result), fsdp3)
    assert_no_leaks()


def test_two_neighbours_killed_together_fall_back_to_the_newest_checkpoint(fsdp3, tmp_path):
    """Ranks 1 and 2 at once: rank 2 held the copy of rank 1's snapshot, so no snapshot of
    rank 1's state is left; the run restarts from the newest checkpoint (written with DCP's
    async save, committed from its thread) and still ends bit-identical."""
    cfg = peer_config(tmp_path, "neighbours")
    cfg["checkpoint"]["async"] = True
    held = tmp_path / "held"  # the steps from 7 on wait while it exists
    held.touch()
    cfg["task"]["args"]["hold"] = [str(held), 2 * 7]  # 2 micro-batches a step (at_step)
    run = Run(cfg)
    # Killed once step 5's checkpoint is committed, as its marker on storage says (the
    # driver's events of it, and the workers' count of steps, came before or after it by
    # seconds on a loaded machine), before the one of step 10.
    try:
        run.wait_for(lambda: (run.run_dir / "checkpoints" / "step-00000005" / "COMMITTED").exists(),
                     "step 5's checkpoint committed")
        pids = run.pids()
        kill(pids[1])
        kill(pids[2])
    finally:
        held.unlink()
    result = run.result()
    recovered = of(result.events, "recovered")
    assert recovered[-1]["state_from"] == "checkpoint" and recovered[-1]["from_checkpoint"].startswith("step-")
    assert "rank 1" in recovered[-1]["why"]
    assert of(result.events, "resumed")
    manifests = [json.loads((p / "COMMITTED").read_text()) for p in (result.run_dir / "checkpoints").iterdir()]
    assert sorted(m["step"] for m in manifests) == [5, 10, 15, 16] and {m["format"] for m in manifests} == {"dcp"}
    assert_same(weights(result), fsdp3)
    assert_no_leaks()


def test_two_non_neighbours_killed_go_on_at_two_resharded_from_peers_and_grow_back(fsdp3_run, tmp_path):
    """failure.recovery fast (the default), 4 workers, ranks 0 and 2 SIGKILLed together at a
    random moment: each one's copy is on a survivor (1 and 3), so the two survivors go back
    to the snapshots of one step, re-shard the whole state onto 2 ranks and go on at once,
    with the same global batch; the replacements join by the same re-sharding once up. The
    steps are slow until the group is back at 4 (the test's file), so that happens mid-run.
    Nothing is read from storage; the run ends within float tolerance of the undisturbed
    3-worker one (the same global batch and sample order at any world size), and a
    checkpoint it wrote after the re-shards resumes on 3 workers to its weights."""
    slow = tmp_path / "slow"
    slow.touch()
    cfg = peer_config(tmp_path, "reshard", workers=4)
    cfg["task"] = {"target": "tests.tasks:ElasticTask", "args": {"sleep_s": 2.0, "slow_while": str(slow)}}
    run = Run(cfg)
    run.wait_for_step(6, timeout=300)  # four processes start and import torch first
    time.sleep(random.uniform(0, 0.5))
    pids = run.pids()
    kill(pids[0])
    kill(pids[2])
    run.wait_for(lambda: [e for e in of(run.events(), "resized") if e["new_world_size"] == 4], "the grow back to 4",
                 timeout=180)
    slow.unlink()
    result = run.result()
    recovered = of(result.events, "recovered")
    assert len(recovered) == 1, recovered
    back = recovered[0]
    assert back["state_from"] == "peers" and sorted(back["dropped"]) == [0, 2] and back["peers"] == {"0": 1, "2": 3}
    assert back["steps_lost"] <= 4 and back["step"] == back["snapshot_step"]  # replayed: <= the interval
    resized = [(e["old_world_size"], e["new_world_size"], e["cause"].split(":")[0])
               for e in of(result.events, "resized")]
    assert resized == [(4, 2, "failure"), (2, 4, "lost workers replaced")]
    assert not of(result.events, "resumed")  # no checkpoint was read
    assert {r["world_size"] for r in result.history if "loss" in r} >= {2, 4}
    assert_close(weights(result), weights(fsdp3_run))
    got, base = losses(result), losses(fsdp3_run)
    assert sorted(got) == list(range(1, PEER_STEPS + 1))
    for step in base:
        assert abs(got[step] - base[step]) <= 1e-5 * max(1.0, abs(base[step])), (step, got[step], base[step])
    # A checkpoint written after the re-shards (step 15, past the kill) resumes on 3 workers
    # to the same last step and weights.
    ckpt = result.run_dir / "checkpoints" / "step-00000015"
    again = raytrainer.train({**peer_config(tmp_path, "after-reshard"), "task": cfg["task"],  # the file is gone
                              "run": {"name": "after-reshard", "storage": str(tmp_path), "resume": str(ckpt)}},
                             progress=False)
    assert [e["step"] for e in of(again.events, "resumed")] == [15]
    assert sorted(losses(again)) == [PEER_STEPS] and abs(losses(again)[PEER_STEPS] - got[PEER_STEPS]) <= 1e-5
    assert_close(weights(again), weights(result))
    assert_no_leaks()
