"""Building blocks of the FSDP2 strategy: sharding, sharded checkpoints, clipping, EMA.

Plain torch (torch.distributed.fsdp.fully_shard, torch.distributed.checkpoint); no Ray.
Every function here that takes no process group works on the default one, and every
one marked "collective" must be called by every rank of it, in the same order.

Facts this module rests on (torch 2.13, CPU/Gloo and CUDA/NCCL):

- fully_shard runs on CPU with a "cpu" DeviceMesh over a Gloo group, nothing to set:
  Gloo does all-gather and reduce-scatter, with ReduceOp.AVG (FSDP's default for fp32
  and bf16 gradients), in fp32, bf16 and fp16. Gloo has no PREMUL_SUM, so a custom
  `set_gradient_divide_factor` other than the world size fails on CPU; we never set one.
- Gradients are averaged over ranks (like DDP); a micro-batch loss divided by the
  number of micro-batches gives the global-batch mean, as in loop.py.
- torch.amp.GradScaler works unchanged on sharded (DTensor) gradients: DTensor's
  handler for _amp_foreach_non_finite_check_and_unscale_ all-reduces found_inf over the
  mesh, so an inf in one rank's shard skips the step on every rank (measured).
  FSDP1's ShardedGradScaler also works but only adds a second all-reduce.
- AveragedModel cannot wrap a fully_shard-ed module ("FSDP does not support
  deepcopy"): ShardedEMA below keeps the average as shards instead.
- clip_grad_norm_ on DTensor gradients returns a replicated DTensor; clip_grad_norm
  below returns a plain tensor.
- DCP stores a non-tensor leaf as a torch.save'd blob and loads it with
  torch.load(weights_only=False), and reads its .metadata with plain pickle.load: both
  unpickle arbitrary code. Here blobs load with weights_only=True and .metadata with an
  unpickler that only builds DCP's own metadata classes.
- dcp.async_save runs `save` (its plan gather/scatter and the final gather) on a
  background thread, on the group it is given (the default one if none). Given the
  default group while the training thread goes on, the two threads' collectives pair up
  wrongly across ranks: FSDP's all-gather timed out (Gloo, 60 s) on both ranks
  (measured). On its own Gloo group (AsyncShardedSaver) training went on undisturbed.
  async_save also refuses a group without a CPU backend (plain NCCL).
- get_state_dict on an optimizer with no state yet runs a step with zero gradients and
  lr=0 to create it: weights are unchanged, but AdamW's step counter then reads 1.
- A full state dict (full_state_dict=True, cpu_offload=True) holds the live tensors
  themselves where there is nothing to gather or move (one rank; a replicated CPU
  buffer): full_model_state copies those.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import warnings
from concurrent.futures import Future
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemWriter
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.tensor import DTensor

from ... import filesystems
from ...checkpoint import Storage
from .. import _internals
from ..dist import new_gloo_group

PLAIN = "plain.pt"  # the values of `state` that hold no tensor, written by rank 0
DCP_METADATA = ".metadata"  # written by DCP's coordinator (rank 0) after every rank's shards


# ---------------------------------------------------------------------------- sharding


_meshes_made = 0  # in this process: the generation of its newest mesh


def default_mesh(device_type: str | None = None):
    """A 1-D mesh over the default process group (collective: every rank calls it).

    Named by a generation every rank agrees on (one past the newest any of them made):
    DeviceMesh equality is the ranks, the device type and the names, not the process
    group, and torch hands a sharded parameter an equal mesh made earlier in the process
    (measured, torch 2.13: a worker that was rank 1 of 4, then 0 of 2, then 0 of 4 again
    got its first group's mesh back, with its coordinate 1): its shards' offsets were then
    another rank's, and a checkpoint's plan failed. A survivor of a re-shard meets that."""
    from torch.distributed.device_mesh import init_device_mesh

    global _meshes_made
    if device_type is None:
        device_type = "cuda" if "nccl" in dist.get_backend() else "cpu"
    generation = torch.tensor([_meshes_made + 1], dtype=torch.int64, device=device_type)
    if dist.get_world_size() > 1:
        dist.all_reduce(generation, op=dist.ReduceOp.MAX)
    _meshes_made = int(generation.item())
    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=(f"fsdp{_meshes_made}",))


def shard_model(module: nn.Module, mesh=None, *, shard_classes: list[str] | None = None,
                reshard_after_forward: bool = True, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = None) -> nn.Module:
    """Apply fully_shard to the units of `module`, then to `module` itself (collective).

    Units: every submodule whose class name is in `shard_classes`; without it, every
    direct child that holds parameters, looking through ModuleList/ModuleDict (they have
    no forward of their own, so FSDP's hooks on them would never run) into their items.
    A unit holding a parameter that a module outside it holds too (tied weights) is left
    to the root's group. Whatever no unit takes is in the root's group. Each unit is one all-gather and
    one reduce-scatter per step. The module is moved to the mesh's device, in place, and
    returned (it is now also an FSDPModule). The root keeps its parameters unsharded after
    forward (FSDP's default for a root: backward needs them at once) unless
    reshard_after_forward is False everywhere anyway.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = mesh if mesh is not None else default_mesh()
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    units = _units(module, shard_classes)
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(module, mesh=mesh, reshard_after_forward=None if reshard_after_forward else False,
                mp_policy=policy)
    return module


def _units(module: nn.Module, shard_classes: list[str] | None) -> list[nn.Module]:
    if shard_classes is not None:
        names = set(shard_classes)
        found = [m for m in module.modules() if type(m).__name__ in names and m is not module]
        missing = names - {type(m).__name__ for m in found}
        if missing:
            raise ValueError(f"shard_classes names classes the model does not have: {sorted(missing)}")
        # A unit inside another unit is fine (fully_shard goes bottom-up: modules() lists
        # parents first, so reverse).
        candidates = list(reversed(found))
    else:
        candidates = []
        for child in module.children():
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                candidates += [m for m in child.children() if _has_params(m)]
            elif _has_params(child):
                candidates.append(child)
    # A parameter shared between modules (tied weights) must be in the group of a module
    # around all of them: a unit is dropped (left to the root's group) when a parameter
    # it would take (not one of a unit nested in it, which takes those first) is also
    # held by a module outside it.
    holders: dict[int, set[int]] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(id(m))
    kept: list[nn.Module] = []  # candidates come inner first, so nested units are decided
    for unit in candidates:
        inside = {id(m) for m in unit.modules()}
        nested = {id(p) for m in kept if id(m) in inside for p in m.parameters()}
        if all(holders[id(p)] <= inside for p in unit.parameters() if id(p) not in nested):
            kept.append(unit)
    return kept


def _has_params(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def set_gradient_sync(module: nn.Module, enabled: bool) -> None:
    """Gradient accumulation without communication: False before every micro-batch but
    the last (each rank keeps its unsharded gradients, the full model's size), True
    before the last, whose backward reduce-scatters the sum."""
    module.set_requires_gradient_sync(enabled)


def local_param_bytes(module: nn.Module) -> int:
    """Bytes of the parameters this rank holds (its shards)."""
    return sum(_local(p).numel() * p.element_size() for p in module.parameters())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# ---------------------------------------------------------------------------- clipping


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients by their global norm over every shard (collective when any
    gradient is a DTensor); returns that norm, a plain scalar tensor, the same on every
    rank. DTensor gradients on one mesh are reduced by DTensor (it knows which placements
    are shards and which replicas); groups of different meshes and plain gradients are
    combined here. The scaling itself is local."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    groups: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = []
    for key, members in groups.items():
        norm = torch.nn.utils.get_total_norm(members, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = norms[0].device
    total = torch.nn.utils.get_total_norm([n.to(device) for n in norms], norm_type) if len(norms) > 1 else norms[0]
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    local = [_local(g) for g in grads]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in local:
        by_device.setdefault(t.device, []).append(t)
    for dev, ts in by_device.items():
        _internals.foreach_mul_(ts, coef.to(dev))
    return total


# ---------------------------------------------------------------------------- EMA


class ShardedEMA:
    """An exponential moving average of a (sharded) module's parameters and floating
    buffers, kept as shards like the parameters: what AveragedModel(use_buffers=True,
    multi_avg_fn=get_ema_multi_avg_fn(decay)) computes, without its deepcopy (which
    FSDP refuses). Updates are local (no communication); the state dict holds DTensors,
    so DCP reshards it like the model's."""

    def __init__(self, module: nn.Module, decay: float):
        self.decay = decay
        self.names = [n for n, _ in _averaged(module)]
        self.shadow = [t.detach().clone() for _, t in _averaged(module)]
        self.n_averaged = 0

    @torch.no_grad()
    def update(self, module: nn.Module) -> None:
        current = [t.detach() for _, t in _averaged(module)]
        if self.n_averaged == 0:  # AveragedModel: the first update copies
            for s, c in zip(self.shadow, current):
                _local(s).copy_(_local(c))
        else:
            floats = [(_local(s), _local(c)) for s, c in zip(self.shadow, current) if s.is_floating_point()]
            if floats:
                _internals.foreach_lerp_([s for s, _ in floats], [c for _, c in floats], 1.0 - self.decay)
            for s, c in zip(self.shadow, current):
                if not s.is_floating_point():
                    _local(s).copy_(_local(c))
        self.n_averaged += 1

    update_parameters = update  # AveragedModel's name, which state.TrainState calls

    @contextlib.contextmanager
    def swapped_in(self, module: nn.Module) -> Iterator[nn.Module]:
        """`module` holds the averaged weights inside the block (validation), its own after."""
        current = [t.detach() for _, t in _averaged(module)]
        with torch.no_grad():
            saved = [_local(t).clone() for t in current]
            for t, s in zip(current, self.shadow):
                _local(t).copy_(_local(s))
        try:
            yield module
        finally:
            with torch.no_grad():
                for t, s in zip(current, saved):
                    _local(t).copy_(s)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "n_averaged": torch.tensor(self.n_averaged),
                "shadow": dict(zip(self.names, self.shadow))}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n_averaged = int(state["n_averaged"])
        for name, s in zip(self.names, self.shadow):
            src = state["shadow"][name]
            if src is not s:
                _local(s).copy_(_local(src))

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """The averaged weights as a plain state dict on rank 0, on CPU (collective)."""
        full = {n: (s.full_tensor() if isinstance(s, DTensor) else s).detach().cpu().clone()
                for n, s in zip(self.names, self.shadow)}
        return full if dist.get_rank() == 0 else None


def _averaged(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters (the shards) and buffers in state-dict order (buffers are replicated
    plain tensors). After a forward with no backward (validation) FSDP keeps the root's
    parameters gathered, and any unit's with reshard_after_forward=False: registered as
    the full tensors until resharded, so reshard first."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return list(module.named_parameters()) + list(module.named_buffers())


# ---------------------------------------------------------------------------- state dicts


def get_train_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """{"model": ..., "optimizer": ...} as DCP saves and loads them (DTensor shards).
    A fresh optimizer's state is initialised by a step with zero gradients and lr=0
    (torch's _init_optim_state): AdamW's step counter then reads 1, not 0."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def set_train_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict, plain CPU tensors, on rank 0; None elsewhere
    (collective: every rank takes part in the all-gathers)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    # Where gathering and offloading copy nothing (one rank, or a replicated CPU buffer)
    # torch hands back the live tensor itself: copy it, so the result stays as it is now.
    live = {_local(t).untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    return {k: v.clone() if v.untyped_storage().data_ptr() in live else v for k, v in sd.items()}


# ---------------------------------------------------------------------------- DCP on pyarrow.fs


class ArrowFileSystem(FileSystemBase):
    """DCP's file operations on a pyarrow filesystem (local, s3://, ...): what
    FileSystemWriter/Reader need. Paths are pyarrow paths (no scheme). Writes are made
    durable here (a local file is fsync'ed before it is closed; an object store's upload
    is complete when its stream closes), so the writer runs with sync_files=False: DCP's
    own fsync falls back to os.sync() of the whole machine for a stream with no fileno."""

    def __init__(self, fs):
        import pyarrow.fs as pafs

        self.fs = fs
        self.local = isinstance(fs, pafs.LocalFileSystem)

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        path = os.fspath(path)
        if mode == "wb":
            if self.local:
                with open(path, "wb") as f:
                    yield f
                # DCP closes the stream itself; fsync through a new descriptor.
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            else:
                with self.fs.open_output_stream(path) as f:
                    yield f
        elif mode == "rb":
            if self.local:
                with open(path, "rb") as f:
                    yield f
            else:
                with self.fs.open_input_file(path) as f:  # random access: ranged reads
                    yield f
        else:
            raise ValueError(f"unsupported mode {mode!r}")

    def concat_path(self, path, suffix: str) -> str:
        return f"{os.fspath(path).rstrip('/')}/{suffix}"

    def init_path(self, path) -> str:
        return os.fspath(path)

    def rename(self, path, new_path) -> None:
        self.fs.move(os.fspath(path), os.fspath(new_path))  # local: os.replace, atomic

    def mkdir(self, path) -> None:
        self.fs.create_dir(os.fspath(path), recursive=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return isinstance(checkpoint_id, str)

    def exists(self, path) -> bool:
        import pyarrow.fs as pafs

        return self.fs.get_file_info(os.fspath(path)).type != pafs.FileType.NotFound

    def rm_file(self, path) -> None:
        self.fs.delete_file(os.fspath(path))


class ArrowWriter(FileSystemWriter):
    """DCP's FileSystemWriter (one file per rank and thread, `.metadata` by rank 0 last)
    through a pyarrow filesystem. Being a FileSystemWriter it is also the stager
    async_save uses: a blocking copy of the state to new CPU tensors."""

    def __init__(self, storage: Storage, path: str, thread_count: int = 1):
        super().__init__(path, sync_files=False, thread_count=thread_count, overwrite=True)
        self.fs = ArrowFileSystem(storage.fs)
        self.path = path


class ArrowReader(_internals.dcp_reader_base()):
    def __init__(self, storage: Storage, path: str):
        super().__init__(path)
        self.fs = ArrowFileSystem(storage.fs)
        self.path = path

    def read_item(self, file, sinfo):
        """One item of a shard file. On an object store, one ranged GET for the item's
        bytes: torch.load reads a view in many small pieces, each a request there
        (measured: 516 GETs to load a 2.5k-parameter model and its AdamW state, 2.7 s on
        moto's server, against 0.3 s and 36 GETs now)."""
        if self.fs.local:
            return self.default_read_item(file, sinfo)
        return io.BytesIO(file.read_at(sinfo.length, sinfo.offset))

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self.metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what a DCP .metadata file holds (measured on a saved one): the classes
    of torch.distributed.checkpoint.metadata, the filesystem's _StorageInfo, torch.Size,
    dtypes, layouts and memory formats."""

    ALLOWED = {("torch", "Size"), ("collections", "OrderedDict"), *_internals.DCP_METADATA_GLOBALS}

    def find_class(self, module: str, name: str):
        import torch.distributed.checkpoint.metadata as dcp_metadata

        if ((module, name) in self.ALLOWED
                or (module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type))
                or (module == "torch" and isinstance(getattr(torch, name, None),
                                                      (torch.dtype, torch.layout, torch.memory_format)))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a DCP .metadata file may not name {module}.{name}")


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values load with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            _internals.dcp_set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# ---------------------------------------------------------------------------- checkpoints


def _split(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(entries holding tensors: DCP; entries holding none: plain.pt)."""
    tensors, plain = {}, {}
    for k, v in state.items():
        (tensors if _holds_tensor(v) else plain)[k] = v
    return tensors, plain


def _holds_tensor(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, dict):
        return any(_holds_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_holds_tensor(x) for x in v)
    return False


def _prepare_dir(storage: Storage, rel_dir: str, plain: dict[str, Any], group) -> None:
    """Rank 0 empties the directory (a rewrite of the same step after a recovery must
    not keep a bigger world's shard files) and writes plain.pt; the others wait. Where
    rank 0 cannot (a full disk, storage down), every rank raises its OSError: all ranks
    leave the save together, none waits in DCP's collectives for rank 0."""
    failed = None
    if _rank(group) == 0:
        try:
            if storage.exists(rel_dir):
                storage.delete_dir(rel_dir)
            buffer = io.BytesIO()
            torch.save(plain, buffer)
            storage.write(f"{rel_dir}/{PLAIN}", buffer.getvalue())
        except OSError as exc:
            failed = f"{type(exc).__name__}: {exc}"
    if _world(group) > 1:
        news = [failed]
        dist.broadcast_object_list(news, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        failed = news[0]
    if failed is not None:
        raise OSError(f"writing {storage.path(rel_dir)}/{PLAIN} failed: {failed}")


def save_sharded(state: dict[str, Any], storage: Storage, rel_dir: str, *, process_group=None,
                 thread_count: int = 1) -> dict[str, dict[str, int]] | None:
    """Save `state` to `<storage>/<rel_dir>/` (collective): every rank writes its own shards
    (one file per rank and thread) in parallel, rank 0 writes plain.pt (the top-level
    entries that hold no tensor: loop counters, a scheduler's or scaler's state ...) first
    and DCP's .metadata last, after every rank's shards are written. Returns on rank 0 the
    files written, {name: {"size": bytes}} (for a commit marker), None elsewhere.

    `state` values: get_train_state()'s, ShardedEMA.state_dict(), tensors, and anything
    torch.load(weights_only=True) reads back (ints, floats, None, strings, dicts, lists)."""
    import torch.distributed.checkpoint as dcp

    tensors, plain = _split(state)
    _prepare_dir(storage, rel_dir, plain, process_group)
    with _single_process_quiet():
        dcp.save(tensors, storage_writer=ArrowWriter(storage, storage.path(rel_dir), thread_count),
                 process_group=process_group, no_dist=not dist.is_initialized())
    return _files(storage, rel_dir) if _rank(process_group) == 0 else None


def load_sharded(state: dict[str, Any], storage: Storage, rel_dir: str, *, process_group=None) -> dict[str, Any]:
    """Load into `state` in place (collective) and return it: tensors, DTensors included,
    are filled from the checkpoint whatever world size wrote it (DCP reshards); the
    entries that hold no tensor are replaced by the saved ones whatever `state` holds
    there. Every tensor entry of `state` must be in the checkpoint; follow with
    set_train_state / ShardedEMA.load_state_dict. Nothing is unpickled but tensors,
    DCP's metadata classes and plain values."""
    import torch.distributed.checkpoint as dcp

    if not storage.exists(f"{rel_dir}/{DCP_METADATA}"):
        raise FileNotFoundError(f"{storage.path(rel_dir)} holds no complete sharded checkpoint (no {DCP_METADATA})")
    tensors, _ = _split(state)
    with _single_process_quiet():
        dcp.load(tensors, storage_reader=ArrowReader(storage, storage.path(rel_dir)),
                 planner=_WeightsOnlyLoadPlanner(), process_group=process_group,
                 no_dist=not dist.is_initialized())
    state.update(tensors)
    state.update(read_plain(storage, rel_dir))
    return state


def read_plain(storage: Storage, rel_dir: str) -> dict[str, Any]:
    """The entries of a sharded checkpoint's state that hold no tensor (plain.pt)."""
    return torch.load(io.BytesIO(storage.read(f"{rel_dir}/{PLAIN}")), weights_only=True)


def checkpoint_location(uri: str) -> tuple[Storage, str]:
    """A sharded checkpoint's directory, named by its URI: (its parent's storage, its name)."""
    parent, name = filesystems.split(uri)
    return Storage(parent), name


class AsyncShardedSaver:
    """dcp.async_save on its own Gloo process group. The background thread's collectives
    (planning, the final gather of results) must not interleave with the training
    thread's on the default group: two threads issuing collectives on one group can pair
    different collectives across ranks. async_save also requires a group with a CPU
    backend. So this makes one Gloo group (collective, once) and runs every save on it.
    The state is copied to new CPU tensors before `save` returns (the training thread
    may go on at once); one save at a time: a new one waits for the previous."""

    def __init__(self, process_group=None):
        self.group = process_group if process_group is not None else (
            new_gloo_group() if dist.is_initialized() else None)
        self.pending: Future | None = None

    def save(self, state: dict[str, Any], storage: Storage, rel_dir: str, thread_count: int = 1) -> Future:
        """A future whose result is save_sharded's (the files on rank 0, None elsewhere)."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        tensors, plain = _split(state)
        _prepare_dir(storage, rel_dir, plain, self.group)
        inner = dcp.async_save(tensors, storage_writer=ArrowWriter(storage, storage.path(rel_dir), thread_count),
                               process_group=self.group, no_dist=not dist.is_initialized())
        outer: Future = Future()
        rank0 = _rank(self.group) == 0

        def done(f: Future) -> None:
            try:
                f.result()
                outer.set_result(_files(storage, rel_dir) if rank0 else None)
            except BaseException as exc:
                outer.set_exception(exc)

        inner.add_done_callback(done)
        self.pending = outer
        return outer

    def wait(self) -> Any:
        """Wait for the save in flight, if any (raises its error)."""
        pending, self.pending = self.pending, None
        return pending.result() if pending is not None else None

    def close(self) -> None:
        with contextlib.suppress(BaseException):
            self.wait()
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = None


@contextlib.contextmanager
def _single_process_quiet():
    """Without a process group DCP warns that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _files(storage: Storage, rel_dir: str) -> dict[str, dict[str, int]]:
    import pyarrow.fs as pafs

    infos = storage.fs.get_file_info(pafs.FileSelector(storage.path(rel_dir)))
    return {i.base_name: {"size": i.size} for i in infos if i.type == pafs.FileType.File}


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1
