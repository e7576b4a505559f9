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
Python remains.

Across nodes, the run directory carries them: rank 0, after a group's first compiled step
in which its process compiled graphs (built, or taken from the node's cache), writes torch's cache artifacts of all it compiled
(torch.compiler.save_cache_artifacts) to `<run dir>/compiled/torch-<version>.bin`; the
first worker of the run on a node (the node's directory not there yet) loads them into its
caches before it compiles (load_cache_artifacts), so a worker on a new node, or a rerun's
on new nodes, finds them as a peer on the node would. A finished run removes its node
directories; a failed or stopped one keeps them for its rerun.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ...config import CompileConfig, Config, RunConfig

log = logging.getLogger(__name__)

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
ARTIFACTS_DIR = "compiled"  # in the run directory
_loaded = 0  # the artifacts this process took from the run directory (load_run_artifacts)


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


def artifacts_rel(run: RunConfig) -> str:
    """The run directory's file of compiled artifacts, relative to run.storage: one per
    torch version (another version's artifacts would not load)."""
    import torch

    version = "".join(c if c.isalnum() or c in ".-" else "_" for c in torch.__version__)
    return f"{run.name}/{ARTIFACTS_DIR}/torch-{version}.bin"


def load_run_artifacts(config: Config) -> int:
    """The first worker of the run on this node (no graph in the node's run directory yet):
    what the run's workers compiled elsewhere, taken into torch's caches here before
    anything compiles. Returns how many artifacts were loaded (0: none written yet, a peer
    on this node compiled or loaded already, or compile off)."""
    global _loaded
    if config.trainer.compile is None or os.environ.get(CACHE_ENV) != str(run_cache_dir(config)):
        return 0  # off, or a cache directory the user set, whose contents are theirs
    graphs = run_cache_dir(config) / "fxgraph"  # not the directory: importing inductor makes it, empty
    if graphs.is_dir() and any(graphs.iterdir()):
        return 0
    from ...checkpoint import Storage

    try:
        data = Storage(config.run.storage).read(artifacts_rel(config.run))
    except (FileNotFoundError, OSError):
        return 0  # no worker of the run compiled yet (or storage is away: compiled here instead)
    import torch

    try:
        info = torch.compiler.load_cache_artifacts(data)
    except Exception:  # torch's own format moved under the same version string: compile here
        log.warning("the run's compiled artifacts could not be loaded; compiling here", exc_info=True)
        return 0
    _loaded = sum(len(keys) for keys in info.artifacts.values()) if info is not None else 0
    return _loaded


def share_run_artifacts(run: RunConfig) -> int:
    """torch's cache artifacts of everything this process compiled, written to the run
    directory for the workers of other nodes and a rerun (rank 0, after a group's first
    compiled step in which it compiled graphs). Returns the bytes written; 0 where there was
    nothing, or storage refused (the others then compile themselves, as without it)."""
    import torch

    from ...checkpoint import Storage

    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return 0
    data = saved[0]
    try:
        Storage(run.storage).write_atomic(artifacts_rel(run), data)
    except OSError as exc:
        log.warning("the compiled artifacts could not be written to the run directory (%s); "
                    "workers on other nodes compile their own", exc)
        return 0
    return len(data)


def compiled_for_a_run() -> bool:
    """Whether this process's compiler caches are a run's directory (use_run_cache): torch
    keeps the directory it first compiled into for the process's life, so such a process
    cannot serve another run (process/keeping.py)."""
    return os.environ.get(CACHE_ENV, "").startswith(str(Path(tempfile.gettempdir()) / "raytrainer-compile"))


def remove_run_cache(config: Config) -> None:
    """A finished run's compiled artifacts on this node go: nothing continues it. Only the
    directory raytrainer chose (use_run_cache), never one the user set."""
    if config.trainer.compile is not None and os.environ.get(CACHE_ENV) == str(run_cache_dir(config)):
        shutil.rmtree(run_cache_dir(config), ignore_errors=True)


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
           "aot_cache_misses", "loaded_artifacts", "first_step_ms")


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

    counts = {"pid": os.getpid(), **_internals.compile_counts(), "loaded_artifacts": _loaded,
              "first_step_ms": round(seconds * 1000)}
    counts["new_graphs"] = counts["compiled_graphs"] - graphs_at_join
    mine = torch.tensor([counts[k] for k in _COUNTS], dtype=torch.int64, device=device)
    rows = [mine]
    if world_size > 1:
        rows = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(rows, mine)
    workers = [{"rank": rank, **dict(zip(_COUNTS, row.tolist()))} for rank, row in enumerate(rows)]
    return {"event": "compiled", "step": step, "workers": workers}
