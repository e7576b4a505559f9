import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Workers import tasks by path (tests.tasks:..., examples....): run from the repo root.
os.chdir(ROOT)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray per test module (it takes seconds to start). address="local": always a
    new one, never a Ray that another process on this machine started (a plain ray.init()
    would join a live `ray start` or cluster_utils head it finds in /tmp/ray)."""
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


def assert_no_leaks(timeout_s=10.0):
    """No actor and no placement group left alive (ray.kill is asynchronous: wait a bit)."""
    import time

    from ray._private import state
    from ray.util import placement_group_table

    deadline = time.monotonic() + timeout_s
    while True:
        alive = state.actors(actor_state_name="ALIVE")
        pgs = [p for p in placement_group_table().values() if p["state"] != "REMOVED"]
        if not alive and not pgs:
            return
        assert time.monotonic() < deadline, f"left behind: actors {list(alive)}, placement groups {pgs}"
        time.sleep(0.2)
