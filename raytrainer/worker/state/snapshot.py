"""Peer snapshots: sharded training state kept in host RAM, on its rank and on a peer.

With sharded state (FSDP) a lost rank's shards exist on no survivor. Every
failure.snapshot_every_n_steps optimizer steps (and at the first step boundary of every
group formed; `auto`: every interval that keeps them to AUTO_BUDGET of the training time,
below) each rank copies its state to host memory, on the training thread (the
state must be that of one step), and hands it to a background thread that serialises it
and exchanges it around a ring on a Gloo group of its own: rank r sends its snapshot to
r + 1 and keeps r - 1's. When ranks are lost, the survivors load their own snapshot of a
step, each replacement the copy its successor holds, and the run replays the steps since
(the data position and the random streams are functions of the step): nothing is read
from storage and the weights end as an undisturbed run's. A rank lost together with the
peer holding its copy leaves a checkpoint as the only way back.

Each rank keeps its own snapshot and its predecessor's of the newest step, and those of
the step before until the newer exchange has completed both ways on this rank: a failure
in the middle of an exchange still finds one step that every survivor and every lost
rank's holder has (policy.choose_snapshot). Host memory: twice the rank's state between
snapshots, up to four times during an exchange (see `needed_bytes`).

Plain torch; no Ray. The exchange is one collective per snapshot on its own group, in
the same order on every rank: every rank snapshots at the same steps.

`auto` (the default): a run replays up to an interval of steps after a loss, and pays for
every snapshot while nothing fails, so the interval is the shortest whose snapshots cost
about AUTO_BUDGET of the time. Each snapshot's exchange ends with an all-reduce (MAX) of what
it cost this rank (the copy, which holds the training thread, and the CPU time of the
background thread's serialising and exchange: its waits for the peer cost nothing) and of
the seconds per step since the snapshot before; the group's means of those agreed pairs
(`agreed`) are the same on every rank, and so is the interval the next snapshot computes
from them (config.failure.auto_interval). A group's first intervals, before a step time is
measured in it, are AUTO_FIRST steps.
"""

from __future__ import annotations

import io
import os
import threading
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from ...checkpoint import to_cpu
from ...config.failure import AUTO, AUTO_FIRST, auto_interval
from ...contract import Holdings, Snapshot
from ...errors import ConfigError
from ..dist import new_gloo_group


class AutoInterval:
    """The `auto` interval between copies of the state: from the copies' measured costs and
    step times, which the ranks have agreed on (`agree`: the same values on every rank), the
    interval config.failure.auto_interval gives; AUTO_FIRST steps until one is measured. A
    Task's peer snapshots use it, and your own loop's reports with state (ctx.state_due)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Measure anew (a new group: its ranks agree on what they measure in it)."""
        self.every, self.next = AUTO_FIRST, 0
        self.agreed: tuple[float, float] | None = None  # the means of the agreed (cost s, s per step)
        self._since: tuple[int, float] | None = None  # (step, time) of the last copy
        self._sums = (0.0, 0.0, 0)

    def due(self, step: int) -> bool:
        return step >= self.next

    def taken(self, step: int, now: float) -> tuple[float, int | None]:
        """A copy at `step` (time `now`): the seconds per step since the last one (0.0 for
        the first), and the interval before it where the agreed measures changed it."""
        before = self.every
        if self.agreed is not None:  # up to the previous copy's: the same on every rank
            self.every = auto_interval(self.every, *self.agreed)
        step_s = 0.0
        if self._since is not None and step > self._since[0]:
            step_s = (now - self._since[1]) / (step - self._since[0])
        self._since, self.next = (step, now), step + self.every
        return step_s, before if self.every != before else None

    def agree(self, cost_s: float, step_s: float) -> None:
        """What one copy cost and the step time before it, as the ranks agreed them."""
        if step_s <= 0:  # no step time: a group's first copy
            return
        costs, steps_s, n = self._sums
        self._sums = (costs + cost_s, steps_s + step_s, n + 1)
        self.agreed = (self._sums[0] / (n + 1), self._sums[1] / (n + 1))


class PeerSnapshots:
    """A worker's snapshots. It outlives the loop and the process group they were taken in,
    so that a survivor can go back after the group it trained in is gone; from the end of
    a run (`close`) to the next group (`bind`) nothing changes them."""

    def __init__(self, every_n_steps: int | str):
        self.auto = every_n_steps == AUTO
        self.every = AUTO_FIRST if self.auto else int(every_n_steps)  # the interval in use (0: none)
        self.rank, self.world = 0, 1  # in the group snapshots are taken in now
        # The (rank, world size) of the group the kept snapshots were taken in: until the
        # first exchange in a new group, they are those of the group before, which a
        # recovery of a re-formed group that failed to form may still need.
        self.layout = (0, 1)
        self.own: dict[int, bytes] = {}  # step -> this rank's state
        self.peer: dict[int, torch.Tensor] = {}  # step -> rank - 1's (bytes, as a uint8 tensor)
        self._group = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._taken: int | None = None  # the step last snapshotted in the current group
        self._gen = 0  # which group's thread may still change what is kept
        self._lock = threading.Lock()
        # auto: from the group's (cost s, s per step) of each snapshot, the most of any rank
        self.interval = AutoInterval()

    @property
    def agreed(self) -> tuple[float, float] | None:
        return self.interval.agreed

    # ------------------------------------------------------------------ in a group

    def bind(self, rank: int, world_size: int) -> None:
        """Snapshot in a newly formed group (collective: makes the ring's Gloo group). The
        first snapshot comes at the first step boundary; what earlier groups left stays
        until it is exchanged."""
        with self._lock:
            self._gen += 1
        self.rank, self.world = rank, world_size
        self._group = new_gloo_group() if dist.is_initialized() and world_size > 1 else None
        self._thread, self._error, self._taken = None, None, None
        if self.auto:  # measured anew in each group: its ranks agree on what they measured
            self.interval.reset()
            self.every = self.interval.every

    def due(self, step: int) -> bool:
        """At the first step boundary in a group (but step 0: a fresh optimizer has no state
        to copy, and nothing is lost going back to the start), then every `every` steps
        (auto: `every` after the last one)."""
        if self.every <= 0 or step == self._taken or step == 0:
            return False
        if self._taken is None:
            return True
        return self.interval.due(step) if self.auto else step % self.every == 0

    def take(self, step: int, state: dict[str, Any]) -> dict[str, Any] | None:
        """Snapshot `state` (the state after `step`): copied to host memory now, serialised
        and exchanged in the background. Waits for the previous exchange first (it has had
        `every` steps to finish) and raises its error, if any. Returns the event of an
        interval auto changed (for rank 0 to log), else None."""
        self.wait()
        fresh, self._taken = self._taken is None, step
        started = time.perf_counter()
        step_s, event = 0.0, None
        if self.auto:
            step_s, changed = self.interval.taken(step, started)
            self.every = self.interval.every
            if changed is not None:
                event = interval_event(step, self.interval)
        host = to_cpu(state)
        self._thread = threading.Thread(target=self._exchange,
                                        args=(self._gen, step, host, fresh, time.perf_counter() - started, step_s),
                                        daemon=True, name=f"raytrainer-snapshot-{step}")
        self._thread.start()
        return event

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _exchange(self, gen: int, step: int, host: dict[str, Any], fresh: bool, copy_s: float = 0.0,
                  step_s: float = 0.0) -> None:
        started = time.thread_time()  # this thread's CPU: the exchange's waits cost nothing
        try:
            buffer = io.BytesIO()
            torch.save(host, buffer)
            del host  # at most two copies at a time while serialising
            data = buffer.getvalue()
            del buffer
            with self._lock:
                if gen != self._gen:
                    return
                if self.layout != (self.rank, self.world):  # the old group's: another layout
                    self.own, self.peer, self.layout = {}, {}, (self.rank, self.world)
                if fresh:  # snapshots beyond this step came before a recovery to an earlier one
                    self.own = {s: d for s, d in self.own.items() if s < step}
                    self.peer = {s: d for s, d in self.peer.items() if s <= step}
                self.own[step] = data
            received = _ring_exchange(data, self.rank, self.world, self._group) if self._group else None
            measured = None
            if self.auto:  # right after the exchange, on every rank that made it
                measured = torch.tensor([copy_s + time.thread_time() - started, step_s], dtype=torch.float64)
                if self._group is not None:
                    dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=self._group)
            with self._lock:
                if gen != self._gen:
                    return
                if received is not None:
                    self.peer[step] = received
                # Both ways done on this rank: the older steps are no longer needed here.
                self.own = {s: d for s, d in self.own.items() if s >= step}
                self.peer = {s: d for s, d in self.peer.items() if s >= step}
                if measured is not None:
                    self.interval.agree(float(measured[0]), float(measured[1]))
        except BaseException as exc:  # noqa: BLE001 - raised on the training thread at the next take
            if gen == self._gen:
                self._error = exc

    def keep(self, step: int, state: dict[str, Any]) -> None:
        """Keep this rank's own snapshot of `step` now, on the calling thread, with no
        exchange: the state a group paused for a grow is re-sharded from (reshard.py), every
        rank alive to give its own."""
        self.wait()
        data = _serialise(to_cpu(state))
        with self._lock:
            if self.layout != (self.rank, self.world):
                self.own, self.peer, self.layout = {}, {}, (self.rank, self.world)
            self.own[step] = data
        self._taken = step

    def close(self) -> None:
        """The run in this group is over (finished, or interrupted by a failure): an
        exchange under way no longer changes what is kept (its thread is a daemon; it ends
        with the group)."""
        with self._lock:
            self._gen += 1
        self._thread, self._group = None, None

    # ------------------------------------------------------------------ after a failure

    def holdings(self) -> Holdings:
        with self._lock:
            return Holdings(*self.layout, tuple(sorted(self.own)), tuple(sorted(self.peer)))

    def own_snapshot(self, step: int) -> Snapshot:
        with self._lock:
            data = self.own.get(step)
        if data is None:
            raise KeyError(f"rank {self.layout[0]} holds no snapshot of step {step}")
        return Snapshot(step, self.layout[0], data)

    def peer_snapshot(self, step: int) -> Snapshot:
        """The copy of rank - 1's snapshot of `step`, for that rank's replacement."""
        with self._lock:
            data = self.peer.get(step)
            rank, world = self.layout
        if data is None:
            raise KeyError(f"rank {rank} holds no copy of rank {(rank - 1) % world}'s snapshot of step {step}")
        return Snapshot(step, (rank - 1) % world, data.numpy().tobytes())


def interval_event(step: int, interval: AutoInterval) -> dict[str, Any]:
    """The driver's record of an interval `auto` chose (events.jsonl)."""
    cost_s, step_s = interval.agreed
    return {"event": "snapshot_interval", "step": step, "steps": interval.every, "cost_s": round(cost_s, 4),
            "step_s": round(step_s, 4)}


def load(snapshot: Snapshot) -> dict[str, Any]:
    return torch.load(io.BytesIO(snapshot.data), weights_only=True)


def restore(template: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    """`template` (this rank's state dict now, for its structure, devices and shards) with
    the values of `saved` (a snapshot of the same rank at the same world size): tensors are
    filled in place (a DTensor's local shard), other values replaced. Follow with
    load_state_dict, as after a sharded checkpoint's load."""
    if isinstance(template, dict) and isinstance(saved, dict):
        if template.keys() != saved.keys():
            raise ValueError(f"the snapshot's keys {sorted(saved, key=str)} differ from the state's "
                             f"{sorted(template, key=str)}")
        return {k: restore(template[k], saved[k]) for k in template}
    if isinstance(template, (list, tuple)) and isinstance(saved, (list, tuple)) and len(template) == len(saved):
        return type(template)(restore(t, s) for t, s in zip(template, saved))
    if isinstance(template, torch.Tensor) and isinstance(saved, torch.Tensor):
        local = _local(template)
        if local.shape != saved.shape:
            raise ValueError(f"a snapshot tensor of shape {tuple(saved.shape)} does not fit this rank's "
                             f"{tuple(local.shape)}")
        with torch.no_grad():
            local.copy_(saved)
        return template
    return saved


def estimate_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer, ema: Any = None) -> int:
    """Bytes of a snapshot of this rank's state, before training: its parameters and
    buffers (shards), the optimizer's state (before its first step, taken as two values
    per parameter, as Adam keeps), and the EMA's."""
    params = state_bytes(list(module.parameters()))
    optim = state_bytes(dict(optimizer.state)) or 2 * params
    return (params + state_bytes(list(module.buffers())) + optim
            + (state_bytes(ema.state_dict()) if ema is not None else 0))


def state_bytes(state: Any) -> int:
    """Bytes of the tensors `state` holds on this rank (a DTensor's local shard)."""
    total = 0

    def visit(v: Any) -> None:
        nonlocal total
        if isinstance(v, torch.Tensor):
            local = _local(v)
            total += local.numel() * local.element_size()
        elif isinstance(v, dict):
            for x in v.values():
                visit(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)

    visit(state)
    return total


# Copies of a rank's state in its host memory at most: its own and its peer's, of two steps
# while one is exchanged (and the serialised form of one while it is made).
COPIES = 4


def check_memory(state_bytes_per_rank: int, ranks_here: int, setting: str,
                 available: int | None = None) -> None:
    """Fail now (a ConfigError naming `setting`) when the snapshots of the `ranks_here`
    ranks on this machine cannot fit in its available memory; warn above half of it."""
    available = available if available is not None else available_memory()
    if available is None:
        return
    need = COPIES * state_bytes_per_rank * ranks_here
    text = (f"peer snapshots need up to {need / 2**30:.2f} GiB of host memory here ({COPIES} copies of "
            f"{state_bytes_per_rank / 2**20:.1f} MiB of sharded state per rank, {ranks_here} rank(s) on "
            f"this machine), and {available / 2**30:.2f} GiB is available")
    if need > available:
        raise ConfigError(f"{text}. Set {setting}=0 to recover from checkpoints only, or shard over "
                          "more workers")
    if need > available / 2:
        warnings.warn(f"{text}: over half of it. {setting}=0 turns peer snapshots off", stacklevel=2)


def available_memory() -> int | None:
    """MemAvailable of this machine (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def ranks_on_this_machine(group=None) -> int:
    """How many ranks of the default group share this machine (collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 1
    names: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, os.uname().nodename, group=group)
    return names.count(os.uname().nodename)


# ---------------------------------------------------------------------------- helpers


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _serialise(host: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(host, buffer)
    return buffer.getvalue()


def _ring_exchange(data: bytes, rank: int, world: int, group) -> torch.Tensor:
    """Send `data` to rank + 1 and return what rank - 1 sent (sizes first, then bytes)."""
    to, frm = (rank + 1) % world, (rank - 1) % world
    size_out = torch.tensor([len(data)], dtype=torch.int64)
    size_in = torch.empty(1, dtype=torch.int64)
    _pair(size_out, size_in, to, frm, group)
    with warnings.catch_warnings():  # read only: torch warns that the buffer is not writable
        warnings.simplefilter("ignore")
        out = torch.frombuffer(data, dtype=torch.uint8)
    got = torch.empty(int(size_in), dtype=torch.uint8)
    _pair(out, got, to, frm, group)
    return got


def _pair(send: torch.Tensor, recv: torch.Tensor, to: int, frm: int, group) -> None:
    works = [dist.isend(send, dist.get_global_rank(group, to), group=group),
             dist.irecv(recv, dist.get_global_rank(group, frm), group=group)]
    for work in works:
        work.wait()

