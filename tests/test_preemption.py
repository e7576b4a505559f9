"""A node drained for preemption (Ray's draining state, with a deadline) is left at a step
boundary before it goes: the decisions alone, the controller against a fake group, and a
real drain on a local multi-node Ray (one raylet per 1-CPU node, on this machine)."""

import json
import time

import pytest
import torch

from raytrainer.contract import Node, Poll, Reformed, RunEnd, Status
from raytrainer.driver.controller import Controller, ControllerSettings, Records
from raytrainer.driver.metrics import EventLog, JsonlWriter, MetricsHub
from raytrainer.driver.policy import LEAVE_MARGIN_S, choose_source, draining_ranks, leave_draining_nodes

from .ray_procs import parent
from .waits import patience

# ---------------------------------------------------------------------- the policy alone


def test_only_drains_of_our_nodes_concern_us():
    assert draining_ranks({"b": 100.0, "x": None}, ["a", "b", "b", "c"]) == {"b": [1, 2]}
    assert draining_ranks({}, ["a"]) == {}


def leave(**kw):
    args = dict(leaving=1, ready=0, world=3, min_workers=3, seconds_left=60.0, waited_s=0.0,
                replace_timeout_s=10.0, pause_s=1.0)
    return leave_draining_nodes(**{**args, **kw})


def test_leave_as_soon_as_every_leaver_has_a_replacement():
    assert leave(ready=1).now
    assert leave(leaving=2, ready=2, seconds_left=None).now
    assert not leave(leaving=0).now


def test_wait_for_replacements_up_to_replace_timeout_then_shrink_if_min_workers_hold():
    assert not leave(min_workers=2, waited_s=5.0).now  # replacements may still come
    decision = leave(min_workers=2, waited_s=10.0)
    assert decision.now and "replace_timeout_s=10" in decision.reason
    decision = leave(min_workers=2, seconds_left=LEAVE_MARGIN_S + 0.5)  # not before the deadline allows
    assert decision.now and "deadline" in decision.reason
    assert leave(min_workers=2, seconds_left=-5.0).now  # past its deadline, the node still runs: go now


def test_below_min_workers_training_goes_on_until_the_node_is_gone():
    decision = leave(min_workers=3, waited_s=100.0, seconds_left=1.0)
    assert not decision.now and "min_workers=3" in decision.reason


def test_the_state_comes_from_a_worker_that_stays_among_equals():
    at = {r: Status(5, 0, "framework") for r in range(3)}
    assert choose_source(at) == 0 and choose_source(at, avoid=[0]) == 1
    ahead = {**at, 0: Status(6, 0, "framework")}
    assert choose_source(ahead, avoid=[0]) == 0  # further ahead wins: its state is newer


# ---------------------------------------------------------------------- the controller

NODES = [Node("10.0.0.1", node_id="n1", pid=1), Node("10.0.0.2", node_id="n2", pid=2)]


class DrainedGroup:
    """Two workers; node n2 is drained after the first poll; its worker's replacement is up
    at the second look."""

    def __init__(self, polls, ready_after=1, deadline=None):
        self.polls, self.calls = list(polls), []
        self.looks = 0
        self.ready_after = ready_after
        self.deadline = deadline or time.time() + 60

    def start(self):
        return NODES

    def check_storage(self, nodes):
        return None

    def setup(self, resume=None):
        from raytrainer.contract import Formed
        return Formed(NODES, total_steps=4)

    def launch(self):
        self.calls.append(("launch",))

    def poll(self, timeout):
        return self.polls.pop(0)

    def draining(self):
        return {"n2": self.deadline, "elsewhere": None} if self.looks else {}  # from the second look

    def replacements(self, ranks):
        self.calls.append(("replacements", tuple(ranks)))
        self.looks += 1
        return list(ranks) if ranks and self.looks > self.ready_after else []

    def pause(self):
        self.calls.append(("pause",))

    def reform(self, plan):
        assert plan.state_from == "survivor" and not plan.regrow
        self.calls.append(("reform", plan.dead, plan.leave))
        return Reformed(step=2, nodes=[NODES[0], Node("10.0.0.3", node_id="n3", pid=3)], source=0, moved=[1])

    def shutdown(self, keep=False):
        self.calls.append(("shutdown",))
        self.kept = keep


def rows(*steps):
    return [{"step": s, "epoch": 0, "world_size": 2, "time": 0.0, "loss": 1.0} for s in steps]


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_drained_node_is_left_at_a_pause_for_replacements_with_no_failure(tmp_path):
    paused = RunEnd("paused", 2, time=time.time())
    done = RunEnd("finished", 4, stop_reason="completed", model_uri="w")
    group = DrainedGroup([Poll(rows(1)), Poll(rows(2)), Poll([]), Poll(paused={0: paused}),
                          Poll(paused={1: paused}), Poll(rows(3, 4), done=True, result=done)])
    events = EventLog(tmp_path / "events.jsonl")
    controller = Controller(group, ControllerSettings(min_workers=2, poll_interval_s=0, drain_check_s=0),
                            Records(hub=MetricsHub([JsonlWriter(tmp_path / "m.jsonl")]), events=events))
    assert controller.run() == done
    events.close()
    calls = [c for c in group.calls if c[0] in ("replacements", "pause", "reform")]
    # Asked for rank 1's replacement until it was up, then paused once, re-formed without it.
    assert calls[-3:] == [("replacements", (1,)), ("pause",), ("reform", (), (1,))]
    log = read(tmp_path / "events.jsonl")
    names = [e["event"] for e in log]
    assert names.count("node_draining") == 1 and "worker_failed" not in names and "recovered" not in names
    assert "resized" not in names  # the same world size: rank 1 moved
    noticed = next(e for e in log if e["event"] == "node_draining")
    assert noticed["node_id"] == "n2" and noticed["ranks"] == [1] and noticed["node"] == "10.0.0.2"
    left = next(e for e in log if e["event"] == "left_node")
    assert (left["node_id"], left["ranks"], left["moved"], left["dropped"], left["steps_lost"]) == \
        ("n2", [1], [1], [], 0)
    assert left["deadline"] == group.deadline and 0 < left["seconds_to_deadline"] <= 60
    assert controller.world == 2 and controller.formation.nodes[1].node_id == "n3"


def test_an_elastic_run_without_room_leaves_the_node_and_shrinks(tmp_path):
    paused = RunEnd("paused", 2, time=time.time())
    done = RunEnd("finished", 4, stop_reason="completed", model_uri="w")

    class NoRoom(DrainedGroup):
        def reform(self, plan):
            self.calls.append(("reform", plan.dead, plan.leave))
            return Reformed(step=2, nodes=[NODES[0]], source=0, dropped=[1])

        def joinable(self):
            return 0

    group = NoRoom([Poll(rows(1)), Poll(rows(2)), Poll([]), Poll(paused={0: paused}),
                    Poll(paused={1: paused}), Poll(rows(3, 4), done=True, result=done)], ready_after=99)
    events = EventLog(tmp_path / "events.jsonl")
    settings = ControllerSettings(min_workers=1, max_workers=2, poll_interval_s=0, drain_check_s=0, grow_check_s=99,
                                  replace_timeout_s=0)
    controller = Controller(group, settings, Records(hub=MetricsHub([JsonlWriter(tmp_path / "m.jsonl")]),
                                                     events=events))
    controller.run()
    events.close()
    log = read(tmp_path / "events.jsonl")
    resized = next(e for e in log if e["event"] == "resized")
    assert (resized["old_world_size"], resized["new_world_size"], resized["cause"]) == (2, 1, "preemption")
    left = next(e for e in log if e["event"] == "left_node")
    assert left["dropped"] == [1] and "replace_timeout_s=0" in left["reason"]


# ---------------------------------------------------------------------- a real drain


STEPS = 60


def config(tmp_path, name, slow_while=None, sleep_s=0.3, **scaling):
    # No dropout: its masks are drawn per rank, so a run that shrinks would not end near
    # the undisturbed one (that the streams survive a re-form is test_node_loss's check).
    args = {"dropout": 0.0, "sleep_s": sleep_s, "slow_while": slow_while}
    return {
        "task": {"target": "tests.tasks:ElasticTask", "args": args},
        "trainer": {"max_steps": STEPS, "global_batch_size": 48, "log_every_n_steps": 1},
        "scaling": {"num_workers": 3, **scaling},
        # No failure allowed: leaving a drained node must not count as one.
        "failure": {"step_timeout_s": 20, "max_failures": 0},
        "run": {"name": name, "storage": str(tmp_path)},
    }


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    from .conftest import cluster_with

    return cluster_with(shared_cluster, 3)  # a head with no CPUs for workers, three 1-CPU nodes


@pytest.fixture(scope="module")
def base(cluster, tmp_path_factory):
    """An undisturbed 3-worker run."""
    from .faults import Run

    return Run(config(tmp_path_factory.mktemp("base"), "base")).result()


def drain_rank_1(cluster, run, add_node=False, ahead_s=30.0):
    """Drain the node of rank 1, `ahead_s` ahead (after adding a node, if asked); wait for its
    workers to leave, which they must by the deadline; return the node, the deadline and the
    `left_node` event."""
    import ray
    from ray.core.generated import autoscaler_pb2

    run.wait_for_step(3)
    raylets = {node.all_processes["raylet"][0].process.pid: node for node in cluster.worker_nodes}
    drained = raylets[parent(run.pids()[1])]
    if add_node:
        cluster.add_node(num_cpus=1)  # room for its replacement
    deadline = time.time() + ahead_s
    accepted, why = ray._private.worker.global_worker.gcs_client.drain_node(
        drained.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        "spot instance reclaimed (test)", int(deadline * 1000))
    assert accepted, why
    t0 = time.monotonic()
    while not (left := [e for e in run.events() if e["event"] == "left_node"]):
        assert time.monotonic() - t0 < ahead_s + 5, f"the workers did not leave the drained node: {run.events()}"
        time.sleep(0.2)
    raylet = drained.all_processes["raylet"][0].process.pid
    assert not [pid for pid in left[0]["pids"] if parent(pid) == raylet], "a worker is still on the drained node"
    return drained, deadline, left[0]


def wait_node_gone(node_id):
    """Our slots there released (the run ended), the drained node is idle: Ray ends it."""
    import ray

    t0 = time.monotonic()
    while any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
        assert time.monotonic() - t0 < 20, "the drained node did not exit once idle"
        time.sleep(0.5)


def test_a_node_drained_for_preemption_is_left_before_its_deadline(cluster, base, tmp_path):
    from .conftest import assert_no_leaks
    from .faults import Run

    slow = tmp_path / "slow"  # the run goes slowly while it exists
    slow.touch()
    # The replacement starts on a node added now: at a load of 15 that took longer than the
    # rest of a run paced for a quiet machine, which then ended before the leave. The notice
    # and the pace follow the machine: the run outlasts the deadline, whatever its load.
    ahead = patience(30)
    run = Run(config(tmp_path, "drained", str(slow), sleep_s=ahead / 40))
    drained, deadline, left = drain_rank_1(cluster, run, add_node=True, ahead_s=ahead)
    # The moved worker's slot is given back at once: a bundle kept reserved on the drained node
    # goes RESCHEDULING once it is gone, and Ray's GCS spins on it while the cluster has no
    # room (the survivors then trained at 0.44 steps/s instead of 11).
    from ray.util import placement_group_table

    def ours_on_drained():
        return [p for p in placement_group_table().values() if p["state"] != "REMOVED"
                and drained.node_id in p["bundles_to_node_id"].values()]

    t0 = time.monotonic()
    while (kept := ours_on_drained()) and time.monotonic() - t0 < 10:
        time.sleep(0.2)
    assert kept == [], f"placement groups still reserved on the drained node: {kept}"
    slow.unlink()
    result = run.result()

    # Left before the deadline, with a replacement elsewhere: the same world size, no failure,
    # nothing lost, every step once, and the weights of the undisturbed run, bit for bit.
    assert (left["node_id"], left["ranks"], left["moved"], left["dropped"]) == (drained.node_id, [1], [1], [])
    assert left["seconds_to_deadline"] > 0 and left["deadline"] == pytest.approx(deadline, abs=0.01)
    names = [e["event"] for e in result.events]
    assert "node_draining" in names and not {"worker_failed", "recovered", "resized"} & set(names)
    steps = [r["step"] for r in result.history if "loss" in r]
    assert steps == list(range(1, STEPS + 1)) and {r["world_size"] for r in result.history} == {3}
    a, b = (torch.load(r.run_dir / "model.pt", weights_only=True) for r in (base, result))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert_no_leaks()
    wait_node_gone(drained.node_id)


def test_an_elastic_run_with_no_room_elsewhere_leaves_the_drained_node_and_shrinks(cluster, base, tmp_path):
    """Three nodes, three workers (min 2): no room for a replacement, so after
    replace_timeout_s the group goes on without the drained node's worker."""
    from .conftest import assert_no_leaks
    from .faults import Run

    slow = tmp_path / "slow"
    slow.touch()
    run = Run(config(tmp_path, "shrunk", str(slow), min_workers=2, max_workers=3, replace_timeout_s=2))
    # It starts with the workers placed within a second and grows to the rest: on a loaded
    # machine the third may join only at a grow. Drain once all three train.
    run.wait_for(lambda: any(r.get("world_size") == 3 for r in run.rows()), "the run never reached 3 workers")
    drained, _, left = drain_rank_1(cluster, run)
    slow.unlink()
    result = run.result()

    assert (left["ranks"], left["moved"], left["dropped"]) == ([1], [], [1]) and left["seconds_to_deadline"] > 0
    assert "replace_timeout_s=2" in left["reason"]
    resized = [e for e in result.events if e["event"] == "resized"]
    sizes_seen = [(e["old_world_size"], e["new_world_size"], e["cause"]) for e in resized]
    assert sizes_seen[-1] == (3, 2, "preemption") and all(c == "room to grow" for *_, c in sizes_seen[:-1])
    assert not {"worker_failed", "recovered"} & {e["event"] for e in result.events}
    train = [r for r in result.history if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    sizes = [r["world_size"] for r in train]
    after = sizes[sizes.index(3):]  # from the first step at 3 workers: 3, then 2 once it left
    assert after == sorted(after, reverse=True) and set(after) == {3, 2}
    # The same maths at 3 and 2 workers: the undisturbed run's weights up to float rounding.
    a, b = (torch.load(r.run_dir / "model.pt", weights_only=True) for r in (base, result))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)
    assert_no_leaks()
    wait_node_gone(drained.node_id)
