"""trainer.compile: torch.compile the model the step calls, and share what compiling made
with the run's other workers.

The model is compiled after the strategy wraps it (DDP, or FSDP2's fully_shard in place),
as torch recommends: compiling the DDP wrapper lets dynamo split the graph at DDP's bucket
boundaries, so gradient all-reduces still overlap the backward. A re-formed group wraps the
same module in a new DDP: dynamo's compiled code lives on the module's forward and its
guards do not look at the process group, so a survivor runs on without compiling again
(tests/test_compile.py checks it through dynamo's own graph count, `compiled_graphs`).

A replacement, a newcomer of a grow or a warm spare compiles in a new process. Inductor
keeps what it compiled (its FX-graph cache and AOTAutograd's cache, both on by default) in
a directory on disk; every worker of the run on a node points it at one directory of the
node, so a new process finds the graphs its peers compiled and skips inductor's code
generation and C++ (or Triton) build, the bulk of a compile; dynamo's trace of the
Python remains. Workers on another node compile their first graph themselves and share it
from then on.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ...config import CompileConfig, Config

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def run_cache_dir(config: Config) -> Path:
    """This node's directory of the run's compiled artifacts: one per run (its storage and
    name), so that two runs' graphs never mix and a rerun of the same command, which
    continues the run, finds them."""
    key = hashlib.sha256(f"{config.run.storage}\0{config.run.name}".encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / "raytrainer-compile" / f"{config.run.name}-{key}"


def use_run_cache(config: Config) -> None:
    """Point this process's inductor caches at the run's directory, before anything compiles
    (inductor reads the variable at its first compile and keeps it). A directory the user
    set (TORCHINDUCTOR_CACHE_DIR in the workers' environment) is theirs to keep."""
    if config.trainer.compile is None or CACHE_ENV in os.environ:
        return
    os.environ[CACHE_ENV] = str(run_cache_dir(config))


def compiled(model: torch.nn.Module, options: CompileConfig | None) -> torch.nn.Module:
    """`model` compiled with trainer.compile's options; itself where compile is off.
    torch.compile is lazy: the first call compiles."""
    if options is None:
        return model
    import torch

    return torch.compile(model, mode=options.mode, backend=options.backend, dynamic=options.dynamic,
                         fullgraph=options.fullgraph)


def graph_count() -> int:
    """The graphs dynamo has captured in this process so far."""
    from .. import _internals

    return _internals.compile_counts()["compiled_graphs"]


_COUNTS = ("pid", "compiled_graphs", "new_graphs", "fx_cache_hits", "fx_cache_misses", "aot_cache_hits",
           "aot_cache_misses", "first_step_ms")


def compile_report(step: int, seconds: float, device: torch.device, world_size: int,
                   graphs_at_join: int) -> dict[str, Any]:
    """The `compiled` event after a group's first compiled step (a collective): for every
    rank, its process, the graphs dynamo has captured in it so far (a recompile adds to
    them), those captured since it joined this group (`graphs_at_join` then; 0: its first
    step compiled nothing: a survivor, or a worker that compiled ahead), how many of
    inductor's graphs came from the caches (hits) or were built (misses), and how long
    that first step took."""
    import torch
    import torch.distributed as dist

    from .. import _internals

    counts = {"pid": os.getpid(), **_internals.compile_counts(), "first_step_ms": round(seconds * 1000)}
    counts["new_graphs"] = counts["compiled_graphs"] - graphs_at_join
    mine = torch.tensor([counts[k] for k in _COUNTS], dtype=torch.int64, device=device)
    rows = [mine]
    if world_size > 1:
        rows = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(rows, mine)
    workers = [{"rank": rank, **dict(zip(_COUNTS, row.tolist()))} for rank, row in enumerate(rows)]
    return {"event": "compiled", "step": step, "workers": workers}
