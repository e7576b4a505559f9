"""Raw torch DDP (or FSDP2, with --strategy fsdp), the floor: `torch.multiprocessing`
spawns the ranks, a Gloo group (its rendezvous a file in the run's work directory: a
port picked ahead could be taken by another run meanwhile), a plain loop; rank 0 puts every step's loss on
a queue the driver reads."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

from .job import (SlowSamples, batch_plan, build_mlp, make_data, make_optimizer, rank_batch, sgd_step, thread_snapshot,
                  threads_at)
from .spec import BenchError


def run_raw(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    import queue

    import torch.multiprocessing as mp

    phases = {"torch_imported": time.time()}
    ctx = mp.get_context("spawn")
    metrics = ctx.Queue()
    store = work / "rendezvous"
    store.unlink(missing_ok=True)
    procs = mp.start_processes(_raw_worker, args=(spec, str(store), metrics), nprocs=spec["workers"],
                               join=False, start_method="spawn")
    phases["workers_spawned"] = time.time()
    rows, done, snapshot = [], False, None
    try:
        # The driver reads every step's loss as it arrives, as a real launcher's logger would.
        while not done:
            try:
                item = metrics.get(timeout=0.2)
            except queue.Empty:
                if procs.join(timeout=0):  # all exited without saying done: cannot happen unless killed
                    break
                continue
            if item[0] == "step":
                rows.append(item[1:])
            elif item[0] == "phase":
                phases[item[1]] = item[2]
            elif item[0] == "threads":
                snapshot = item[1]
            else:
                done = True
        try:
            while not procs.join(timeout=1):
                pass
        except mp.ProcessExitedException:
            # Rank 0 says done only after the last step's collectives, so every rank trained
            # every step; a rank that then dies tearing its Gloo group down (seen once in CI:
            # "terminate called without an active exception", SIGABRT) changes no figure.
            if not done:
                raise
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
                p.join()
    if not done:
        raise BenchError(f"raw {spec.get('strategy', 'ddp').upper()} workers exited before finishing")
    return {"step_times": [t for _, _, t in rows], "last_loss": rows[-1][1], "phases": phases,
            "worker_pids": list(procs.pids()),
            "threads": phases.pop("threads", None), "worker_threads": snapshot, "contender_settings": settings(spec)}


def settings(spec: dict[str, Any]) -> dict[str, Any]:
    """What raw DDP (FSDP2) runs with, for the report."""
    return {"launcher": "torch.multiprocessing.start_processes, spawn", "backend": "gloo",
            "strategy": "FSDP2 (fully_shard on each Linear and the root)" if spec.get("strategy") == "fsdp"
            else "DistributedDataParallel", "torch.set_num_threads": 1,
            "metrics": "rank 0's loss.item() on a multiprocessing queue to the launcher every step, not reduced"}


def _raw_worker(rank: int, spec: dict[str, Any], store: str, metrics) -> None:
    import torch
    import torch.distributed as dist

    world = spec["workers"]
    torch.set_num_threads(1)  # as Ray does for a 1-CPU actor (OMP_NUM_THREADS=1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        if rank == 0:
            metrics.put(("phase", "group_formed", time.time()))
            metrics.put(("phase", "threads", torch.get_num_threads()))
        torch.manual_seed(spec["seed"])
        model = _wrap(build_mlp(spec), spec.get("strategy", "ddp"), world)
        optimizer = make_optimizer(model)
        for step, (xb, yb) in zip(range(spec["steps"]), _raw_batches(spec, rank, world)):
            loss = sgd_step(model, optimizer, xb, yb)
            if rank == 0:
                value = loss.item()
                metrics.put(("step", step + 1, value, time.time()))
                if step + 1 == threads_at(spec["steps"]):
                    metrics.put(("threads", thread_snapshot()))
        if rank == 0:
            metrics.put(("done",))
        dist.barrier()  # no rank tears the group down while another still uses it
    finally:
        dist.destroy_process_group()


def _wrap(model, strategy: str, world: int):
    """DDP; or FSDP2 as raytrainer's sharded.shard_model does it: fully_shard on each child
    that holds parameters (the Linears), then on the root."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    if strategy == "ddp":
        return DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _raw_batches(spec: dict[str, Any], rank: int, world: int):
    """This rank's batches, step after step: sliced from the tensors, or in the input
    scenario read by DataLoader(num_workers=k) processes (torch's default start method)
    with the BatchPlan's index lists as the batch_sampler."""
    if spec.get("scenario") != "input":
        x, y = make_data(spec)
        return (rank_batch(spec, x, y, step, rank, world) for step in itertools.count())
    from torch.utils.data import DataLoader

    from ..worker.input.input import PlanSampler

    sampler = PlanSampler(batch_plan(spec, world), rank)
    return iter(DataLoader(SlowSamples(spec), batch_sampler=sampler, num_workers=spec["input_workers"]))


def input_raw(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    return run_raw({**spec, "steps": spec["input_steps"]}, work)
