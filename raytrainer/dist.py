"""Process group setup and teardown, device choice, small collectives.

Plain torch.distributed; Ray is not imported here.
"""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist


def choose_backend(setting: str, use_gpu: bool) -> str:
    if setting != "auto":
        return setting
    return "nccl" if use_gpu and torch.cuda.is_available() else "gloo"


def choose_device(use_gpu: bool) -> torch.device:
    if not use_gpu:
        return torch.device("cpu")
    # Ray sets CUDA_VISIBLE_DEVICES to this worker's GPU(s), so its GPU is cuda:0.
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    return device


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_group(rank: int, world_size: int, addr: str, port: int, backend: str,
               timeout_s: float = 1800.0) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor, async_op: bool = False):
    """Sum `tensor` over ranks in place (a no-op alone); with async_op, return the work
    handle to wait on (None when there is nothing to wait for), else the tensor."""
    work = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=async_op)
    return work if async_op else tensor

