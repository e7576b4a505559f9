"""What to do about a failure: pure decisions, no actors, no torch.

The controller and the group report what they saw (which workers died, hung, raised,
or were merely interrupted by a peer's failure; who is stalled and where; who holds
which state) and carry out the decisions: whether to recover, whom to blame for a
hang, whose state the others take, how long to wait for a replacement.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..contract import Failure, Holdings, Status
from ..errors import RaytrainerError, WorkerError

__all__ = ["BUSY_SHARE", "Decision", "Failure", "FailurePolicy", "FailuresExceeded", "LEAVE_MARGIN_S", "Leave",
           "Replacing", "SnapshotChoice", "StateChoice", "blame", "choose_snapshot", "choose_source", "choose_state", "draining_ranks", "keep_waiting_for_placement",
           "leave_draining_nodes", "poll_wait", "progressed", "replacing", "root_causes", "secure_at_once",
           "secure_where"]


@dataclass(frozen=True)
class Decision:
    recover: bool
    reason: str = ""
    error: BaseException | None = None
    """What to raise when not recovering."""


class FailurePolicy:
    """Two budgets, by cause. A loss (every root cause a worker process that died: killed
    from outside, OOM-killed, its node gone or preempted) is the cluster's: recovered up to
    `max_losses` times (None: always), so a week-long run on spot nodes is not failed by its
    fourth node loss. A fault of the run itself (an error in the task's code, a hang) counts
    against `max_failures` within the last `window_s` seconds (None: the whole run), so a
    long run is not failed by its age. A loss at a step where the run has lost workers
    REPEATED_LOSSES times already without a step between is a fault: a crash that recurs
    there (a segfault, an OOM at one batch) is the run's own. Never retried: our own errors
    (a config or task contract error will not go away) and a worker error that recurs at the
    same step (deterministic: retrying it would only repeat it)."""

    REPEATED_LOSSES = 2

    def __init__(self, max_failures: int, window_s: float | None = None, max_losses: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.max_failures, self.window_s, self.max_losses = max_failures, window_s, max_losses
        self.clock = clock
        self.failures = 0
        """Recoveries decided so far, of both kinds."""
        self.losses = 0
        self.faults = 0
        self._fault_times: list[float] = []
        self._errors: set[tuple[int | None, str]] = set()
        self._loss_step: tuple[int | None, int] = (None, 0)  # (step, losses at it in a row)

    def decide(self, failures: list[Failure], step: int | None = None) -> Decision:
        """Whether to recover from `failures`, met at the run's `step`."""
        causes = root_causes(failures)
        for f in causes:
            if f.kind != "error":
                continue
            if isinstance(f.error, RaytrainerError) and not isinstance(f.error, WorkerError):
                return Decision(False, f"rank {f.rank}: {f.cause}", f.error)
            key = (f.step, f.error_type)
            if key in self._errors:
                return Decision(False, f"rank {f.rank} raised {f.error_type} again at the same step, "
                                       "so it is not retried", f.error)
            self._errors.add(key)
        self.failures += 1
        last = "; ".join(f"rank {f.rank} {f.kind}: {f.cause}" for f in causes)
        if causes and all(f.kind == "died" for f in causes) and not self._repeated_loss(step):
            self.losses += 1
            if self.max_losses is not None and self.losses > self.max_losses:
                reason = (f"failure.max_losses={self.max_losses} exceeded: {self.losses} lost workers' recoveries "
                          f"({last}). Fix what kills them, raise failure.max_losses, or leave it null (no limit)")
                return Decision(False, reason, FailuresExceeded(reason))
            return Decision(True, "; ".join(f"rank {f.rank} {f.kind}" for f in causes))
        self.faults += 1
        now = self.clock()
        self._fault_times.append(now)
        if self.window_s is not None:
            self._fault_times = [t for t in self._fault_times if now - t <= self.window_s]
        if len(self._fault_times) > self.max_failures:
            within = f"within failure.failure_window_s={self.window_s:g}" if self.window_s is not None else "of this run"
            reason = (f"failure.max_failures={self.max_failures} exceeded: failure {len(self._fault_times)} {within} "
                      f"({last}). Fix the cause, or raise failure.max_failures")
            # A worker's own error is what the user must see (rank, traceback); the reason
            # is in the event log.
            error = next((f.error for f in causes if isinstance(f.error, WorkerError)), None)
            return Decision(False, reason, error or FailuresExceeded(reason))
        return Decision(True, "; ".join(f"rank {f.rank} {f.kind}" for f in causes))

    def _repeated_loss(self, step: int | None) -> bool:
        """Whether a loss at `step` follows REPEATED_LOSSES others at the same step."""
        at, count = self._loss_step
        count = count + 1 if step is not None and step == at else 1
        self._loss_step = (step, count)
        return count > self.REPEATED_LOSSES


# A worker whose working thread ran, or waited for a core, for at least this share of the
# time between two answers is working: on a loaded machine a thread that wants to run waits
# in the run queue, which counts; one stuck in a read, a hung kernel or a sleep counts ~0.
BUSY_SHARE = 0.5


def progressed(before: Status | None, now: Status, seconds: float) -> bool:
    """Whether a worker made progress between two answers `seconds` apart: it moved on (a
    step, a batch, a phase; its first answer counts), or it kept working on its own clock,
    its working thread running or waiting for a core for BUSY_SHARE of the time (a slow
    worker on a loaded machine, a long compile or load, a first kernel), however little it
    got done. Only a worker that neither moves nor works (it waits on something else: a
    stuck read, a hung kernel, a peer) stalls; a worker that answers nothing stalls too,
    and has no clock to ask (blame)."""
    if before is None or (before.step, before.progress, before.phase) != (now.step, now.progress, now.phase):
        return True
    if before.busy_s is None or now.busy_s is None:
        return False
    return now.busy_s - before.busy_s >= BUSY_SHARE * max(seconds, 0.0)


def blame(stalled: dict[int, Status | None], recovering: bool = False, others_progress: bool = False) -> list[int]:
    """Of the workers that made no progress for too long (rank -> its status, None where it
    did not answer), the ones to kill as hung.

    A worker that does not answer its control channel is frozen (SIGSTOP, a paused VM, a
    process stuck holding the GIL); one stalled in its own or the task's code is stuck
    there; one waiting in a collective waits for those. So: the silent ones if any, else
    the ones not in a collective, else (all wait in collectives: a deadlock, or a hang in
    the communication library) those behind the others, else all of them. While
    `recovering` from another failure, a worker in a collective waits for the failed one
    to be gone, and is never to blame; nor while `others_progress` (a worker not stalled,
    however slowly it goes, is the one it waits for)."""
    silent = [r for r, s in stalled.items() if s is None]
    if silent:
        return sorted(silent)
    answering = {r: s for r, s in stalled.items() if s is not None}
    working = [r for r, s in answering.items() if s.phase != "collective"]
    if working or recovering or others_progress:
        return sorted(working)
    least = min((s.progress for s in answering.values()), default=0)
    return sorted(r for r, s in answering.items() if s.progress == least)


def choose_source(statuses: dict[int, Status], avoid: Iterable[int] = ()) -> int:
    """The survivor whose state every worker takes: the one furthest ahead (the others
    stopped where a peer failed under them, at most one step behind); among equals, one
    not in `avoid` (workers about to leave a draining node), then the lowest rank."""
    avoid = set(avoid)
    return max(sorted(statuses), key=lambda r: (statuses[r].position, r not in avoid))


@dataclass(frozen=True)
class StateChoice:
    """Whose state a re-formed group continues from (policy.choose_state)."""

    source: int | None
    """The survivor furthest ahead whose state it is, or None for none (the kept copy's giver
    may be gone)."""
    take: bool
    """Its state must be taken from it (False: the copy kept from an earlier attempt serves)."""


def choose_state(holders: dict[int, Status], kept: Status | None, avoid: Iterable[int] = ()) -> StateChoice:
    """Whose state a re-formed group continues from, given the survivors holding a state and
    the position of the copy kept from an earlier attempt of this recovery, if any. The
    kept copy serves when no survivor is further (its giver may be gone since)."""
    source = choose_source(holders, avoid) if holders else None
    if kept is not None and (source is None or kept.position >= holders[source].position):
        return StateChoice(source if source is not None and holders[source].position == kept.position else None,
                           take=False)
    return StateChoice(source, take=source is not None)


def secure_at_once(*, leaving: bool, waited: bool, joiners: bool, holders: bool) -> bool:
    """Whether a re-form puts the state it continues from in the object store before it
    knows who stays: where workers leave (it must outlive them), a replacement waited for
    or a joiner is to take it (a holder may be lost while they come), or no survivor holds
    it (it comes from a copy). Otherwise secure_where decides once it is known."""
    return leaving or waited or joiners or not holders


def hand_over_by_copy(source_node: str, takers: Iterable[str | None], *, leaving: bool, joiners: bool,
                      secured_before: bool) -> bool:
    """Whether the workers taking the state that a re-form secures before it knows who stays
    (secure_at_once) read it from the giving survivor's copy in its node's shared memory
    (worker/state/copies.py) instead of the object store: where every one of them is up on that
    node (`takers`: each one's node; None for a replacement not up yet, its node unknown),
    nobody leaves (their replacements may be elsewhere), no joiner takes it, and no earlier
    attempt of this recovery secured it (every worker takes that one). The copy is the
    state's second copy until the group has formed, as the object store's was."""
    takers = list(takers)
    return (bool(takers) and not leaving and not joiners and not secured_before
            and all(node == source_node for node in takers))


def secure_where(holders: dict[int, Status], keep: Iterable[int], *, secured_before: bool,
                 copies_wanted: bool) -> str | None:
    """Where a re-form that nobody new joins keeps a second copy of the state it continues
    from, so that a failure right after it loses nothing (Reformed.secured), given the
    survivors holding a state and the old ranks that stay (`keep`): "object_store" (put
    there) where a kept worker holds no state (a replacement an earlier attempt started),
    one is behind, or an earlier attempt of this recovery put it there (every worker takes
    it then); else "holders" where two holders or more stay (they are the copies); else
    "copy" (the lone holder writes its copy beside it, worker/state/copies.py); None for a run of
    one worker by choice, which keeps no second copy."""
    keep = list(keep)
    at = holders[choose_source(holders)].position
    staying = [r for r in keep if r in holders]
    takers = len(staying) < len(keep) or any(holders[r].position != at for r in staying)
    if secured_before or takers:
        return "object_store"
    if len(staying) > 1:
        return "holders"
    return "copy" if copies_wanted else None


@dataclass(frozen=True)
class SnapshotChoice:
    """The step of the peer snapshots a sharded group goes back to (policy.choose_snapshot)."""

    step: int | None
    """None: no snapshot serves, the run restarts from a checkpoint."""
    why: str = ""
    """Why none serves."""


def choose_snapshot(world: int, lost: Iterable[int], held: dict[int, Holdings],
                    secured: dict[int, int] | None = None) -> SnapshotChoice:
    """The step a sharded group of `world` ranks goes back to after losing the ranks `lost`:
    the newest step from which every rank's state can be had, from its own snapshot (a
    survivor's: `held`, survivor -> its holdings), from the copy its successor in the ring
    (rank + 1) holds, or from a copy the driver secured in an earlier attempt of this
    recovery (`secured`: rank -> step). A step of None, with why, when there is none: the
    run then restarts from a checkpoint."""
    lost, secured = set(lost), secured or {}
    # (A worker that never trained in a group, a replacement from an earlier attempt, holds
    # nothing and says world size 1.)
    other = next((h for h in held.values() if (h.own or h.peer) and h.world_size != world), None)
    if other is not None:
        return SnapshotChoice(None, f"the snapshots were taken at world size {other.world_size}, not {world}")
    options = {}
    for rank in range(world):
        holder = (rank + 1) % world
        steps = {secured[rank]} if rank in secured else set()
        if rank not in lost and rank in held:
            steps |= set(held[rank].own)
        if holder not in lost and holder in held:
            steps |= set(held[holder].peer)
        if not steps:
            both = rank in lost and holder in lost
            return SnapshotChoice(None, f"rank {rank} was lost together with rank {holder}, which held the copy "
                                        "of its snapshot" if both else f"no snapshot of rank {rank}'s state is left")
        options[rank] = steps
    common = set.intersection(*options.values())
    if not common:
        return SnapshotChoice(None, "no step has a snapshot of every rank's state left")
    return SnapshotChoice(max(common))


@dataclass(frozen=True)
class Replacing:
    """How one recovery attempt deals with each lost rank (policy.replacing)."""

    spares: tuple[int, ...] = ()
    """Taken over at once by a warm spare that is up: the world size is kept."""
    wait: tuple[int, ...] = ()
    """Waited for: training resumes once their replacements are up (a process start, or
    a placement on a node with room), at the same world size."""
    regrow: tuple[int, ...] = ()
    """Left behind: the survivors go on at once without them, their replacements start
    meanwhile and join at a step boundary once up (a resize, as when a node joins)."""
    reason: str = ""


def replacing(lost: Iterable[int], *, spares_ready: Iterable[int], world: int, replicated: bool,
              exact: bool, global_batch_fixed: bool, elastic: bool, spares_up: Iterable[int] = ()) -> Replacing:
    """Never wait for a process to start where the maths allow it: a lost rank whose node
    has a warm spare ready is replaced by it (bit-identical, a fraction of a second); any other
    is left behind, and the survivors go on at once, one world size smaller, while its
    replacement starts (the same global batch and sample order at any world size, so no
    sample and no step is lost; only the order of sums over ranks and the random streams
    drawn per rank differ: the run ends within float tolerance of an undisturbed one).
    Sharded state (`replicated` False) goes the same way: a survivor holds its own shards
    only, so the group goes back to the peer snapshots of one step (replaying the steps
    since) and every rank of the smaller group re-shards the whole state from them; a
    replacement joins later by the same re-sharding.

    Waited for instead: every one when the user asked for exactness (failure.recovery: exact); every one of a fixed-size run whose
    batch is per worker (trainer.batch_policy: per_worker, or your own loop, whose batches
    raytrainer does not know: its global batch, and its LR, would change; an elastic run
    said it may change); and all of them when none would survive (a checkpoint is the way back).
    `spares_ready`: the lost ranks a ready spare can take (one on the node of the rank's slot
    that has built the training state ahead; none for GPU workers, which need their GPU at
    creation). `spares_up`: those a spare still building can take: taken only where the rank
    would be waited for, as the rest of a build is shorter than a process start and a build.
    Where the survivors can go on, they go on rather than wait for it (at 2 GB of state the
    rest of a spare's build at nice 19 takes seconds: docs/results/2026-11-27-spare-still-building.md)."""
    lost = sorted(set(lost))
    spares = tuple(r for r in lost if r in set(spares_ready))
    rest = tuple(r for r in lost if r not in spares)
    if not rest:
        return Replacing(spares=spares, reason="warm spares take every lost rank")
    why_wait = ("failure.recovery is exact" if exact
                else "a fixed-size run whose global batch follows the world size (trainer.batch_policy "
                     "per_worker, or your own loop): a smaller world would train a smaller global batch"
                if not (global_batch_fixed or elastic)
                else "no worker survived to go on with" if len(lost) >= world
                else "")
    if why_wait:
        building = tuple(r for r in rest if r in set(spares_up))
        rest = tuple(r for r in rest if r not in building)
        spares = tuple(sorted(spares + building))
        return Replacing(spares=spares, wait=rest, reason=why_wait if rest else "warm spares take every lost rank")
    return Replacing(spares=spares, regrow=rest,
                     reason=f"no warm spare ready for rank(s) {list(rest)}: going on without them while their "
                            "replacements start")


def keep_waiting_for_placement(waited_s: float, placed: int, others: int, *, size: int,
                               replace_timeout_s: float, placement_timeout_s: float) -> bool:
    """Whether to keep waiting for lost workers' replacements to be placed: up to
    placement_timeout_s while the workers kept (`others`) plus those placed are fewer than
    the run's size, up to replace_timeout_s for those beyond it (after that the group goes
    on smaller, and grows back when there is room; below min_workers it fails)."""
    if waited_s >= placement_timeout_s:
        return False
    return waited_s < replace_timeout_s or others + placed < size


def grow_now(ready: int, starting: int, waited_s: float, patience_s: float) -> bool:
    """Whether to pause the workers for a grow now: `ready` started workers are up, and
    either none is still `starting`, or those up have waited `patience_s` for the rest.
    Workers started together (a fast recovery's replacements, the slots of a node that
    joined) join in one re-form: each re-form pauses the run and moves the state to the
    newcomers (sharded state: a re-shard), and on a loaded machine processes started
    together come up seconds apart. One that does not come up holds the others back for
    patience_s at most."""
    return ready > 0 and (starting == 0 or waited_s >= patience_s)


def draining_ranks(draining: dict[str, float | None], nodes: list[str]) -> dict[str, list[int]]:
    """Of the nodes being drained (node id -> deadline), those the group runs on, with the
    ranks on each (`nodes`: each rank's node id). A drain elsewhere does not concern us."""
    out: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        if node in draining:
            out.setdefault(node, []).append(rank)
    return out


# How long before a drain's deadline the workers must be off the node at the latest,
# beyond the time they take to reach a common step boundary: the re-form itself (taking
# the state, the rendezvous) and a margin for a slow machine.
LEAVE_MARGIN_S = 10.0


@dataclass(frozen=True)
class Leave:
    """Whether the workers on draining nodes leave now, and why (policy.leave_draining_nodes)."""

    now: bool
    reason: str


def leave_draining_nodes(*, leaving: int, ready: int, world: int, min_workers: int,
                         seconds_left: float | None, waited_s: float, replace_timeout_s: float,
                         pause_s: float) -> Leave:
    """Whether the workers on draining nodes leave now (pause at the next common step and
    re-form without them), and why. `leaving`: how many must go; `ready`: how many of their
    replacements (started on other nodes) are up; `seconds_left`: until the earliest
    deadline (None: the drain has none); `waited_s`: since the drain was noticed;
    `pause_s`: how long the workers take to reach a common step boundary.

    Leave as soon as every leaving worker has a replacement (the world size is kept).
    Otherwise wait for replacements up to replace_timeout_s, but no later than the deadline
    allows, then leave without the missing ones if the rest make min_workers (the group
    shrinks). If they do not, stay: training goes on until the node is gone, and its loss
    is recovered as a failure (leaving early would only stop training sooner)."""
    if leaving == 0:
        return Leave(False, "no worker on a draining node")
    if ready >= leaving:
        return Leave(True, f"{leaving} replacement(s) ready on other nodes")
    urgent = seconds_left is not None and seconds_left <= pause_s + LEAVE_MARGIN_S
    if world - (leaving - ready) < min_workers:
        return Leave(False, f"only {world - leaving + ready} workers would remain, fewer than min_workers="
                            f"{min_workers}: training goes on until the node is gone")
    if urgent:
        return Leave(True, f"the deadline is {seconds_left:.0f} s away: leaving with {ready} of {leaving} replaced")
    if waited_s >= replace_timeout_s:
        return Leave(True, f"no room for {leaving - ready} replacement(s) within "
                           f"replace_timeout_s={replace_timeout_s:g}")
    return Leave(False, "waiting for replacements")


def root_causes(failures: list[Failure]) -> list[Failure]:
    """The failures that caused the others (all of them if every one was an interruption)."""
    return [f for f in failures if f.kind != "interrupted"] or list(failures)


class FailuresExceeded(RaytrainerError):
    """The run failed more often than failure.max_failures allows."""


def poll_wait(now: float, checks_due: Iterable[float], shortest: float, longest: float) -> float:
    """How long the driver's poll waits for a worker's run() to end while training runs: until
    the earliest periodic check falls due (hang, drains, room to grow), within [shortest,
    longest]. A run that ends wakes the poll at once, so waiting longer loses no failure; it
    saves the driver's and rank 0's CPU a call to hand over metric rows every `shortest`."""
    return min(longest, max(shortest, min(checks_due, default=float("inf")) - now))
