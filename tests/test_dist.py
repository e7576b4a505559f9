"""dist.py and the worker's start, without Ray: what forming a group and a new worker
do before they are needed, so that a recovery or a grow does not wait for it."""

import multiprocessing as mp
import socket
import subprocess
import sys
import time

import pytest
import torch

from raytrainer.worker import dist

from .ray_procs import free_ports


def new_worker(tmp_path, before: str, after: str) -> list[str]:
    """In a fresh interpreter (this one may have imported torch._dynamo already), print
    `before`, build a Worker, print `after`: the printed words."""
    config = {"task": {"target": "tests.tasks:RegressionTask"}, "trainer": {"max_steps": 1},
              "scaling": {"num_workers": 1}, "run": {"name": "r", "storage": str(tmp_path)}}
    code = ("import gc, sys; from raytrainer.worker.process.actor import Worker; "
            f"before = {before}; Worker({config!r}); print(before, {after})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_a_new_worker_has_imported_torch_dynamo_before_it_is_asked_to_join(tmp_path):
    assert new_worker(tmp_path, "'torch._dynamo' in sys.modules", "'torch._dynamo' in sys.modules") == ["False", "True"]


def test_a_worker_freezes_what_its_imports_left_to_the_garbage_collector(tmp_path):
    # ~330,000 objects of torch, dynamo and Ray, walked at each full collection: one took
    # 0.43 s in the middle of a survivor's re-forming (FSDP, 4 workers, 2-core VM). Frozen, a
    # collection walks only what the worker made after them.
    _, frozen, walked = map(int, new_worker(tmp_path, "0", "gc.get_freeze_count(), len(gc.get_objects())"))
    assert frozen > 100_000 and walked < frozen / 10, (frozen, walked)


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_an_nccl_group_forms_its_communicator_on_the_workers_device_at_once(monkeypatch, backend):
    # device_id: NCCL's communicator forms in the forming (abortable, its failure a
    # forming's) and a barrier() in your own loop knows its device. Gloo takes none. The
    # NCCL side is faked here; the GPU check forms one for real.
    seen = {}
    monkeypatch.setattr(dist.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist.dist, "TCPStore", lambda *a, **k: "store")
    monkeypatch.setattr(dist.dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dist, "_hosted", None)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        # Set, then deleted: undone at the end, the values init_group sets go too. (A delenv
        # of an unset key records nothing to undo: RANK=1, WORLD_SIZE=2 and MASTER_PORT=1 were
        # left in the session, and a later module's Hugging Face Trainer in this process
        # waited for ever on that rendezvous.)
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    dist.init_group(1, 2, "127.0.0.1", 1, backend, 60)
    assert seen["backend"] == backend and seen["store"] == "store"
    assert seen["device_id"] == (torch.device("cuda", 0) if backend == "nccl" else None)


def _rank(rank, ports, results):
    import torch

    try:
        if rank == 0:
            port = dist.host_store("127.0.0.1", 30)
            ports.put(port)
        else:
            port = ports.get(timeout=30)
        dist.init_group(rank, 2, "127.0.0.1", port, "gloo", 30)
        results.put((rank, dist.all_reduce_sum(torch.ones(1)).item()))
        dist.leave_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        if rank == 0:
            ports.put(None)  # the test stops waiting for the port
        results.put((rank, repr(exc)))


def test_rank_0_hosts_the_store_before_its_peers_are_asked_to_join():
    ctx = mp.get_context("fork")
    to_peer, port_seen, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(0, port_seen, results), daemon=True)]
    procs[0].start()
    port = port_seen.get(timeout=60)
    assert port is not None, results.get(timeout=5)
    # Listening as soon as its port is known, before rank 0 starts the group: a peer never
    # finds it missing (and never waits out a TCPStore client's retry backoff).
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    to_peer.put(port)
    procs.append(ctx.Process(target=_rank, args=(1, to_peer, results), daemon=True))
    procs[1].start()
    try:
        got = dict(results.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert got == {0: 2.0, 1: 2.0}


def test_a_rank_0_that_hosted_no_store_hosts_it_as_it_joins():
    ctx = mp.get_context("fork")
    results = ctx.Queue()

    def alone(results):
        import torch

        try:
            (port,) = free_ports(1)
            dist.init_group(0, 1, "127.0.0.1", port, "gloo", 30)
            results.put(dist.all_reduce_sum(torch.ones(1)).item())
            dist.leave_group()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results.put(repr(exc))

    p = ctx.Process(target=alone, args=(results,), daemon=True)
    p.start()
    try:
        assert results.get(timeout=60) == 1.0
    finally:
        p.join(timeout=10)


def _aborts_at(rank, world, ports, results, abort_at):
    """Sum small tensors over and over; rank 1, before its collective number `abort_at`,
    has its group aborted (the driver's call while a worker is blocked) and stops there."""
    import torch

    try:
        if rank == 0:
            port = dist.host_store("127.0.0.1", 60)
            for _ in range(world - 1):
                ports.put(port)
        else:
            port = ports.get(timeout=60)
        dist.init_group(rank, world, "127.0.0.1", port, "gloo", 60)
        tensor = torch.ones(16)
        for i in range(10**6):
            if rank == 1 and i == abort_at:
                results.put((rank, dist.abort_group()))
                time.sleep(60)  # alive and holding its group, as a stopped survivor is
            dist.all_reduce_sum(tensor)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        dist.leave_group(failed=True)  # as a worker does when a peer failed under it
        results.put((rank, str(exc)))


def test_aborting_a_gloo_group_fails_every_peer_waiting_in_a_collective_now():
    # Gloo's own abort() does not unblock a peer waiting on this process: its connections are
    # shut down instead, the peers' collectives fail, and each peer that fails closes its own
    # (dist.leave_group), so all fail at once, not at the collective timeout (60 s here):
    # rank 3 never talks to rank 1 in this ring.
    ctx = mp.get_context("fork")
    ports, results, world = ctx.Queue(), ctx.Queue(), 4
    procs = [ctx.Process(target=_aborts_at, args=(r, world, ports, results, 50), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=50) for _ in procs)
    finally:
        for p in procs:
            p.kill()
    assert got.pop(1) is True
    assert all("Connection closed" in why or "Connection reset" in why for why in got.values()), got
