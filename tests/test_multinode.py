"""A run whose workers span two Ray nodes (two raylets on this machine): the
shared-storage check runs on every worker and passes, since both nodes see /tmp."""

import json

import pytest

import raytrainer

from .conftest import assert_no_leaks, cluster_with


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    return cluster_with(shared_cluster, 2)


def test_workers_on_two_nodes_check_the_storage_and_train(cluster, tmp_path):
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
