import atexit
import contextlib
import os
import shutil
import sys
import tempfile
import uuid

import pytest

from .ray_procs import SESSION_TAG
from .waits import Deadline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Workers import tasks by path (tests.tasks:..., examples....): run from the repo root.
os.chdir(ROOT)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# A run that starts a local Ray stops it at its end (by default a first run leaves it up for
# the next ones: driver/localray.py): no Ray outlives the test that started it, and none is
# joined by a later test. tests/test_localray.py turns keeping on where it tests it.
os.environ.setdefault("RAYTRAINER_KEEP_RAY", "0")


def pytest_configure(config):
    """This session's Rays apart from any other's on the machine (pytest-xdist runs two
    sessions side by side; `-n 2` in the README's command): a cluster_utils head records its
    address in $RAY_TMPDIR/ray/ray_current_cluster, which a run given no address would join
    (as it joins a `ray start`). Every process the session starts inherits both variables;
    SESSION_TAG tells its processes from the other session's (ray_procs.live_processes).
    In this hook, not at import: a Ray worker that imports a test module (a task defined
    there) imports this one too, and would make a folder no one removes (it is killed, its
    exit handlers never run) and give its loader processes another session's tag."""
    session_tmp = tempfile.mkdtemp(prefix=f"rt{os.environ.get('PYTEST_XDIST_WORKER', '')}-", dir="/tmp")
    os.makedirs(os.path.join(session_tmp, "ray"))
    os.environ["RAY_TMPDIR"] = session_tmp
    os.environ[SESSION_TAG] = uuid.uuid4().hex
    atexit.register(shutil.rmtree, session_tmp, True)  # after Ray's own exit handlers (registered later)



# ---------------------------------------------------------------------------- Ray, shared
#
# Starting a Ray takes 5-10 s on a loaded 2-core VM, a multi-node cluster_utils cluster
# more: the modules share one local Ray and one cluster instead of starting their own.
# This process is connected to one of them at a time; the modules are ordered (see
# pytest_collection_modifyitems) so that those using the local Ray run together, then those
# using the cluster. Every test leaves them as it found them (assert_no_leaks).

_connected: dict[str, object] = {"to": None}  # "local", a cluster's address, or None

# Modules whose tests start their own Ray (or a job server, or whole contender processes)
# in subprocesses: last (they mark their slow tests themselves).
SUBPROCESS_MODULES = ("test_bench.py", "test_job_submit.py", "test_slurm.py")
SHARED_RAY = {"ray_local": 1, "shared_cluster": 2}  # fixture -> its place in the run order


def _connect(to: str, **options) -> None:
    import ray

    if _connected["to"] == to and ray.is_initialized():
        return
    if ray.is_initialized():
        ray.shutdown()  # a local Ray this process started stops; a cluster is only left
    _connected["to"] = None
    from raytrainer.driver._internals import patient_node_start
    from raytrainer.driver.localray import settings

    # The local Ray as raytrainer starts one by default (RAY_SETTINGS: its workers at nice 0,
    # no task events or metrics kept; its node's start not failed after Ray's fixed 30 s); a
    # cluster runs as a user's `ray start` does.
    with settings() if to == "local" else contextlib.nullcontext(), patient_node_start():
        ray.init(address=to, logging_level="WARNING", **options)
    _connected["to"] = to


@pytest.fixture(scope="session", autouse=True)
def _disconnect_at_the_end():
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray with 4 CPUs, shared by the modules that use it. address="local": always
    one this process starts, never a Ray that another process on this machine started (a
    plain ray.init() would join a live `ray start` or cluster_utils head it finds in /tmp/ray)."""
    import ray

    _connect("local", num_cpus=4, include_dashboard=False)
    yield ray


@pytest.fixture(scope="session")
def shared_cluster():
    """A multi-node Ray on this machine (ray_procs.local_cluster: a head with no CPUs for
    workers, in its own temp dir), shared by the modules that need nodes: each asks for its
    worker nodes with `cluster_with`."""
    from .ray_procs import local_cluster

    import ray

    if ray.is_initialized():
        ray.shutdown()
    _connected["to"] = None
    with local_cluster(0) as cluster:
        _connected["to"] = cluster.address
        yield cluster
        _connected["to"] = None


def cluster_with(cluster, nodes: int):
    """`cluster` connected here, with `nodes` fresh 1-CPU worker nodes and no other (the
    nodes an earlier module added, removed, drained or left are all removed first)."""
    _connect(cluster.address)
    for node in list(cluster.worker_nodes):
        cluster.remove_node(node)
    for _ in range(nodes):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    return cluster


def _order(item) -> int:
    if item.path.name == "test_bench.py" and os.environ.get("PYTEST_XDIST_WORKER"):
        # Beside another session (-n 2) the bench, the longest module by far (10 to 11
        # minutes of test time, 2026-11-27), goes first and the other session's modules fill
        # the time around it. Measured no faster than last (11 min 16 s against 11 min 14 s),
        # but the run's end never waits on it alone, however long it grows.
        return -1
    if item.path.name in SUBPROCESS_MODULES:
        return 3
    return max((SHARED_RAY.get(f, 0) for f in item.fixturenames), default=0)


def pytest_collection_modifyitems(config, items):
    """Tests without Ray first, then the modules on the shared local Ray, then those on the
    shared cluster, then those that start Ray in subprocesses; a module's tests stay
    together and in order. A test that needs a Ray, a cluster or a subprocess that trains is
    marked slow: `-m "not slow"` is the quick lane (README)."""
    by_module: dict = {}
    for item in items:
        by_module[item.path] = max(by_module.get(item.path, 0), _order(item))
        if any(f in SHARED_RAY for f in item.fixturenames):
            item.add_marker(pytest.mark.slow)  # the subprocess modules mark their own
    items.sort(key=lambda item: by_module[item.path])  # stable: a module's order is kept


def assert_no_leaks(timeout_s=10.0):
    """No actor and no placement group left alive (ray.kill is asynchronous: wait a bit),
    but the worker processes a finished run kept for the next (driver/group/kept.py)."""
    import time

    from ray._private import state
    from ray.util import placement_group_table

    deadline = Deadline(timeout_s)
    while True:
        # Ray Data starts cluster-wide service actors (its stats and autoscaling actors),
        # detached, once per cluster; raytrainer's workers are detached too (they outlive a
        # lost driver: failure.driver_grace_s), and named raytrainer-...
        keeping = kept_actor_ids()
        alive = {k: a["ActorClassName"] for k, a in state.actors(actor_state_name="ALIVE").items()
                 if (not a["IsDetached"] or a["Name"].startswith("raytrainer-")) and k not in keeping}
        pgs = [p for p in placement_group_table().values() if p["state"] != "REMOVED"]
        if not alive and not pgs:
            return
        assert not deadline.passed(), f"left behind: actors {alive}, placement groups {pgs}"
        time.sleep(0.2)


def loader_processes() -> list[str]:
    """Live loader processes and fork servers started by this checkout's raytrainer, in
    this process or in Ray workers: their command line names raytrainer.worker.input.input (the fork
    server's preload list, which the loader processes it forks inherit) and this checkout.
    This process's own fork server, which multiprocessing keeps for the process's life,
    is not counted; the loader processes it forked are."""
    from .ray_procs import live_processes

    kept = kept_worker_pids()
    return [f"{pid} (parent {ppid}): {cmdline[:80]!r}" for pid, ppid, cmdline in live_processes(ours_only=True)
            if b"raytrainer.worker.input.input" in cmdline and ROOT.encode() in cmdline and ppid != os.getpid()
            and not (ppid in kept and b"multiprocessing.forkserver import main" in cmdline)]


def kept_worker_pids() -> set[int]:
    """The processes of the workers a finished run kept for the next (driver/group/kept.py):
    the fork server each keeps, as this process keeps its own, is not a leak."""
    import ray

    ids = kept_actor_ids()
    if not ray.is_initialized() or not ids:
        return set()
    from ray._private import state

    return {a["Pid"] for k, a in state.actors(actor_state_name="ALIVE").items() if k in ids}


def kept_actor_ids() -> set[str]:
    """The actor ids of the worker processes kept for the next run (driver/group/kept.py)."""
    from raytrainer.driver.group import kept

    return {a._actor_id.hex() for a in kept.kept_actors()}


def assert_no_loader_processes(timeout_s=10.0):
    import time

    deadline = Deadline(timeout_s)
    while (left := loader_processes()) and not deadline.passed():
        time.sleep(0.2)
    assert not left, f"loader processes left running: {left}"


# ---------------------------------------------------------------------------- no healthy worker hung
#
# A worker killed as hung that was only slow is the product's fault, not the machine's
# (tests/waits.py, docs/slow-day.md): every run a test makes is checked for `hung` failures
# in its events.jsonl, and a test whose workers are frozen or stalled on purpose says so
# with @pytest.mark.hangs.

_events_checked: dict[str, int] = {}  # events.jsonl -> lines already checked
_events_scanned_at = [0.0]


def unexpected_hangs(root) -> list[str]:
    """The `hung` worker failures written under `root` since the last call."""
    import json
    import time
    from pathlib import Path

    since, _events_scanned_at[0] = _events_scanned_at[0], time.time()
    found = []
    for path in Path(root).rglob("events.jsonl"):
        try:
            if path.stat().st_mtime < since - 2.0:
                continue
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines[_events_checked.get(str(path), 0):]:
            try:
                event = json.loads(line)
            except ValueError:  # a line being written: read again next time
                break
            _events_checked[str(path)] = _events_checked.get(str(path), 0) + 1
            if event.get("event") == "worker_failed" and event.get("kind") == "hung":
                found.append(f"{path.parent.name}: rank {event.get('rank')} at step {event.get('step')}: "
                             f"{event.get('cause', '')[:300]}")
    return found


@pytest.fixture(autouse=True)
def _no_healthy_worker_hung(request, tmp_path_factory):
    yield
    hung = unexpected_hangs(tmp_path_factory.getbasetemp())
    if hung and request.node.get_closest_marker("hangs") is None:
        pytest.fail("a worker was taken for hung in a test that hangs none (mark it @pytest.mark.hangs if "
                    "it freezes or stalls one on purpose):\n" + "\n".join(hung), pytrace=False)
