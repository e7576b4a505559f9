"""Elastic runs on a local multi-node Ray (one raylet per 1-CPU node, on this machine):
the group grows when a node joins, shrinks without a checkpoint when one is lost,
sees every sample of each epoch exactly once, and ends with the weights of an
undisturbed run; a run short of room for its size trains on and grows back to it; below
min_workers it fails after a bounded wait."""

import json
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import raytrainer
from ray._private import state
from raytrainer.data import BatchPlan
from raytrainer.errors import PlacementError

from .conftest import assert_no_leaks, cluster_with
from .faults import Run, kill
from .waits import join, patience, slowness, wait_until

NUM_SAMPLES, BATCH, STEPS, SEED = 200, 16, 300, 0  # 16 does not split over 3: uneven shards


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    return cluster_with(shared_cluster, 2)


@pytest.fixture(autouse=True)
def two_nodes(cluster):
    """Every test starts on two worker nodes, whatever the one before left: a test that
    failed half-way left a third node, on which the next formed at 3 workers and never grew
    (a slow day's second failure)."""
    nodes = list(cluster.worker_nodes)
    for extra in nodes[2:]:
        cluster.remove_node(extra)
    for _ in range(2 - len(nodes)):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()


def config(tmp_path, name, scaling, **args):
    return {
        "task": {"target": "tests.tasks:ElasticTask", "args": {"num_samples": NUM_SAMPLES, **args}},
        "trainer": {"max_steps": STEPS, "global_batch_size": BATCH, "seed": SEED},
        "scaling": {"num_workers": 2, "replace_timeout_s": 2, **scaling},
        "failure": {"step_timeout_s": 60},
        "run": {"name": name, "storage": str(tmp_path)},
    }


def growable(tmp_path, name, **trainer):
    """A run that may grow to 3 workers, records its samples (under the returned path),
    and goes slowly while the returned file exists."""
    slow = tmp_path / "slow"
    slow.touch()
    record = tmp_path / "record" / "samples"
    record.parent.mkdir()
    # Slow enough that a node added meanwhile is up before the run ends: on a loaded machine
    # a raylet and a worker take a minute or two to start, and at 0.05 s a micro-batch the
    # 300 steps were over first (the run finished at 2 workers, never grown).
    cfg = config(tmp_path, name, {"max_workers": 3}, record=str(record), sleep_s=round(0.05 * slowness(), 3),
                 slow_while=str(slow))
    cfg["trainer"].update(trainer)
    return cfg, slow, record


def in_background(cfg):
    """Train in a thread; returns it and a dict that gets 'result' or 'error'."""
    out = {}

    def target():
        try:
            out["result"] = raytrainer.train(cfg, progress=False)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


@contextmanager
def finishing(thread, slow):
    """The run in `thread` is let finish on the way out (`slow` removed, joined), whether the
    block passed or failed: a run left going holds the nodes the module's next tests need."""
    try:
        yield
    finally:
        slow.unlink(missing_ok=True)
        join(thread, 120)


def wait_for(predicate, timeout_s, what, thread=None):
    """Until predicate() is true (its value), `timeout_s` seconds of a quiet machine at most;
    `thread`: the run's, whose end fails the wait at once (a limit stretched on a slow day
    is minutes)."""
    return wait_until(predicate, what, timeout_s, every_s=0.2, alive=thread.is_alive if thread else None)


def read_events(run_dir):
    path = Path(run_dir) / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def resized(run_dir):
    return [e for e in read_events(run_dir) if e["event"] == "resized"]


def rows(run_dir):
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def worlds(run_dir):
    """The world size of each training row so far."""
    return [r["world_size"] for r in rows(run_dir) if "loss" in r]


def final_attempts(record):
    """{step: [(rank, indices)]} of the attempt of each step that counted: a step a failure
    interrupted was redone later, at another world size."""
    seeds = {hash((SEED, rank, step)) & 0x7FFF_FFFF_FFFF_FFFF: (rank, step)
             for rank in range(3) for step in range(1, STEPS + 1)}
    attempts = defaultdict(lambda: defaultdict(list))  # step -> world -> [(time, rank, indices)]
    for path in Path(record).parent.glob(Path(record).name + ".*"):
        for line in path.read_text().splitlines():
            world, seed, when, *indices = line.split()
            rank, step = seeds[int(seed)]
            attempts[step][int(world)].append((float(when), rank, [int(i) for i in indices]))
    final = {}
    for step, by_world in attempts.items():
        lines = max(by_world.values(), key=lambda lines: max(t for t, _, _ in lines))
        final[step] = [(rank, indices) for _, rank, indices in lines]
    return final


def test_grows_when_a_node_joins_shrinks_at_once_when_it_goes_and_grows_back(cluster, tmp_path):
    import ray

    cfg, slow, record = growable(tmp_path, "elastic")
    thread, out = in_background(cfg)
    run_dir = tmp_path / "elastic"
    with finishing(thread, slow):
        wait_for(lambda: worlds(run_dir), 60, "the first steps", thread)

        node = cluster.add_node(num_cpus=1)  # room for a third worker
        grow = wait_for(lambda: resized(run_dir), 60, "the group to grow", thread)[0]
        assert (grow["old_world_size"], grow["new_world_size"], grow["added"]) == (2, 3, 1)
        wait_for(lambda: 3 in worlds(run_dir), 60, "steps at 3 workers", thread)
        cluster.remove_node(node)  # its worker goes with it, and no replacement can be placed
        shrink = wait_for(lambda: resized(run_dir)[1:], 60, "the group to shrink", thread)[0]
        # Not waited for (failure.recovery fast): the survivors went on at once, from memory.
        assert (shrink["old_world_size"], shrink["new_world_size"], shrink["dropped"]) == (3, 2, [2])
        assert shrink["cause"].startswith("failure")

        # Once Ray holds the node dead, the lost worker's slot is asked for anew, not left to Ray
        # to reschedule: a placement group rescheduling with no room spins the GCS (it took a
        # core, and the survivors, at Ray's nice 15, ran twentyfold slower).
        wait_for(lambda: not any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()), 60,
                 "Ray to hold the node dead")
        wait_for(lambda: not pgs_in("RESCHEDULING"), 30, "no placement group rescheduling", thread)
        pgs, actors = len(pgs_in()), len(state.actors())
        steps = len(worlds(run_dir))
        wait_for(lambda: len(worlds(run_dir)) > steps + 20, 60, "more steps at 2 workers", thread)  # a few grow checks
        assert not pgs_in("RESCHEDULING") and len(pgs_in()) == pgs and len(state.actors()) == actors
        assert len(pgs_in("PENDING")) == 1  # the lost slot's new group, waiting for room

        cluster.add_node(num_cpus=1)  # room again: the replacement starts there and joins
        back = wait_for(lambda: resized(run_dir)[2:], 60, "the group to grow back", thread)[0]
        assert (back["old_world_size"], back["new_world_size"], back["cause"]) == (2, 3, "lost workers replaced")
    assert "error" not in out, out.get("error")

    events = read_events(run_dir)
    names = [e["event"] for e in events]
    assert names[-1] == "finished" and "resumed" not in names
    recovered = [e for e in events if e["event"] == "recovered"]
    assert len(recovered) == 1 and "from_checkpoint" not in recovered[0]  # from the survivors' memory
    sizes = worlds(run_dir)
    assert [w for i, w in enumerate(sizes) if i == 0 or sizes[i - 1] != w] == [2, 3, 2, 3]
    steps = [r["step"] for r in rows(run_dir) if "loss" in r]
    # Every step once; the row of a step whose metrics were still being reduced when the
    # worker was lost is lost with it (at most one step with log_every_n_steps=1).
    assert len(set(steps)) == len(steps) >= STEPS - 1

    assert_every_sample_once(record)

    # The same maths at 2, 3 and 2 workers: the weights of an undisturbed 2-worker run,
    # up to float rounding (sums over ranks in another order, uneven shards at 3).
    base = raytrainer.train(config(tmp_path, "base", {}), progress=False)
    a = torch.load(run_dir / "model.pt", weights_only=True)
    b = torch.load(base.run_dir / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)
    assert_no_leaks()
    for extra in list(cluster.worker_nodes)[2:]:  # as the module's other tests expect: two nodes
        cluster.remove_node(extra)


def pgs_in(*states):
    """The placement groups of the cluster not removed (in `states`, if given)."""
    from ray.util import placement_group_table

    return [p for p in placement_group_table().values() if p["state"] != "REMOVED"
            and (not states or p["state"] in states)]


def assert_every_sample_once(record):
    """Every sample of each epoch's kept batches exactly once, whatever the world size."""
    final = final_attempts(record)
    assert sorted(final) == list(range(1, STEPS + 1))
    plan = BatchPlan(NUM_SAMPLES, BATCH, BATCH, 1, SEED)
    by_epoch = defaultdict(list)
    for step, lines in final.items():
        epoch, in_epoch = divmod(step - 1, plan.steps_per_epoch)
        by_epoch[epoch] += [i for _, indices in lines for i in indices]
        assert sorted(i for _, indices in lines for i in indices) == sorted(
            torch.cat(plan.micro_batches(epoch, in_epoch * BATCH, 0)).tolist())
    for epoch, seen in by_epoch.items():
        steps = min(plan.steps_per_epoch, STEPS - epoch * plan.steps_per_epoch)
        assert len(seen) == len(set(seen)) == steps * BATCH


def test_a_worker_killed_while_the_group_grows(cluster, tmp_path):
    """The state for the newcomer is being taken from a survivor when that survivor is
    killed: one failure, no step lost, and the group forms at 3 from the other survivor,
    in the recovery, or at a grow right after it where the replacement was not up yet when
    the group re-formed (a loaded machine: seen at load 15)."""
    cfg, slow, record = growable(tmp_path, "growkill")
    cfg["task"]["args"]["saving_marker"] = str(tmp_path / "saving-")
    run = Run(cfg)
    run.wait_for_step(2)
    node = cluster.add_node(num_cpus=1)  # room for a third worker
    taking = wait_for(lambda: sorted(tmp_path.glob("saving-*")), 60, "the grow to take a state")
    source = int(taking[0].name.split("-")[1])
    kill(source)  # while its state is being taken (that takes a second: see tasks.py)
    wait_for(lambda: 3 in worlds(run.run_dir), 60, "steps at 3 workers")
    slow.unlink()
    result = run.result()
    cluster.remove_node(node)
    failed = [e for e in result.events if e["event"] == "worker_failed"]
    recovered = [e for e in result.events if e["event"] == "recovered"]
    assert [f["kind"] for f in failed] == ["died"] and source not in recovered[0]["pids"]
    assert len(recovered) == 1 and recovered[0]["steps_lost"] == 0
    if len(recovered[0]["pids"]) != 3:
        grown = [e for e in result.events if e["event"] == "resized" and e["step"] >= recovered[0]["step"]]
        assert [e["new_world_size"] for e in grown] == [3], result.events
    steps = [r["step"] for r in result.history if "loss" in r]
    assert len(set(steps)) == len(steps) == STEPS and worlds(run.run_dir)[-1] == 3
    assert_every_sample_once(record)
    assert_no_leaks()


def test_per_worker_policy_grows_the_batch_and_the_lr_and_keeps_the_data_position(cluster, tmp_path):
    """batch_policy per_worker: each worker keeps its 8 samples, so a step holds 16 samples
    at 2 workers and 24 at 3, at 1.5 x the LR; the data position stays a sample offset, and
    an epoch ends where the next step's batch no longer fits in it."""
    cfg, slow, record = growable(tmp_path, "per_worker", batch_policy="per_worker")
    thread, out = in_background(cfg)
    run_dir = tmp_path / "per_worker"
    try:
        wait_for(lambda: worlds(run_dir), 60, "the first steps", thread)
        node = cluster.add_node(num_cpus=1)
        wait_for(lambda: worlds(run_dir).count(3) >= 10, 60, "steps at 3 workers", thread)
    finally:
        slow.unlink()
    join(thread, 120)
    cluster.remove_node(node)  # as the module's other tests expect
    assert "error" not in out, out.get("error")
    assert [(e["old_world_size"], e["new_world_size"]) for e in resized(run_dir)] == [(2, 3)]
    train = [r for r in rows(run_dir) if "loss" in r]
    assert {(r["world_size"], r["lr"]) for r in train} == {(2, 0.05), (3, 0.05 * 1.5)}

    plan = BatchPlan(NUM_SAMPLES, BATCH, BATCH, 1, SEED)
    epoch, position, epochs = 0, 0, {}
    for step, lines in sorted(final_attempts(record).items()):
        batch = 8 * len({rank for rank, _ in lines})
        if position + batch > NUM_SAMPLES:  # the rest of the epoch is dropped
            epoch, position = epoch + 1, 0
        seen = sorted(i for _, indices in lines for i in indices)
        assert seen == sorted(plan.order(epoch)[position:position + batch].tolist()), step
        epochs[step] = epoch
        position += batch
    assert {r["step"]: r["epoch"] for r in train} == {s: epochs[s] for s in (r["step"] for r in train)}
    assert max(epochs.values()) >= 2
    assert_no_leaks()


def test_a_fixed_size_run_short_of_room_trains_on_and_grows_back_to_its_size(cluster, tmp_path):
    """num_workers 3 on two 1-CPU nodes: after placement_timeout_s the run starts on 2 and
    says it waits for room; a node comes, it grows to 3; that node goes, it goes on at 2
    (one loss, no failure counted) past placement_timeout_s, and grows back on the next."""
    cfg, slow, record = growable(tmp_path, "fixed")
    cfg["scaling"] = {"num_workers": 3, "placement_timeout_s": 3, "replace_timeout_s": 2}
    thread, out = in_background(cfg)
    run_dir = tmp_path / "fixed"
    with finishing(thread, slow):
        wait_for(lambda: worlds(run_dir), 60, "the first steps", thread)
        waits = lambda: [e for e in read_events(run_dir) if e["event"] == "waiting_for_capacity"]  # noqa: E731
        first = wait_for(waits, 60, "the run to say it waits for room", thread)[0]
        assert (first["world_size"], first["size"], first["missing"], first["min_workers"]) == (2, 3, 1, 1)

        node = cluster.add_node(num_cpus=1)
        grow = wait_for(lambda: resized(run_dir), 60, "the group to grow", thread)[0]
        assert (grow["old_world_size"], grow["new_world_size"]) == (2, 3) and grow["capacity_waited_s"] > 0
        wait_for(lambda: 3 in worlds(run_dir), 60, "steps at 3 workers", thread)
        cluster.remove_node(node)
        wait_for(lambda: len(waits()) == 2, 60, "the run to wait for room again", thread)
        steps = len(worlds(run_dir))
        wait_for(lambda: len(worlds(run_dir)) > steps + 30, 60, "more steps at 2 workers", thread)
        assert thread.is_alive() and worlds(run_dir)[-1] == 2  # well past placement_timeout_s

        cluster.add_node(num_cpus=1)
        back = wait_for(lambda: resized(run_dir)[2:], 60, "the group to grow back", thread)[0]
        assert (back["old_world_size"], back["new_world_size"], back["cause"]) == (2, 3, "lost workers replaced")
    assert "error" not in out, out.get("error")
    events = read_events(run_dir)
    assert events[0]["num_workers"] == 3 and events[0]["min_workers"] == 1
    recovered = [e for e in events if e["event"] == "recovered"]
    assert len(recovered) == 1 and (recovered[0]["losses"], recovered[0]["faults"]) == (1, 0)
    assert recovered[0]["steps_lost"] == 0 and events[-1]["event"] == "finished"
    sizes = worlds(run_dir)
    assert [w for i, w in enumerate(sizes) if i == 0 or sizes[i - 1] != w] == [2, 3, 2, 3]
    steps = [r["step"] for r in rows(run_dir) if "loss" in r]
    assert len(set(steps)) == len(steps) >= STEPS - 1
    assert_every_sample_once(record)
    assert_no_leaks()
    for extra in list(cluster.worker_nodes)[2:]:  # as the module's other tests expect: two nodes
        cluster.remove_node(extra)


def test_below_min_workers_fails_after_a_bounded_wait(cluster, tmp_path):
    slow = tmp_path / "slow"
    slow.touch()
    cfg = config(tmp_path, "short", {"min_workers": 2, "placement_timeout_s": 3}, sleep_s=0.05,
                 slow_while=str(slow))
    thread, out = in_background(cfg)
    try:
        wait_for(lambda: worlds(tmp_path / "short"), 60, "the first steps")
        t0 = time.monotonic()
        # Both 1-CPU nodes hold a worker: one goes, and there is no room for a replacement.
        cluster.remove_node(next(iter(cluster.worker_nodes)))
        join(thread, 60)
        waited = time.monotonic() - t0
    finally:
        slow.unlink()
        cluster.add_node(num_cpus=1)  # as the module's other tests expect
    assert isinstance(out.get("error"), PlacementError), out
    message = str(out["error"])
    assert "fewer than scaling.min_workers=2" in message and "placement_timeout_s=3" in message
    assert 3 <= waited < patience(30)
    assert read_events(tmp_path / "short")[-1]["event"] == "failed"
    assert_no_leaks()
