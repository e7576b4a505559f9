"""The shared-storage check at start, with a fake `sees` (no cluster): the real
multi-node runs in test_multinode.py and test_slurm.py cover the passing side."""

import pytest

from raytrainer.contract import Node
from raytrainer.errors import ConfigError
from raytrainer.driver.storage_check import check_shared_storage

NODES = [Node("10.0.0.1", node_id="aaaa1111"), Node("10.0.0.2", node_id="bbbb2222")]


def test_workers_on_the_drivers_node_are_not_asked(tmp_path):
    def sees(path):
        raise AssertionError("no worker should be asked")

    assert check_shared_storage(tmp_path, str(tmp_path), [NODES[0]] * 2, "aaaa1111", sees) is None


def test_every_worker_sees_the_marker(tmp_path):
    asked = []

    def sees(path):  # what each worker does: look for the file the driver wrote
        asked.append(path)
        return [(tmp_path / path.rsplit("/", 1)[-1]).exists()] * 2

    assert check_shared_storage(tmp_path, "runs", NODES, "aaaa1111", sees) == {"nodes": 2, "workers": 2}
    assert asked[0].startswith(str(tmp_path.resolve()) + "/.raytrainer-storage-check-")
    assert list(tmp_path.iterdir()) == []  # the marker is removed again


def test_a_worker_that_cannot_see_it_fails_the_run_naming_the_fix(tmp_path):
    with pytest.raises(ConfigError) as info:
        check_shared_storage(tmp_path, "runs", NODES, "aaaa1111", lambda path: [True, False])
    assert list(tmp_path.iterdir()) == []
    message = str(info.value)
    assert "run.storage='runs' is not shared" in message
    assert "rank 1 on 10.0.0.2" in message and "rank 0" not in message
    assert "NFS" in message and "s3://" in message
