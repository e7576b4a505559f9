"""A run whose workers span two Ray nodes (two raylets on this machine): the
shared-storage check runs on every worker and passes, since both nodes see /tmp."""

import json

import pytest

import raytrainer

from .conftest import assert_no_leaks
from .ray_procs import short_temp_dir, wait_gone


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    # Like a cloud cluster: a head with no CPUs for workers, two 1-CPU worker nodes.
    # Its own temp dir: in the default /tmp/ray, any other process's plain
    # ray.init() on this machine would find and join this cluster.
    temp_dir = short_temp_dir()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "temp_dir": temp_dir})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING")
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    assert wait_gone(temp_dir) == []


def test_workers_on_two_nodes_check_the_storage_and_train(two_nodes, tmp_path):
    cfg = {
        "task": {"target": "tests.tasks:RegressionTask", "args": {}},
        "trainer": {"max_steps": 4, "global_batch_size": 32},
        "scaling": {"num_workers": 2, "placement": "STRICT_SPREAD"},
        "run": {"name": "spread", "storage": str(tmp_path)},
    }
    result = raytrainer.train(cfg, progress=False)
    events = [json.loads(line) for line in (tmp_path / "spread" / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["run_started", "storage_checked", "group_formed",
                                                  "checkpoint_committed", "finished"]
    assert events[1]["nodes"] == 2 and events[1]["workers"] == 2
    assert result.metrics["step"] == 4
    assert not list((tmp_path / "spread").glob(".raytrainer-storage-check-*"))
    assert_no_leaks()
