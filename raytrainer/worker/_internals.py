"""Every private torch and Ray name the worker side uses, and nothing else.

Each use says why raytrainer needs it, the versions it was checked on, and what happens
without it. tests/test_internals.py checks that each still exists (and that the messages
matched below still look as they did), so an upgrade that removes one fails there, with
the name and what it is for, not somewhere deep in a recovery; tests/test_layout.py
checks that no other module of the package uses a private torch or Ray name.

Checked on torch 2.13.0 and Ray 2.60.0 (the pinned versions) and on the oldest that
pyproject.toml claims, torch 2.7.0 and Ray 2.40.0 (`bash .ci/oldest.sh`; the Gloo message
below included).

Submodules of torch and Ray that only some callers need (DCP, torch._dynamo, Ray's KV
store) are imported inside the functions that use them.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm

# ---------------------------------------------------------------------------- process group


def import_dynamo() -> None:
    """Import torch._dynamo now. Every optimizer imports it as it is built (torch wraps
    Optimizer.add_param_group in torch._disable_dynamo): about a second, which a
    worker pays at start-up (while it waits idle) instead of in a recovery's pause.
    Without it: the same import, later, inside the first optimizer's construction."""
    import torch._dynamo  # noqa: F401


def import_inductor() -> None:
    """Import torch._inductor's compiler now (trainer.compile): a new process's first
    compile otherwise imports it inside the first step, seconds, which a
    replacement would pay in a recovery's pause. Without it: the same import, later."""
    import torch._inductor.compile_fx  # noqa: F401


def compile_counts() -> dict[str, int]:
    """What this process has compiled (trainer.compile), from dynamo's own counters
    (torch._dynamo.utils.counters, private; checked on torch 2.13): `compiled_graphs`, the
    graphs dynamo captured (it grows on every recompile), and inductor's FX-graph and
    AOTAutograd cache hits and misses. Without it: no way to tell a recompile or a cache
    hit from outside but torch's logs."""
    from torch._dynamo.utils import counters

    return {"compiled_graphs": counters["stats"]["unique_graphs"],
            "fx_cache_hits": counters["inductor"]["fxgraph_cache_hit"],
            "fx_cache_misses": counters["inductor"]["fxgraph_cache_miss"],
            "aot_cache_hits": counters["aot_autograd"]["autograd_cache_hit"],
            "aot_cache_misses": counters["aot_autograd"]["autograd_cache_miss"]}


def reset_group_count() -> None:
    """Name this process's next default group "0", as a new process does.

    torch names the default group after a per-process counter (distributed_c10d._world.
    group_count), and the group's keys in the store carry that name. The counter moves
    before the rendezvous and goes back to 0 only when a group is destroyed or aborted, so
    after an init that failed (a peer lost while the group formed) this process would name
    its next group "1" while a fresh replacement names it "0": each side waits for keys the
    other never writes, for the collective timeout, at every later attempt (seen: a double
    kill's re-form waiting 600 s). Without it: that wait."""
    dist.distributed_c10d._world.group_count = 0


def abort_process_group() -> None:
    """Abort every process group of this process (distributed_c10d._abort_process_group:
    torch >= 2.6, and 2.6's leaves the default group initialised, so the next init fails;
    hence torch >= 2.7): the only teardown that returns while a collective is pending. Destroying
    the group blocks then, on NCCL when a peer is gone and on Gloo while a peer still waits
    in a collective (measured, torch 2.13); on NCCL it is also what unblocks a collective
    from another thread. Without it: a survivor hangs in its teardown after a failure."""
    dist.distributed_c10d._abort_process_group()


def flight_recorder_dump() -> Callable[[], bytes] | None:
    """torch's flight recorder dump (the last collectives of this rank, as JSON), written
    beside a hung worker's stacks: _dump_fr_trace_json records Gloo and NCCL (torch >=
    2.8), _dump_nccl_trace_json NCCL only (older torch, NCCL builds). Without it (a CPU
    build of older torch): no record of collectives, the stacks only."""
    c10d = torch._C._distributed_c10d
    return getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json", None)


def records_gloo_collectives() -> bool:
    """Whether the flight recorder records Gloo too (torch >= 2.8), which decides the name
    of the variable that sizes its buffer (TORCH_FR_BUFFER_SIZE, else TORCH_NCCL_TRACE_BUFFER_SIZE)."""
    return hasattr(torch._C._distributed_c10d, "_dump_fr_trace_json")


# A lost Gloo peer, as torch reports it. Measured on torch 2.13.0 (3 local Gloo processes,
# one SIGKILLed; /tmp experiment kept in tests/test_internals.py): in all_reduce,
# all_gather_into_tensor, reduce_scatter_tensor, broadcast_object_list, barrier and DDP's
# backward, every survivor gets a bare RuntimeError (not a DistError) whose message starts
# with the Gloo source file that raised it:
#   "[.../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:28581:
#    Connection reset by peer. ..."   or "...pair.cc:553] Connection closed by peer ..."
# and a peer frozen past the collective timeout gives
#   "[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 15000ms for recv ..."
# Losing a peer during the rendezvous gives typed errors (DistStoreError when it never
# comes, DistNetworkError when the store's host dies), which `is_peer_failure` matches by
# type. So the message match below is kept only for Gloo's bare RuntimeError; the test
# fails when torch starts raising a typed error there (then drop the match) or changes the
# message (then update it).
GLOO_TRANSPORT_MARKER = "gloo/transport/"


def is_gloo_transport_error(exc: BaseException) -> bool:
    """A Gloo collective that failed because a peer's connection closed, reset, or timed
    out: torch raises a bare RuntimeError naming Gloo's transport (see above). Without
    the match: a lost peer would read as this worker's own error, and the run would fail
    instead of recovering."""
    return type(exc) is RuntimeError and GLOO_TRANSPORT_MARKER in str(exc)


# ---------------------------------------------------------------------------- DDP


class _FixedBuckets:
    """DDP's reducer, except that it never rebuilds its gradient buckets.

    DDP re-buckets once, after its first iteration, by the order gradients became ready
    (DistributedDataParallel.forward calls reducer._rebuild_buckets()). The bucket layout
    decides how a collective splits the gradients over ranks, and so the order in which
    each element is summed: with 3 or more ranks a fresh DDP (every re-form) would sum its
    first step differently from the undisturbed run, and the weights would drift by a few
    ulps (measured: Gloo, 3 ranks). The layout DDP starts with (parameters in reverse
    order, which backward mostly follows) is kept instead. Any other use of the reducer
    passes through. Without it: recovered runs end within float rounding of an undisturbed
    one, not bit-identical."""

    def __init__(self, reducer: Any):
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


def keep_initial_buckets(ddp: torch.nn.parallel.DistributedDataParallel) -> None:
    """Stop `ddp` from re-bucketing its gradients after the first iteration (see _FixedBuckets)."""
    if hasattr(ddp.reducer, "_rebuild_buckets"):
        ddp.reducer = _FixedBuckets(ddp.reducer)


def grad_scaler_device(scaler: torch.amp.GradScaler) -> str:
    """The device a GradScaler was made for (its private _device; torch has no public
    accessor), to make a fresh one after an interrupted step: an unscale_ without its step
    would be remembered by the old one. Without it: no fresh scaler, and the next step
    after a recovery would refuse to unscale again."""
    return scaler._device


class BatchNorm(_BatchNorm):
    """torch's base of BatchNorm1d/2d/3d (the private _BatchNorm), accepting any input of at
    least 2 dimensions: the base GlooSyncBatchNorm needs, as torch's own SyncBatchNorm
    derives from it. Without it: GlooSyncBatchNorm would be a copy of _BatchNorm's
    parameters, buffers and state-dict handling."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")


def is_batchnorm(module: torch.nn.Module) -> bool:
    """Whether `module` is any of torch's BatchNorm layers (instances of _BatchNorm)."""
    return isinstance(module, _BatchNorm)


# ---------------------------------------------------------------------------- FSDP and DCP


def foreach_mul_(tensors: list[torch.Tensor], scalar: torch.Tensor) -> None:
    """torch._foreach_mul_: one kernel launch for a list of tensors, as torch's own
    clip_grad_norm_ scales gradients. Without it: a loop of mul_ (the same result, slower
    on GPUs)."""
    torch._foreach_mul_(tensors, scalar)


def foreach_lerp_(tensors: list[torch.Tensor], ends: list[torch.Tensor], weight: float) -> None:
    """torch._foreach_lerp_: the EMA update of a list of tensors in one call, as
    AveragedModel's get_ema_multi_avg_fn does it (the same arithmetic, so the same bits).
    Without it: a loop of lerp_."""
    torch._foreach_lerp_(tensors, ends, weight)


def dcp_set_element(root: dict[str, Any], path: Any, value: Any) -> None:
    """DCP's own setter of a value at a flattened state-dict path (checkpoint._traverse.
    set_element), which its DefaultLoadPlanner.load_bytes uses; ours loads those values with
    weights_only=True and then sets them the same way. Without it: nested non-tensor values
    of a sharded checkpoint could not be restored."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)


# What a DCP .metadata file pickles besides the public classes of
# torch.distributed.checkpoint.metadata (measured on a saved one): the filesystem's
# _StorageInfo and torch.serialization._get_layout (how torch pickles a layout). The
# restricted unpickler of sharded.py allows exactly these. Without them: no sharded
# checkpoint could be read.
DCP_METADATA_GLOBALS = {("torch.serialization", "_get_layout"),
                        ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


@functools.cache
def dcp_reader_base() -> type:
    """DCP's FileSystemReader with its two private hooks given public names, for a reader
    over a pyarrow filesystem (sharded.ArrowReader):
    - `_slice_file(file, sinfo)`, which DCP's read_data calls for each item to load, calls
      `read_item(file, sinfo)`; `default_read_item` is DCP's own (it reads a view of the
      file in many small pieces: one request each on an object store);
    - `metadata_path(rank)` is DCP's `_get_metadata_path` where it has one (torch >= 2.7:
      the file may be named per rank), else the `.metadata` file torch 2.6 always reads.
    Without them: one GET per small read on S3 (516 against 36 for a 2.5k-parameter model
    with AdamW state, 2.7 s against 0.3 s on moto's server), and our own copy of DCP's path
    logic."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    class Reader(FileSystemReader):
        def _slice_file(self, file: Any, sinfo: Any) -> Any:
            return self.read_item(file, sinfo)

        def read_item(self, file: Any, sinfo: Any) -> Any:
            return self.default_read_item(file, sinfo)

        def default_read_item(self, file: Any, sinfo: Any) -> Any:
            return FileSystemReader._slice_file(self, file, sinfo)

        def metadata_path(self, rank: int | None) -> Any:
            if hasattr(FileSystemReader, "_get_metadata_path"):
                return self._get_metadata_path(rank)
            return self.fs.concat_path(self.path, ".metadata")

    return Reader


# ---------------------------------------------------------------------------- data loading


def shutdown_loader_iterator(it: Any) -> None:
    """Stop a DataLoader iterator's worker processes now (its private _shutdown_workers,
    which its own __del__ calls): an epoch abandoned in a recovery would otherwise leave
    them running until garbage collection. Without it: loader processes outlive the
    interrupted step for a while."""
    stop = getattr(it, "_shutdown_workers", None)
    if stop is not None:
        stop()


def take_loader_iterator(loader: Any) -> Any:
    """A DataLoader's iterator that it keeps for reuse (persistent_workers: its private
    _iterator, which __iter__ resets instead of making a new one), taken from it; None where
    it keeps none. Stopping a loader's processes at once (input.MapInput.close,
    ValInput.close) needs it: the loader holds it, not the caller, once an epoch is done.
    Checked on torch 2.13 and 2.7 (an instance attribute set in __init__, present since
    persistent_workers came, torch 1.7). Without it: a persistent loader's processes live
    until the loader is garbage-collected, after the inputs are closed."""
    it = getattr(loader, "_iterator", None)
    if it is not None:
        loader._iterator = None
    return it


# A socket multiprocessing makes in its folder: "/listener-" and 8 random characters; Linux
# takes a socket's path of at most 107 bytes (sun_path, less its terminating NUL).
_LISTENER_NAME = len("/listener-12345678")
_SOCKET_PATH_MAX = 107


def use_multiprocessing_folder(make: Callable[[], Path]) -> Path | None:
    """Have multiprocessing make this process's sockets (its fork server's listener, its
    children's) in the folder `make` makes, instead of a `pymp-*` folder of its own; that
    folder, or None where this process already has one, or where a socket's path in it would
    be too long (multiprocessing's own folder is then used).

    multiprocessing.util.get_temp_dir makes a `pymp-*` folder in the temp dir the first time
    a process needs an address, and removes it at a normal exit only: a worker killed from
    outside (ray.kill at a run's end, any fault) left one in the node's temp dir, for each
    worker and run with loader processes or a checkpoint writer process. get_temp_dir finds
    it in current_process()._config["tempdir"], which a child process copies from its parent
    (private; checked on CPython 3.11). Without it: those folders pile up in the temp dir.
    tests/test_input.py checks that a worker killed with loader processes leaves none."""
    from multiprocessing import process, util

    config = process.current_process()._config
    if config.get("tempdir") is not None:
        return None
    folder = make()
    if len(str(folder)) + _LISTENER_NAME > _SOCKET_PATH_MAX:
        shutil.rmtree(folder, ignore_errors=True)
        return None
    config["tempdir"] = str(folder)
    # Removed at a normal exit, as multiprocessing removes its own (the same priority: after
    # every other finalizer that may still use a socket in it).
    util.Finalize(None, shutil.rmtree, args=(str(folder), True), exitpriority=-100)
    return folder


# ---------------------------------------------------------------------------- Hugging Face


def reset_accelerate_state() -> None:
    """Forget accelerate's process-wide AcceleratorState and PartialState, if accelerate is
    loaded (AcceleratorState._reset_state(reset_partial_state=True): private; the method
    accelerate resets them with in its own tests; checked on accelerate 1.15.0). They hold
    the process group's shape, made once: after a re-form (a new group, maybe of another
    size) a Hugging Face Trainer in the user's loop must make them again from the new
    environment. Without it: the Trainer keeps the old world size and rank after a recovery
    or a resize."""
    import sys

    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)


# ---------------------------------------------------------------------------- Ray (worker side)


def kv_put_if_absent(key: str, value: bytes) -> bool:
    """Put `key` in the cluster's KV store unless it is there; True if this call put it.
    ray.experimental.internal_kv._internal_kv_put is the only write to the GCS's KV store
    that a worker can make (Ray has no public one); failure.chaos uses it to fire each
    fault once per run across processes. Without it: chaos faults would fire again in
    every replacement."""
    from ray.experimental.internal_kv import _internal_kv_put

    return not _internal_kv_put(key, value, overwrite=False)


def job_alive(job_id: str) -> bool | None:
    """Whether Ray job `job_id` (hex: a driver) is alive: False once the GCS holds it dead
    (its driver process exited or was killed), None where it cannot tell (the GCS does not
    answer, or does not know the job). Ray has no public way for an actor to watch a
    driver: ray._private.state's job table is what `ray list jobs` reads without the
    dashboard. Without it: a detached worker would not notice its driver's death and would
    train on until the run's end with nobody recording it (failure.driver_grace_s)."""
    from ray._private import state

    try:
        table = state.state.job_table()
    except Exception:  # noqa: BLE001 - a GCS that does not answer now says nothing of the job
        return None
    for job in table:
        if job.get("JobID") == job_id:
            return not job.get("IsDead")
    return None


def remove_placement_groups(prefix: str) -> int:
    """Remove every placement group whose name starts with `prefix` (a run's, named by the
    driver: contract.placement_group_prefix); how many. The table is public
    (ray.util.placement_group_table), a group from its id is not: PlacementGroup(id) is the
    class Ray's own handles are. Without it: an orphaned run's detached groups would hold
    their resources until Ray stops."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    removed = 0
    for pg_id, info in placement_group_table().items():
        if (info.get("name") or "").startswith(prefix) and info.get("state") != "REMOVED":
            try:
                remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(pg_id)))
                removed += 1
            except Exception:  # noqa: BLE001 - removed meanwhile by another worker of the run
                pass
    return removed
