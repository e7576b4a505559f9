"""The typed contract between the two sides: what the driver's controller asks of a worker
group and what it gets back (`WorkerGroup`), and the worker actor the group drives
(`WORKER_ACTOR`, the calls of `WorkerActor`). No Ray and no torch here: driver.group is the
production group, tests drive the controller with a fake one.

The driver and worker packages import each other only through this module and the shared
ones (config, task, errors, ...); tests/test_layout.py checks it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from .checkpoint import CheckpointRef

Phase = Literal["setup", "user", "framework", "collective"]
"""Where a worker's training thread is: building the task, in the task's code (or its
data), in ours, or waiting for its peers in a collective."""
Forming = Literal["preparing", "joining", "joined", None]
"""Where a worker's call forming a group is (Status.forming)."""


Resume = tuple[int, str, CheckpointRef]
"""A checkpoint to start from: (its step, its name, where it is and its manifest). The
workers read and verify it; the driver never holds its state."""


@dataclass(frozen=True)
class Node:
    """Where a worker runs."""

    ip: str
    hostname: str = ""
    node_id: str = ""
    pid: int = 0
    gpu_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Status:
    """A worker's progress, answered on its control channel while it trains."""

    step: int
    """Optimizer steps completed."""
    progress: int
    """Micro-batches and validation batches done: it moves while the worker works."""
    phase: Phase
    after_pending: bool = False
    """The work after `step` (validation, logging, checkpoint) is not done yet."""
    forming: Forming = None
    """Where its call forming a group is: before the group's rendezvous (building the task,
    loading the state), in it (waiting for its peers to arrive), or past it; None: no
    such call running."""
    busy_s: float | None = None
    """Seconds its working thread (the one that forms the group and trains) has run or
    waited for a core to run (worker/busy.py): it moves while the worker works, however
    slowly a loaded machine lets it, and stands still while it waits on anything else (a
    stuck read, a hung kernel, a peer); None where it cannot be read."""

    @property
    def position(self) -> tuple[int, bool]:
        """How far its state is: a later step, or the same step with its work done."""
        return self.step, not self.after_pending


@dataclass(frozen=True)
class Holdings:
    """Which peer snapshots a worker holds of a sharded state (see snapshot.py), answered
    to the driver after a failure."""

    rank: int
    world_size: int
    own: tuple[int, ...]
    """Steps of its own snapshots."""
    peer: tuple[int, ...]
    """Steps of its copies of rank - 1's snapshots (mod world_size)."""


@dataclass(frozen=True)
class Snapshot:
    """What a worker loads to go on from a peer snapshot: rank `rank`'s state after `step`.
    `data`: the torch.save'd state of its shards (the copy a peer held), or None for the
    worker's own snapshot of `step`."""

    step: int
    rank: int
    data: bytes | None = None


@dataclass(frozen=True)
class Reshard:
    """What a worker loads to go on from the peer snapshots of `step` at another world size
    (sharded state, after a fast recovery or for a grow): every rank's snapshot of the group
    they were taken in, by that group's rank. Each part is a Snapshot without data (this
    worker's own, in its memory) or a reference to a Snapshot in the object store, which
    the worker fetches itself: the driver never holds the bytes."""

    step: int
    parts: tuple[Any, ...]


@dataclass(frozen=True)
class CopiedState:
    """What a worker loads to take a survivor's state on that survivor's node: the copy it
    wrote in the node's shared memory (STATE_COPIES' `read(name)`), of `step`. The bytes
    pass through no object store and no socket."""

    name: str
    step: int


@dataclass(frozen=True)
class Failure:
    rank: int
    kind: Literal["died", "hung", "error", "interrupted"]
    """died: the process or its node is gone; hung: no progress, killed by the driver;
    error: the worker's code raised; interrupted: a collective failed under it because
    a peer failed (a consequence, not a cause)."""
    cause: str
    step: int | None = None
    """The last step this worker completed, where known."""
    node: str | None = None
    error: BaseException | None = None
    """For `error`: what the worker raised (a WorkerError with its traceback, or ours)."""

    @property
    def error_type(self) -> str:
        return self.cause.partition(":")[0]


@dataclass(frozen=True)
class RunEnd:
    """How a worker's run() ended, other than by raising."""

    status: Literal["finished", "interrupted", "paused"]
    step: int
    after_pending: bool = False
    cause: str = ""
    """interrupted: the collective error that stopped it."""
    time: float = 0.0
    """paused: when it stopped (time.time())."""
    stop_reason: str | None = None
    model_uri: str | None = None
    """finished, on rank 0: where it wrote the final weights (model.pt, in run storage)."""


@dataclass
class Poll:
    rows: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # from workers, e.g. checkpoints
    done: bool = False
    result: RunEnd | None = None  # rank 0's end once every worker finished
    failures: list[Failure] = field(default_factory=list)  # workers whose run() ended otherwise
    finished: dict[int, RunEnd] = field(default_factory=dict)  # rank -> newly finished
    paused: dict[int, RunEnd] = field(default_factory=dict)  # rank -> newly paused (a resize)


@dataclass(frozen=True)
class Formed:
    """A group formed from scratch (at the start, or from a checkpoint)."""

    nodes: list[Node]
    total_steps: int | None = None
    steps_per_epoch: int | None = None
    replicated: bool = True
    """Every worker holds the whole training state (the strategy's answer): survivors of a
    failure can give it to the others. Sharded state restarts from a checkpoint instead."""

    @property
    def world_size(self) -> int:
        return len(self.nodes)


@dataclass(frozen=True)
class Reformed:
    """A group re-formed after a failure or a pause, with the state of `source`."""

    step: int
    nodes: list[Node]
    source: int | None
    """The rank (before the re-form) whose state every worker now has; None: the state
    was one kept from an earlier attempt of this recovery (`state_from`)."""
    state_from: Literal["memory", "object_store", "copy", "checkpoint", "peers"] = "memory"
    replaced: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    moved: list[int] = field(default_factory=list)
    """Ranks that left a draining node for a replacement on another node (not in
    `replaced`, which are lost workers' replacements; those with no replacement are in
    `dropped`)."""
    added: int = 0
    resynced: list[int] = field(default_factory=list)
    snapshot_step: int | None = None
    """state_from "peers": the step of the snapshots every worker went back to."""
    peers: dict[int, int] = field(default_factory=dict)
    """state_from "peers": lost rank -> the rank whose copy of its snapshot it took."""
    secured: Literal["object_store", "copy", "holders"] | None = None
    """Replicated state: where its second copy was as the group re-formed: the object store
    (a worker took it from there), the lone holder's copy beside it, or two holders or more."""

    @property
    def world_size(self) -> int:
        return len(self.nodes)


@dataclass(frozen=True, kw_only=True)
class ReformPlan:
    """How the group is to re-form (`WorkerGroup.reform`), after a failure or a pause; the
    controller builds it, the group carries it out. Ranks as the group numbers them now."""

    dead: tuple[int, ...] = ()
    """Ranks gone: each gets a ready spare, else a new worker, waited for (unless in `regrow`)."""
    leave: tuple[int, ...] = ()
    """Ranks alive on a draining node (or a slow worker moved): each gives way to the
    replacement started for it elsewhere where that is up, and is dropped otherwise."""
    regrow: tuple[int, ...] = ()
    """Of `dead`, those dropped at once instead of waited for: their replacements start once
    the group has re-formed, and join at a later re-form (`joinable`; policy.replacing)."""
    state_from: Literal["survivor", "peers"] = "survivor"
    """Where the state the group goes on from is: the survivor furthest ahead gives its
    state (replicated state), or every rank goes back to the newest peer snapshot left of
    it (sharded state; NoSurvivors where none serves), re-sharded onto the new group where
    its world size changes."""
    grow: bool = False
    """From peers: take in the workers ready to join too (re-sharding the snapshots onto
    them). From a survivor, the workers ready to join always are (they take the state where
    it was secured for them)."""

    def __post_init__(self) -> None:
        for name in ("dead", "leave", "regrow"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.grow and self.state_from != "peers":
            raise ValueError("ReformPlan.grow is for a re-form from peers: from a survivor, the workers "
                             "ready to join always join")


class ReformFailed(Exception):
    """A re-form that failed part-way (a worker died, hung or raised while the group
    formed). The group is left with every live worker idle; `failures` are the causes,
    to count, and `dead` every rank now gone (the failed and any killed to unblock the
    rest), with ranks as the group now numbers them; `world_size`, where given, how many
    ranks it now numbers (dead ones included). `renumbered`, where the attempt had
    renumbered the ranks before it failed: (the ranks it kept, in their new order, then its
    newcomers; the ranks it left behind), both as numbered before it."""

    def __init__(self, failures: list[Failure], dead: list[int], world_size: int | None = None,
                 renumbered: tuple[list[int], list[int]] | None = None):
        self.failures, self.dead, self.world_size, self.renumbered = failures, dead, world_size, renumbered
        super().__init__("; ".join(f"rank {f.rank} {f.kind}: {f.cause}" for f in failures))


class WorkerGroup(Protocol):
    """What the controller drives."""

    def start(self) -> list[Node]: ...
    def check_storage(self, nodes: list[Node]) -> dict[str, Any] | None: ...
    def setup(self, resume: CheckpointRef | None = None) -> Formed:
        """Form the group and build the task everywhere, from `resume` if given (a worker
        reads it; CheckpointCorrupt if it does not match its manifest)."""
        ...
    def adopt(self, takeover: Any) -> tuple[Formed, int]:
        """Take over the workers a lost driver of the run left (the group's own value, found
        before the controller starts): what a setup returns, and the step they hold; the
        group is then re-formed from their memory (`reform` of an empty ReformPlan)."""
        ...
    def launch(self) -> None: ...
    def poll(self, timeout: float) -> Poll: ...
    def status(self, timeout: float = 1.0) -> list[Status | None]: ...
    def dump_stacks(self, rank: int) -> str | None: ...
    def flight_record(self, rank: int) -> bytes | None: ...
    def kill(self, rank: int, answering: Iterable[int] = ()) -> bool:
        """Kill a worker now; whether its process was still running (frozen, not gone), as a
        peer of `answering` (ranks known to answer) on its node saw it (False where none is)."""
        ...
    def abort(self, ranks: list[int]) -> None: ...
    def spares_ready(self, ranks: list[int]) -> dict[int, bool]:
        """Of the lost `ranks`, those a warm spare that is up can take over at once (one on
        the node of the rank's slot, each spare for one rank), each with whether its spare
        has built the training state ahead too."""
        ...
    def reform(self, plan: ReformPlan) -> Reformed:
        """Re-form the group as `plan` says (every worker stopped): NoSurvivors where no
        state to go on from is left (a checkpoint is the way back then), ReformFailed where
        a worker is lost meanwhile (call again with its `dead`)."""
        ...
    def joinable(self) -> int:
        """Start a worker in every free slot the cluster has placed; return how many
        started workers are up, ready to join at the next `reform`."""
        ...
    def joiners_starting(self) -> int:
        """How many started workers (`joinable`'s, a fast recovery's replacements) are
        not up yet."""
        ...
    def draining(self) -> dict[str, float | None]:
        """The cluster's nodes being drained (for preemption, or as idle): node id ->
        deadline (time.time() seconds; None where the drain has none)."""
        ...
    def replacements(self, ranks: list[int]) -> list[int]:
        """Start a worker on another node for each of `ranks` (once; those asked before
        and not asked now are given up); return the ranks whose replacement is up, ready
        for a `reform` with them in its plan's `leave`."""
        ...
    def pause(self) -> None: ...
    def save_paused(self) -> Poll:
        """Every worker paused (for a stop): commit a checkpoint of the step they paused at;
        the rows and events (its checkpoint_committed) that came meanwhile."""
        ...
    def shutdown(self, keep: bool = False) -> None:
        """Stop every worker; `keep`: the run finished, and workers' processes fit for
        the driver's next run may be kept for it."""
        ...


COMPUTE_KEY = "rank_compute_s"
"""A training row's field where the step's metrics rode the gradient all-reduce: each rank's
own compute time of the step, in seconds, by rank (worker/loop/window.py measures it). The driver
takes it out of the row to find slow workers (driver/stragglers.py); it is not a metric."""

NAMESPACE = "raytrainer"
"""The Ray namespace of the workers' actor names: a new driver of a run finds the workers a
lost driver left (failure.driver_grace_s) among the actors named there."""


def run_key(storage: str, name: str) -> str:
    """A short stable key of a run directory, in the names of the run's placement groups
    (`raytrainer:<key>:...`): whoever ends an orphaned run finds them by it."""
    import hashlib

    return hashlib.sha256(f"{storage.rstrip('/')}/{name}".encode()).hexdigest()[:16]


def placement_group_prefix(storage: str, name: str) -> str:
    return f"raytrainer:{run_key(storage, name)}:"


@dataclass(frozen=True)
class Orphan:
    """What a worker says of itself to a driver that may take it over (Worker.orphan)."""

    run: str
    """run_key of the run it trains; "" for a process kept for another run or a spare."""
    rank: int | None
    world_size: int | None
    step: int
    paused: bool
    """Its run() returned "paused": it holds the state of `step`, the group left."""
    orphaned: bool
    """Its driver is gone (and no other took it over yet)."""
    replicated: bool = True
    total_steps: int | None = None
    steps_per_epoch: int | None = None
    node: Node | None = None
    placement_group: str | None = None
    """The hex id of the placement group it runs in, if any (a pinned CPU worker runs beside
    its slot's group, not in it)."""
    where: str = ""
    """Its run directory (storage/name), for the messages that name it."""


WORKER_ACTOR = "raytrainer.worker.process.actor:Worker"
"""The class the driver's group makes a Ray actor of, one per worker, by this import path:
the driver names it but never imports the worker package's modules itself."""


STATE_COPIES = "raytrainer.worker.state.copies"
"""The module whose `read(prefix)` and `remove(prefix)` the driver runs, by this import path,
as Ray tasks on the node of a lone survivor's copy of the state (see keep_copy)."""


class WorkerActor(Protocol):
    """The calls the driver's group makes on a worker actor (tests/test_layout.py checks that
    the class at WORKER_ACTOR has each of them). Control calls (status, drain, ...) are
    answered while `run` trains or is blocked in a collective."""

    def node(self) -> Node: ...
    def sees_file(self, path: str) -> bool: ...
    def rendezvous(self) -> tuple[str, int]: ...
    def read_checkpoint(self, ref: CheckpointRef) -> tuple[str | None, bytes | str | None]:
        """(None, what the workers load: state.pt's bytes or a sharded checkpoint's URI),
        or (why it is corrupt, None). Called with num_returns=2: the driver gets the first,
        and passes the second by reference to every worker's setup, never fetching it."""
        ...
    def setup(self, rank: int, world_size: int, addr: str, port: int, use_gpu: bool,
              resume: bytes | str | Snapshot | Reshard | CopiedState | None = None) -> tuple[int | None, int, bool]: ...
    def run(self) -> RunEnd: ...
    def status(self) -> Status: ...
    def request_pause(self) -> None: ...
    def dump_stacks(self) -> str: ...
    def flight_record(self) -> bytes | None: ...
    def abort(self) -> bool: ...
    def kill_process(self, pid: int) -> None: ...
    def get_state(self) -> tuple[int, Any]:
        """(its size, this worker's training state, packed: worker/state/transfer.py). Called with
        num_returns=2: the driver waits for the size and hands the state on by reference."""
        ...
    def copy_now(self, prefix: str) -> int | None:
        """keep_copy(prefix), its first copy written now; the step written (None: no room)."""
        ...
    def keep_copy(self, prefix: str | None) -> None:
        """Copy the state to its node's shared memory under `prefix` at every step boundary
        from now on, as the state's only holder (None: stop, and remove the copy). Read
        back by STATE_COPIES' `read` on that node."""
        ...
    def snapshots_held(self) -> Holdings: ...
    def peer_snapshot(self, step: int) -> tuple[int, Snapshot]: ...
    def own_snapshot(self, step: int) -> tuple[int, Snapshot]: ...
    def regroup(self, rank: int, world_size: int, addr: str, port: int, state: bytes | None = None) -> int: ...
    def drain(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]: ...
    def save_paused(self) -> int:
        """Once run() returned "paused" for a stop: commit a checkpoint of that step, written."""
        ...
    def orphan(self) -> Orphan:
        """What it holds, for a driver that may take it over (a control call)."""
        ...
    def adopt(self, job_id: str) -> bool:
        """Taken over by the driver of Ray job `job_id`: watch that one from now on; False
        where it ended meanwhile (its grace was over)."""
        ...
