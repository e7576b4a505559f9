import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Workers import tasks by path (tests.tasks:..., examples....): run from the repo root.
os.chdir(ROOT)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# A run that starts a local Ray stops it at its end (by default a first run leaves it up for
# the next ones: driver/localray.py): no Ray outlives the test that started it, and none is
# joined by a later test. tests/test_localray.py turns keeping on where it tests it.
os.environ.setdefault("RAYTRAINER_KEEP_RAY", "0")


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
        # Ray Data starts cluster-wide service actors (its stats and autoscaling actors),
        # detached, once per cluster; raytrainer never makes a detached actor.
        alive = {k: a["ActorClassName"] for k, a in state.actors(actor_state_name="ALIVE").items()
                 if not a["IsDetached"]}
        pgs = [p for p in placement_group_table().values() if p["state"] != "REMOVED"]
        if not alive and not pgs:
            return
        assert time.monotonic() < deadline, f"left behind: actors {alive}, placement groups {pgs}"
        time.sleep(0.2)


def loader_processes() -> list[str]:
    """Live loader processes and fork servers started by this checkout's raytrainer, in
    this process or in Ray workers: their command line names raytrainer.worker.input (the fork
    server's preload list, which the loader processes it forks inherit) and this checkout.
    This process's own fork server, which multiprocessing keeps for the process's life,
    is not counted; the loader processes it forked are."""
    from .ray_procs import live_processes

    return [f"{pid} (parent {ppid}): {cmdline[:80]!r}" for pid, ppid, cmdline in live_processes()
            if b"raytrainer.worker.input" in cmdline and ROOT.encode() in cmdline and ppid != os.getpid()]


def assert_no_loader_processes(timeout_s=10.0):
    import time

    deadline = time.monotonic() + timeout_s
    while (left := loader_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"loader processes left running: {left}"
