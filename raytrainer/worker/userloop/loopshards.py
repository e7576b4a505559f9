"""Your own loop's state under trainer.strategy fsdp: each rank's pieces, on the host.

Under FSDP2 the state dicts a loop reports (its model's, its optimizer's) hold DTensors,
of which each rank has a piece. A report's copy keeps this rank's pieces on CPU, and the
state's `layout`: for each tensor, where it is in the state (its path of keys), its
global shape, stride and dtype, and the dimension it is sharded along (None: a plain
tensor, not sharded). FSDP2 shards every parameter, and so the optimizer's state of it,
along one dimension of a 1-D mesh in torch.chunk's pieces (reshard.py says why that is
safe to rely on); any other placement is refused as it is reported. The layout is plain
values: it goes with the pieces into a peer snapshot (snapshot.py) and a checkpoint.

From the pieces and the layout, without the model (it exists only inside fn):
- `as_dtensors`: the state as DTensors over this group's mesh again, for ctx.state:
  `model.load_state_dict` and `optimizer.load_state_dict` take them as they gave them;
- `joined` and `cut`: every old rank's pieces put back together (a re-shard onto
  another world size), and this rank's piece cut from them;
- `to_checkpoint`, `template` and `from_checkpoint`: the tensors by number, as a sharded
  checkpoint (torch.distributed.checkpoint, which re-shards on load) writes them, and the
  rest of the state (its structure and plain values) in the checkpoint's plain part;
- `resolve`: a state handed over to a loop (a snapshot, every rank's for a re-shard, a
  sharded checkpoint's URI) as the loop's state_dict gives it.

Plain torch; no Ray.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ...checkpoint import to_cpu
from ...contract import Reshard, Snapshot
from ...errors import ConfigError, TaskError
from ..state.reshard import chunk

# [[path of keys], [global shape], [global stride], dtype name, shard dim or None], per tensor
Layout = list[list[Any]]


def take(state: dict[str, Any]) -> tuple[dict[str, Any], Layout]:
    """This rank's host copy of a report's state dicts (a DTensor's local piece, on CPU),
    and their layout."""
    layout: Layout = []

    def visit(path: tuple, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        layout.append([list(path), list(value.shape), list(value.stride()),
                       str(value.dtype).removeprefix("torch."), _shard_dim(value, path)])
        return to_cpu(value)

    return _map(state, visit), layout


def as_dtensors(held: dict[str, Any], layout: Layout, mesh: Any, clone: bool = True) -> dict[str, Any]:
    """`held` (this rank's pieces) with each sharded tensor a DTensor over `mesh` again,
    the others as they are; each tensor a copy where `clone` (what fn trains must not
    change the copy held)."""
    from torch.distributed.tensor import DTensor, Shard

    sharded = _sharded(layout)
    world, rank = mesh.size(), mesh.get_local_rank()

    def visit(path: tuple, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        value = value.clone() if clone else value
        if path not in sharded:
            return value
        shape, stride, dim = sharded[path]
        expected = chunk(torch.empty(shape, device="meta"), dim, world, rank).shape
        if value.shape != expected:
            raise ValueError(f"state{_name(path)}: a piece of shape {tuple(value.shape)} where rank {rank} of "
                             f"{world} holds {tuple(expected)} of {tuple(shape)}")
        return DTensor.from_local(value, mesh, [Shard(dim)], shape=torch.Size(shape), stride=tuple(stride),
                                  run_check=False)

    return _map(held, visit)


def joined(parts: list[dict[str, Any]], layout: Layout) -> dict[str, Any]:
    """Every old rank's pieces (by old rank) put back together: each sharded tensor whole,
    the rest rank 0's."""
    sharded = _sharded(layout)

    def visit(path: tuple, value: Any) -> Any:
        if path not in sharded:
            return value
        return torch.cat([_get(part, path) for part in parts], dim=sharded[path][2])

    return _map(parts[0], visit)


def cut(held: dict[str, Any], layout: Layout, world_size: int, rank: int) -> dict[str, Any]:
    """`held` with each sharded tensor that is whole (joined) cut to rank `rank`'s piece of
    `world_size`; a piece already is one."""
    sharded = _sharded(layout)

    def visit(path: tuple, value: Any) -> Any:
        if path not in sharded or list(value.shape) != sharded[path][0]:
            return value
        return chunk(value, sharded[path][2], world_size, rank).clone()

    return _map(held, visit)


def to_checkpoint(held: dict[str, Any], layout: Layout, mesh: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the state without its tensors, its tensors by their number in the layout: the
    sharded ones as DTensors over `mesh`), as a sharded checkpoint saves them."""
    full = as_dtensors(held, layout, mesh, clone=False)
    tensors = {str(i): _get(full, tuple(entry[0])) for i, entry in enumerate(layout)}
    return _map(held, lambda path, value: None if isinstance(value, torch.Tensor) else value), tensors


def template(layout: Layout, mesh: Any) -> dict[str, Any]:
    """Empty tensors of this rank's shape for the tensors of `layout`, to load a sharded
    checkpoint of it into (saved at whatever world size)."""
    world, rank = mesh.size(), mesh.get_local_rank()
    empty = [torch.empty(chunk(torch.empty(shape, device="meta"), dim, world, rank).shape if dim is not None
                         else shape, dtype=getattr(torch, dtype))
             for _, shape, _, dtype, dim in layout]
    pieces = {str(i): tensor for i, tensor in enumerate(empty)}
    return as_dtensors(pieces, [[[str(i)], *entry[1:]] for i, entry in enumerate(layout)], mesh, clone=False)


def from_checkpoint(skeleton: dict[str, Any], layout: Layout, tensors: dict[str, Any]) -> dict[str, Any]:
    """This rank's pieces, from a sharded checkpoint's tensors (loaded into `template`)."""
    number = {tuple(entry[0]): str(i) for i, entry in enumerate(layout)}
    return _map(skeleton, lambda path, value: to_cpu(tensors[number[path]]) if path in number else value)


# ---------------------------------------------------------------------------- helpers


def _shard_dim(value: torch.Tensor, path: tuple) -> int | None:
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(value, DTensor):
        return None
    placement = value.placements[0]
    if value.device_mesh.ndim != 1 or type(placement) is not Shard:
        raise TaskError(f"ctx.report: state{_name(path)} is a DTensor placed {value.placements} on a "
                        f"{value.device_mesh.ndim}-D mesh; under trainer.strategy fsdp your loop's state is "
                        "what ctx.prepare_model's sharding makes (Shard on a 1-D mesh)")
    return placement.dim


def _sharded(layout: Layout) -> dict[tuple, tuple[list[int], list[int], int]]:
    return {tuple(path): (shape, stride, dim) for path, shape, stride, _, dim in layout if dim is not None}


def _map(tree: Any, fn: Callable[[tuple, Any], Any], path: tuple = ()) -> Any:
    """`tree` rebuilt with each leaf replaced by fn(its path, it)."""
    if isinstance(tree, dict):
        return {k: _map(v, fn, (*path, k)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(v, fn, (*path, i)) for i, v in enumerate(tree))
    return fn(path, tree)


def _get(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _name(path: tuple) -> str:
    return "".join(f"[{key!r}]" for key in path)


def resolve(state: dict[str, Any] | str | Snapshot | Reshard, mesh: Any, strategy: str) -> dict[str, Any]:
    """The state handed over to a loop, as its state_dict() gives it: a peer snapshot of
    its rank's (its own, or the copy its successor held), every old rank's (a re-shard:
    put back together, then cut as it loads), or a sharded checkpoint's URI (read here over
    `mesh`, a collective: every rank reads its pieces). `mesh` None: the loop's state is
    replicated (trainer.strategy `strategy`), and is that already."""
    from ..state.snapshot import load

    if mesh is None and isinstance(state, (str, Snapshot, Reshard)):
        raise ConfigError("the checkpoint to resume from is sharded (trainer.strategy: fsdp) but this run "
                          f"has trainer.strategy={strategy}; resume it with fsdp")
    if isinstance(state, Snapshot):
        return load(state)
    if isinstance(state, Reshard):
        parts = [load(part) for part in state.parts]
        layout = parts[0]["loop"]["layout"]
        return {"loop": parts[0]["loop"], "user": joined([p["user"] for p in parts], layout)}
    if isinstance(state, str):
        from ..state.sharded import checkpoint_location, load_sharded, read_plain

        storage, name = checkpoint_location(state)
        saved = read_plain(storage, name)["loop"]
        if "layout" not in saved:
            return {"loop": saved, "user": None}  # the loop's load_state_dict says what it is
        loaded = load_sharded({"tensors": template(saved["layout"], mesh)}, storage, name)
        return {"loop": saved, "user": from_checkpoint(saved.pop("user"), saved["layout"], loaded["tensors"])}
    return state
