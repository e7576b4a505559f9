"""What raytrainer's step costs beyond raw DDP's, in CPU, with nothing else in the way.

    python -m raytrainer.bench.step_cpu [--workers 2] [--chunk 100] [--rounds 30]

`--workers` local processes form a Gloo group (no Ray). Each builds the bench's MLP twice:
wrapped in plain DistributedDataParallel with the raw loop of bench/raw.py's contender, and
as raytrainer's Loop (DDP strategy, every step's metrics reported, the defaults otherwise:
the non-finite check, the per-step seeds, the carried metrics). They then alternate, in the
same processes, `--chunk` steps of one and `--chunk` of the other, `--rounds` times, and
read each chunk's CPU time (time.process_time, summed over the ranks). The figure is the
median over the rounds of (Loop chunk / raw chunk), with its quartiles: alternating in
chunks a fraction of a second long, what the machine's load does to one does it to the
other, so the ratio holds where steps/s and CPU seconds of separate runs swing by a third
between runs on a shared VM. The steps themselves are the same: the same samples in the
same order (BatchPlan), one micro-batch per rank.

What it leaves out, by design: Ray (the actor's threads, the driver's polls: the train
scenario's CPU table has those), loaders, checkpoints.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, spec: dict[str, Any], chunk: int, rounds: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from ..config import TrainerConfig
    from ..worker.loop.loop import Loop
    from ..worker.loop.settings import LoopSettings, Outlets
    from .job import BenchTask, build_mlp, make_data, make_optimizer, rank_batch, sgd_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(spec["seed"])
    model = torch.nn.parallel.DistributedDataParallel(build_mlp(spec))
    optimizer = make_optimizer(model)
    x, y = make_data(spec)
    cfg = TrainerConfig(global_batch_size=spec["global_batch_size"], max_steps=10**9, log_every_n_steps=1,
                        val_every_n_steps=None, seed=spec["seed"])
    rows: list[dict[str, Any]] = []
    loop = Loop(BenchTask(**spec), LoopSettings(trainer=cfg), Outlets(report=rows.extend), rank=rank,
                world_size=world, device=torch.device("cpu"))
    step = 0

    def raw() -> float:
        nonlocal step
        start = time.process_time()
        for _ in range(chunk):
            xb, yb = rank_batch(spec, x, y, step, rank, world)
            sgd_step(model, optimizer, xb, yb).item()  # the loss to the host, as a logging loop does
            step += 1
        return time.process_time() - start

    def ours() -> float:
        start = time.process_time()
        for _ in range(chunk):
            if loop.after_pending:  # what Loop.fit does between steps: the flush, the epoch's end
                loop.after_step()
            loop.train_step()
        rows.clear()
        return time.process_time() - start

    raw(), ours()  # warm: the first steps build DDP's buckets, the optimizer's state
    measured = []
    for _ in range(rounds):
        both = torch.tensor([raw(), ours()], dtype=torch.float64)
        dist.all_reduce(both)
        measured.append(both.tolist())
    if rank == 0:
        out.put(measured)
    dist.destroy_process_group()


def measure(workers: int = 2, chunk: int = 100, rounds: int = 30, hidden: int = 256, layers: int = 2,
            global_batch_size: int = 64, samples: int = 4096) -> dict[str, Any]:
    """Run the ranks (spawned processes) and return the figures (see the module's text)."""
    import torch.multiprocessing as mp

    spec = dict(in_dim=32, hidden=hidden, layers=layers, seed=0, samples=samples,
                global_batch_size=global_batch_size)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, workers, port, spec, chunk, rounds, out)) for r in range(workers)]
    for p in procs:
        p.start()
    try:
        measured = out.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    ratios = [ours / raw for raw, ours in measured]
    per_step = 1e3 / (chunk * workers)  # CPU seconds of a chunk, all ranks -> ms per step per rank
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else (ratios[0], None, ratios[0])
    return {"workers": workers, "chunk": chunk, "rounds": rounds, "spec": spec,
            "raw_ms": statistics.median(raw for raw, _ in measured) * per_step,
            "raytrainer_ms": statistics.median(ours for _, ours in measured) * per_step,
            "ratio": statistics.median(ratios), "ratio_q1": q1, "ratio_q3": q3,
            "ratio_min": min(ratios), "ratio_max": max(ratios)}


def format_figures(f: dict[str, Any]) -> str:
    return "\n".join([
        f"CPU per step and rank, {f['workers']} Gloo ranks, MLP hidden {f['spec']['hidden']} x {f['spec']['layers']}, "
        f"global batch {f['spec']['global_batch_size']}; {f['rounds']} rounds of {f['chunk']} steps each, alternated:",
        "| raw DDP (ms) | raytrainer's Loop (ms) | Loop / raw: median (q1-q3; min-max) |",
        "|---|---|---|",
        f"| {f['raw_ms']:.3f} | {f['raytrainer_ms']:.3f} | {f['ratio']:.3f} ({f['ratio_q1']:.3f}-{f['ratio_q3']:.3f}; "
        f"{f['ratio_min']:.3f}-{f['ratio_max']:.3f}) |",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raytrainer.bench.step_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=100, help="steps of one kind before switching")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=64)
    args = parser.parse_args(argv)
    figures = measure(args.workers, args.chunk, args.rounds, args.hidden, args.layers, args.global_batch_size)
    print(format_figures(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
