"""Run a function on N local processes joined in a Gloo group (no Ray): for tests of
plain torch.distributed code.

Processes are forked: a spawned one imports torch again, seconds on a loaded machine
(measured: 2 ranks, 18 s spawned against 5 s forked, load 12 on 2 cores). Each child
sets one intra-op thread before any torch work, so an OpenMP pool the parent may have
used is never entered in the child."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import pickle
import queue
import traceback
from typing import Any, Callable

from .ray_procs import free_ports


def _entry(fn, rank, world_size, port, results, args, kwargs):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=60))
        # Plain pickle: a queue would pass tensors as shared-memory handles, which die with
        # this process.
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args, **kwargs))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120, **kwargs: Any) -> list[Any]:
    """fn(rank, world_size, *args, **kwargs) on every rank; the ranks' return values (they
    must pickle), by rank. A rank's exception fails the call with its traceback. The port is
    free when chosen, not always when rank 0 binds it (another session's Ray took one between
    the two in a fresh-clone run): then the ranks start again on another, at most twice."""
    for attempt in range(3):
        try:
            return _run_ranks(fn, world_size, args, kwargs, timeout_s)
        except AssertionError as exc:
            if "EADDRINUSE" not in str(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _run_ranks(fn, world_size, args, kwargs, timeout_s) -> list[Any]:
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    (port,) = free_ports(1)
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, results, args, kwargs), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors = []
    try:
        for _ in procs:
            rank, ok, value = results.get(timeout=timeout_s)
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
                break  # the others may now wait forever in a collective
    except queue.Empty:
        errors.append(f"ranks {sorted(set(range(world_size)) - set(out))} did not finish in {timeout_s} s")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world_size)]
