"""A whole node lost with two of three workers on it (its raylet and every process on it
gone at once, as when a VM dies): one recovery, from the survivor on the other node, which
goes on at once (failure.recovery fast: no warm spare can take their places, the spare died
with the node or is on another node); their replacements are placed where the cluster has
room and join once up; the run ends within float tolerance of an undisturbed one."""

import time

import pytest
import torch

from .conftest import assert_no_leaks, cluster_with
from .faults import Run, kill
from .ray_procs import parent
from .waits import Deadline


def config(tmp_path, name, slow_while=None):
    # No dropout: the run resizes, and a rank's random stream is its own.
    args = {"dropout": 0.0, "sleep_s": 0.2, "slow_while": slow_while}
    return {
        "task": {"target": "tests.tasks:ElasticTask", "args": args},
        "trainer": {"max_steps": 400, "global_batch_size": 48, "log_every_n_steps": 1},
        "scaling": {"num_workers": 3, "placement": "PACK"},
        "failure": {"step_timeout_s": 20, "max_failures": 2},
        "run": {"name": name, "storage": str(tmp_path)},
    }


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    return cluster_with(shared_cluster, 0)  # a head with no CPUs for workers, nodes added by the tests


@pytest.mark.hangs
def test_a_node_with_two_workers_lost_is_one_recovery(cluster, tmp_path):
    two = cluster.add_node(num_cpus=2)
    one = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    base = Run(config(tmp_path, "base")).result()

    slow = tmp_path / "slow"  # the run goes slowly while it exists
    slow.touch()
    run = Run(config(tmp_path, "lost", str(slow)))
    run.wait_for_step(3)
    raylet = two.all_processes["raylet"][0].process.pid
    on_two = {rank: pid for rank, pid in enumerate(run.pids()) if parent(pid) == raylet}
    assert len(on_two) == 2, "PACK puts two of the three workers on the 2-CPU node"
    cluster.add_node(num_cpus=2)  # room for the replacements
    # The node is lost with everything on it (its worker processes would outlive their
    # raylet here for a while: they share this machine).
    cluster.remove_node(two, allow_graceful=False)
    for pid in on_two.values():
        kill(pid)
    run.wait_for_step(6)
    # Back at 3 once the replacements are up on the new node, before the run is let finish.
    deadline = Deadline(120)
    while not any(e["event"] == "resized" and e["new_world_size"] == 3 for e in run.events()):
        assert not deadline.passed(), f"the group did not grow back: {run.events()}"
        time.sleep(0.2)
    slow.unlink()
    result = run.result()

    a, b = (torch.load(r.run_dir / "model.pt", weights_only=True) for r in (base, result))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)
    failed = [e for e in result.events if e["event"] == "worker_failed"]
    recovered = [e for e in result.events if e["event"] == "recovered"]
    assert sorted(f["rank"] for f in failed) == sorted(on_two) and all(f["kind"] in ("died", "hung") for f in failed)
    assert len(recovered) == 1 and recovered[0]["dropped"] == sorted(on_two) and recovered[0]["steps_lost"] <= 1  # the step in flight
    assert recovered[0]["source_rank"] not in on_two
    resized = [(e["old_world_size"], e["new_world_size"]) for e in result.events if e["event"] == "resized"]
    assert resized[0] == (3, 1) and resized[-1][1] == 3 and [r["world_size"] for r in result.history][-1] == 3
    steps = [r["step"] for r in result.history if "loss" in r]
    # Every step once; a row being reduced as the workers died is lost with them, not the step.
    assert len(set(steps)) == len(steps) >= 399 and steps[-1] == 400
    assert_no_leaks()
