"""Re-sharding the training state from peer snapshots onto another world size.

A fast recovery of sharded state (FSDP) goes on without the lost ranks, and a grow takes
in new ones, without reading storage: every rank of the new group gets every rank's
snapshot of one step from the old group (its own from memory, the others through the
object store), puts each tensor back together and keeps its own part of it under the new
sharding. No collective: each rank cuts its part locally, so a slow rank holds up no one.

Chosen over the alternatives (torch 2.13's source read):
- set_model_state_dict / set_optimizer_state_dict with full_state_dict=True need every
  rank to hold the whole state dict first (what is built here anyway), then call
  distribute_tensor per tensor with its default src_data_rank=0: a scatter from rank 0
  per tensor, hundreds of collectives; broadcast_from_rank0 broadcasts every tensor. Here
  each rank cuts its piece itself (what distribute_tensor's src_data_rank=None does).
- DCP's planner against in-memory state needs a StorageReader over bytes held by other
  processes: the same data movement, with DCP's plan gather on top.
- DTensor.redistribute works within one mesh; the old mesh's processes are partly gone.

Facts it rests on (torch 2.13): FSDP2 shards every parameter (and so the optimizer's
state and the sharded EMA's) with Shard(0) placements on a 1-D mesh, in torch.chunk's
pieces, a rank past the last chunk holding an empty one; a DTensor's to_local() is that
piece, unpadded (snapshot.to_cpu stores it). So the whole tensor is the concatenation of
the old ranks' pieces along the shard dimension, and the new rank's piece is chunk
`rank` of it. Plain tensors and values (buffers, step counters, the loop's position) are
the same on every rank: rank 0's are taken.

Memory: each rank holds the whole state's snapshots while it re-shards (the sum of all
ranks' shards: the model's full size, its optimizer's and EMA's), on host memory.
"""

from __future__ import annotations

from typing import Any

import torch


def reshard(template: Any, parts: list[Any]) -> Any:
    """`template` (this rank's state dict now, in the new group: its structure and shards)
    filled from `parts`, every old rank's snapshot of one step, by old rank. A DTensor's
    local shard is filled in place with its piece of the whole tensor; other tensors and
    values come from rank 0's snapshot. Follow with load_state_dict, as after restore."""
    if not parts:
        raise ValueError("no snapshot to re-shard from")
    return _fill(template, parts, "state")


def _fill(template: Any, parts: list[Any], where: str) -> Any:
    first = parts[0]
    if isinstance(template, dict) and isinstance(first, dict):
        for r, p in enumerate(parts):
            if not isinstance(p, dict) or p.keys() != template.keys():
                got = sorted(p, key=str) if isinstance(p, dict) else type(p).__name__
                raise ValueError(f"{where}: rank {r}'s snapshot holds {got}, the state "
                                 f"{sorted(template, key=str)}")
        return {k: _fill(template[k], [p[k] for p in parts], f"{where}.{k}") for k in template}
    if isinstance(template, (list, tuple)) and isinstance(first, (list, tuple)) and len(template) == len(first):
        return type(template)(_fill(t, [p[i] for p in parts], f"{where}[{i}]") for i, t in enumerate(template))
    if isinstance(template, torch.Tensor) and isinstance(first, torch.Tensor):
        piece = _piece(template, parts, where) if hasattr(template, "to_local") else first
        local = template.to_local() if hasattr(template, "to_local") else template
        if local.shape != piece.shape:
            raise ValueError(f"{where}: a re-sharded piece of shape {tuple(piece.shape)} does not fit this "
                             f"rank's {tuple(local.shape)}")
        with torch.no_grad():
            local.copy_(piece)
        return template
    return first


def _piece(template: Any, parts: list[torch.Tensor], where: str) -> torch.Tensor:
    """This rank's piece of the whole tensor the old ranks' `parts` make up, cut as
    `template` (a DTensor of the new group) is."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = template.device_mesh, template.placements
    if mesh.ndim != 1:
        raise ValueError(f"{where}: re-sharding from peer snapshots supports a 1-D mesh (FSDP over one group of "
                         f"ranks); this state's is {mesh.ndim}-D: set failure.recovery=exact")
    placement = placements[0]
    if isinstance(placement, Replicate):
        return parts[0]
    if type(placement) is not Shard:  # a _StridedShard or a custom placement: not torch.chunk's pieces
        raise ValueError(f"{where}: re-sharding from peer snapshots supports Shard placements, not {placement}: "
                         "set failure.recovery=exact")
    dim = placement.dim
    whole = torch.cat(parts, dim=dim)
    if whole.shape != template.shape:
        raise ValueError(f"{where}: the snapshots' pieces make up a tensor of shape {tuple(whole.shape)}, "
                         f"the state's is {tuple(template.shape)}")
    return chunk(whole, dim, mesh.size(), mesh.get_local_rank())


def chunk(whole: torch.Tensor, dim: int, world_size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s piece of `whole` sharded along `dim` over `world_size` ranks, as FSDP2
    cuts it: torch.chunk's piece, or an empty one for a rank past the last chunk."""
    chunks = torch.chunk(whole, world_size, dim=dim)
    if rank < len(chunks):
        return chunks[rank]
    shape = list(whole.shape)
    shape[dim] = 0
    return whole.new_empty(shape)
