"""Process group setup and teardown, device choice, small collectives.

Plain torch.distributed; Ray is not imported here.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket

import torch
import torch.distributed as dist

from . import _internals


def choose_backend(setting: str, use_gpu: bool) -> str:
    if setting != "auto":
        return setting
    return "nccl" if use_gpu and torch.cuda.is_available() else "gloo"


def use_worker_cpus(resources_per_worker: dict[str, float] | None) -> None:
    """A CPU worker's intra-op threads: its CPUs (resources_per_worker, default 1), as Ray
    sets OMP_NUM_THREADS for an actor that asks for them. A spare (it asks for none) would
    otherwise take every core of the node from the training workers, as would a CPU worker
    pinned beside its slot (driver/group/actors.start_worker)."""
    _worker_cpus[0] = float((resources_per_worker or {}).get("CPU", 1))
    torch.set_num_threads(max(1, int(_worker_cpus[0])))


_worker_cpus = [1.0]


def worker_cpus() -> float:
    """The CPUs a worker of this run holds in its slot (use_worker_cpus)."""
    return _worker_cpus[0]


def choose_device(use_gpu: bool) -> torch.device:
    if not use_gpu:
        return torch.device("cpu")
    # Ray sets CUDA_VISIBLE_DEVICES to this worker's GPU(s), so its GPU is cuda:0.
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    return device


# The store rank 0 hosts for the next group it forms (host_store), until init_group uses it.
_hosted: dist.TCPStore | None = None


def host_store(addr: str, timeout_s: float) -> int:
    """Start the next group's store here (rank 0), listening now on a port the OS picks;
    return the port. The other ranks are asked to join only after this returns: a TCPStore
    client that finds no server yet retries after a backoff, which added 0.25 to 0.6 s to
    forming a group (2 and 3 Gloo ranks, torch 2.13) whenever a peer came
    before rank 0 had started the store inside init_process_group."""
    global _hosted, _hosted_sockets
    before = _sockets()
    _hosted = dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False,
                            timeout=datetime.timedelta(seconds=timeout_s))
    _hosted_sockets = _opened_since(before)  # its own client's connection: the forming's too
    return _hosted.port


def init_group(rank: int, world_size: int, addr: str, port: int, backend: str, timeout_s: float) -> None:
    """Join a process group whose store rank 0 hosts at addr:port (host_store: a new port,
    so a fresh store, for every group formed). `timeout_s` bounds every collective."""
    global _hosted
    if dist.is_initialized():
        leave_group(failed=True)
    # With no group left in this process, the next one is its first: name it as a new
    # process does (after a failed init torch would not; see _internals).
    if not dist.is_initialized():
        _internals.reset_group_count()
    # The flight recorder keeps the last collectives of each rank (Gloo and NCCL), dumped
    # beside the stacks of a hung worker. NCCL: on an error or a timeout the watchdog
    # aborts the communicators and the collective raises, but it never kills the process
    # (2: CleanUpOnly; torch's default 3 would take the survivor's state with it).
    recorder = "TORCH_FR_BUFFER_SIZE" if _internals.records_gloo_collectives() else "TORCH_NCCL_TRACE_BUFFER_SIZE"
    os.environ.setdefault(recorder, str(FLIGHT_RECORDER_ENTRIES))
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    timeout = datetime.timedelta(seconds=timeout_s)
    hosted, _hosted = _hosted, None  # not kept listening for a group it does not serve
    _group_sockets.clear()
    with _forming(keep=backend == "gloo"):
        if rank == 0 and hosted is not None and hosted.port == port:
            store = hosted  # the group keeps it alive from here
        else:  # rank 0 hosts it now if it did not already (callers that skip host_store)
            store = dist.TCPStore(addr, port, world_size, is_master=rank == 0, timeout=timeout,
                                  wait_for_workers=False)
        # NCCL: the communicator forms here, in the forming (abortable, a failure in it a
        # forming's), not in the first collective of a step; and a barrier() in your own
        # loop knows its device (without it torch warns "barrier(): using the device under
        # current context": seen in the Lightning example on an H100).
        device_id = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device_id)
    # What torchrun sets, for code that reads it (your own loop's Hugging Face Trainer,
    # accelerate, Lightning): this group's store is the rendezvous they would have used.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=addr, MASTER_PORT=str(port))


def new_gloo_group():
    """A Gloo group over every rank (collective), whose connections leaving a failed
    group closes too (see leave_group)."""
    with _forming(keep=True):
        return dist.new_group(backend="gloo")


# The connected sockets this process opened while forming its Gloo groups (its pairs to
# every peer, its store connection): fd -> "socket:[inode]", the inode telling a reused fd.
_group_sockets: dict[int, str] = {}
# While a group forms: the sockets this process had before (the ones opened since are the
# forming's: its store connection, its pairs), so that abort_group can end a rendezvous
# that waits for a peer lost meanwhile.
_forming_before: dict[int, str] | None = None
_hosted_sockets: dict[int, str] = {}


def _sockets() -> dict[int, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:"):
                out[int(fd)] = link
    return out


@contextlib.contextmanager
def _forming(keep: bool):
    """Forming a group: the sockets opened inside the block are the forming's, and with
    `keep` the group's, once formed. Other threads of this process (Ray's) rarely open one
    in that window; closing one by mistake, at a failure, costs at worst a reconnect."""
    global _forming_before
    before = _forming_before = _sockets() if os.path.isdir("/proc/self/fd") else None
    try:
        yield
    finally:
        global _hosted_sockets
        _forming_before, _hosted_sockets = None, {}
        if keep and before is not None:
            _group_sockets.update(_opened_since(before))


def _opened_since(before: dict[int, str]) -> dict[int, str]:
    return {fd: link for fd, link in _sockets().items() if before.get(fd) != link}


def _close_group_sockets() -> int:
    """Shut down this process's connections to its Gloo peers. A peer waiting in a collective
    on this process (not on the one that died) waits until failure.collective_timeout_s
    otherwise: aborting the group here leaves them open when async work was pending (3
    Gloo ranks, two async all-reduces and a small one per step, one SIGKILLed at a random
    moment: a survivor waited out the timeout in 4 of 16 trials with the abort alone, in
    none of 32 with this first), and nothing on the waiting side unblocks it (torch 2.13).
    Once its sockets close, the peer's collective fails at once and it closes its own, so
    a failure reaches every rank in milliseconds. Listening sockets are left alone: Gloo's
    listener thread aborts the process when its socket is shut down."""
    closed = _shut_down(_group_sockets)
    _group_sockets.clear()
    return closed


def _shut_down(sockets: dict[int, str]) -> int:
    """Shut down the connected ones of `sockets` (fd -> link) still open; how many."""
    closed = 0
    for fd, link in list(sockets.items()):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") != link:
                continue  # closed since (by the group itself), its number reused
            sock = socket.socket(fileno=os.dup(fd))
            try:
                if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    sock.shutdown(socket.SHUT_RDWR)
                    closed += 1
            finally:
                sock.close()
    return closed


FLIGHT_RECORDER_ENTRIES = 2000


_ABORTED: list[dist.ProcessGroup] = []  # groups left after a failure (leave_group)


def groups_left() -> bool:
    """Whether this process still holds a process group: the one it is in, or one it left
    after a failure (aborted and kept, never destroyed: leave_group)."""
    return dist.is_initialized() or bool(_ABORTED)


def leave_group(failed: bool = False) -> None:
    """Leave the process group. After a failure the group is aborted, never destroyed:
    destroying it blocks while a collective is pending, on NCCL when a peer is gone, and
    on Gloo too while a peer still waits in a collective (measured, torch 2.13); and its
    Gloo connections are shut down, so that such a peer fails now too."""
    if not dist.is_initialized():
        _group_sockets.clear()
        return
    if failed:
        # Kept, never destroyed: what still references the group (DDP's reducer, in the
        # frames of the exception that brought us here) lets go of it later, on this
        # thread, holding the GIL, and ProcessGroupGloo's destructor then joins its worker
        # threads; one of them may be finishing a collective whose tensors need the GIL to
        # be freed: a deadlock (seen with py-spy, a Hugging Face Trainer's all_gather of
        # its loss, about one kill in fifteen). A few idle threads per failure instead.
        _ABORTED.append(dist.group.WORLD)
        _close_group_sockets()  # first: the abort does not always close them
        _internals.abort_process_group()
    else:
        _group_sockets.clear()
        dist.destroy_process_group()


def abort_group() -> bool:
    """Make a collective blocked on a lost peer raise now, from another thread: NCCL's
    communicators are aborted; Gloo's connections are shut down (its abort() does not
    unblock a pending collective). A group being formed: the connections opened for it are
    shut down, so that a rendezvous waiting for a peer lost meanwhile fails now rather than
    at failure.collective_timeout_s. Whether there was a group to abort."""
    before = _forming_before
    if before is not None:
        return _shut_down({**_hosted_sockets, **_opened_since(before)}) > 0
    if not dist.is_initialized():
        return False
    if dist.get_backend() == "nccl":
        _internals.abort_process_group()
        return True
    return _close_group_sockets() > 0


def flight_record() -> bytes | None:
    """The flight recorder's JSON dump of this process's recent collectives, if any."""
    dump = _internals.flight_recorder_dump()
    try:
        return dump() if dump is not None else None
    except RuntimeError:
        return None


def all_reduce_sum(tensor: torch.Tensor, async_op: bool = False):
    """Sum `tensor` over ranks in place (a no-op alone); with async_op, return the work
    handle to wait on (None when there is nothing to wait for), else the tensor."""
    work = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=async_op)
    return work if async_op else tensor

