"""The Ray edge: one Worker actor per reserved slot, driven as the contract's WorkerGroup.

The controller drives any object with the `contract.WorkerGroup` interface; tests give it
a fake one without a cluster. This one is split by concern:

    actors    the Roster (actor, node and slot by rank), making and calling an actor, kill
    slots     placement groups, one per slot, renewed when their node is lost; newcomers
    spares    warm spares, worker processes ready to replace a lost one on their node
    drains    nodes being drained, and replacements for the workers on them
    forming   forming the process group, its hang checks, the state workers continue from

and RayWorkerGroup here puts them together: the lifecycle (start, setup, launch, poll,
shutdown), the control calls, and the re-forms after a failure, a pause or a drain.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray

from ...checkpoint import CheckpointRef
from ...config import Config
from ...contract import Failure, Formed, Node, Poll, ReformFailed, Reformed, Reshard, RunEnd, Snapshot, Status
from ...errors import NoSurvivors, PlacementError
from ..policy import choose_snapshot
from ..storage_check import check_shared_storage
from . import actors
from .actors import Roster, control, gather, resources_text, start_worker, worker_bundle
from .drains import Moves, draining_nodes
from .copies import KeptCopies
from .forming import Forming
from .slots import Slots
from .spares import WarmSpares

__all__ = ["RayWorkerGroup", "worker_bundle"]


class RayWorkerGroup:
    def __init__(self, config: Config, use_gpu: bool, *, cluster_can_grow: bool = True,
                 run_dir: Path | None = None):
        self.config = config
        self.run_dir = run_dir
        self.use_gpu = use_gpu
        self.bundle = worker_bundle(config, use_gpu)
        self.roster = Roster()
        self.slots = Slots(config, self.bundle, cluster_can_grow)
        self.moves = Moves(config, self.bundle, self.slots)
        self.spares = WarmSpares(config, 0 if use_gpu else config.failure.warm_spares)
        self.forming = Forming(config, self.roster, self.kill)
        self.copies = KeptCopies(config)  # a lone survivor's second copy of the state
        self._runs: list[Any] = []
        self._pending: list[Any] = []
        self._finished: dict[int, RunEnd] = {}
        self._drain_ref: Any = None  # rank 0's drain() call, while it has not answered
        # Replacements started by a re-form that failed before they were up (_starting_ranks).
        self._starting: list[Any] = []

    @property
    def actors(self) -> list[Any]:
        return self.roster.actors

    @property
    def nodes(self) -> list[Node]:
        return self.roster.nodes

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> list[Node]:
        """Reserve min_workers slots at once (and ask for the rest), start a worker in each
        placed slot; return the workers' nodes."""
        self.roster.slots = self.slots.reserve()
        self.roster.actors = [start_worker(self.config, self.bundle, slot) for slot in self.roster.slots]
        self.roster.nodes = gather([a.node.remote() for a in self.roster.actors])
        return self.roster.nodes  # the warm spares start once training runs (poll)

    def check_storage(self, nodes: list[Node]) -> dict[str, Any] | None:
        """Fail now if workers on other nodes cannot see the run directory."""
        if self.run_dir is None:
            return None
        return check_shared_storage(
            self.run_dir, self.config.run.storage, nodes, ray.get_runtime_context().get_node_id(),
            lambda path: gather([a.sees_file.remote(path) for a in self.roster.actors]),
        )

    def setup(self, resume: CheckpointRef | None = None) -> Formed:
        """Form the process group and build the task on every worker, loading `resume`:
        rank 0 reads it and checks it against its manifest, and its state (state.pt's bytes,
        left in the object store, or a sharded checkpoint's URI) goes to every worker by
        reference, never through this process. Raises CheckpointCorrupt if it does not match
        its manifest, and ReformFailed if a worker is lost meanwhile."""
        self.forming.clear()
        state = self.forming.read_checkpoint(resume) if resume is not None else None
        results = self.forming.form({rank: (None, state) for rank in range(len(self.roster.actors))}, self.use_gpu)
        self.copies.after_form(self.roster, None)
        total_steps, steps_per_epoch, replicated = results[0]
        return Formed(list(self.roster.nodes), total_steps, steps_per_epoch, replicated)

    def launch(self) -> None:
        self._runs = [a.run.remote() for a in self.roster.actors]
        self._pending = list(self._runs)
        self._finished = {}
        self._drain_ref = None

    def poll(self, timeout: float) -> Poll:
        """Wait up to `timeout` for any worker's run() to end; collect new metric rows, and
        how each run() that ended did, if not by finishing."""
        ready, self._pending = ray.wait(self._pending, num_returns=1, timeout=timeout)
        if not self.slots.starting():  # started here, once training runs (spares.py)
            self.spares.start(self.roster)
        if ready and self._pending:  # whatever else has ended too, without waiting
            more, self._pending = ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
            ready += more
        poll = Poll(*self._drain(timeout=1.0))
        for ref in ready:
            rank = self._runs.index(ref)
            result = actors.outcome(self.roster, rank, ref)
            if isinstance(result, Failure):
                poll.failures.append(result)
            elif result.status == "interrupted":
                poll.failures.append(Failure(rank, "interrupted", result.cause, result.step, self.roster.ip(rank)))
            elif result.status == "paused":
                poll.paused[rank] = result
            else:
                self._finished[rank] = poll.finished[rank] = result
        if len(self._finished) == len(self._runs) and not poll.failures:
            poll.done = True
            poll.result = self._finished[0]
            rows, events = self._drain(timeout=30.0)
            poll.rows += rows
            poll.events += events
        return poll

    def shutdown(self) -> None:
        for actor in self.roster.actors:
            ray.kill(actor, no_restart=True)
        self.moves.shutdown()
        self.spares.shutdown()
        self.slots.shutdown()  # its newcomers, and every placement group
        self.copies.remove_all()
        self.forming.clear()
        self._starting = []
        self.roster.actors, self.roster.slots = [], []
        self._runs, self._pending, self._finished = [], [], {}

    # ------------------------------------------------------------------ control

    def status(self, timeout: float = 1.0) -> list[Status | None]:
        """Each worker's progress (None: no answer within `timeout`, or dead; a late answer
        comes at the next call: actors.ask_once)."""
        return actors.ask_once(self.roster, range(len(self.roster.actors)), "status", timeout)

    def dump_stacks(self, rank: int, timeout: float = 5.0) -> str | None:
        return actors.ask(self.roster, [rank], "dump_stacks", timeout)[0]

    def flight_record(self, rank: int, timeout: float = 5.0) -> bytes | None:
        return actors.ask(self.roster, [rank], "flight_record", timeout)[0]

    def abort(self, ranks: list[int]) -> None:
        """Make `ranks` stop waiting for a lost peer now, not at failure.collective_timeout_s
        (NCCL communicators aborted, Gloo connections shut down). Not waited for: a worker
        on a node lost a moment ago answers nothing until Ray holds it dead, seconds later
        (2.6 s in the bench's node run), and the others stop by themselves meanwhile."""
        for rank in ranks:
            control(self.roster.actors[rank], "abort").remote()

    def kill(self, rank: int) -> None:
        actors.kill(self.roster, rank)

    def pause(self) -> None:
        """Ask every worker to pause at a step boundary they agree on (run() returns "paused")."""
        for actor in self.roster.actors:
            control(actor, "request_pause").remote()

    def save_paused(self) -> Poll:
        """Every worker has paused: have them commit a checkpoint of that step (rank 0 writes
        a replicated state; a sharded one was written as they paused) and wait for it;
        then collect rank 0's rows and events."""
        gather([actor.save_paused.remote() for actor in self.roster.actors])
        poll = Poll()
        stale = self._drain_ref is not None  # asked before the save: it answers without its events
        for _ in range(2 if stale else 1):
            rows, events = self._drain(timeout=30.0)
            poll.rows += rows
            poll.events += events
        return poll

    def joinable(self) -> int:
        """Start a worker in every free slot the cluster has placed; return how many
        started workers are ready to join at the next `reform`."""
        return self.slots.start_joiners(self.roster.slots + self.moves.slots_in_use(), self.draining)

    def joiners_starting(self) -> int:
        return self.slots.starting()

    def draining(self) -> dict[str, float | None]:
        return draining_nodes()

    def replacements(self, ranks: list[int]) -> list[int]:
        return self.moves.replacements(ranks)

    def spares_ready(self, ranks: list[int]) -> list[int]:
        """Of the lost `ranks`, those a warm spare that is up can take over now: one on the
        node of the rank's slot (a node Ray holds alive), each spare for one rank."""
        ready = self.spares.ready_on([self.roster.nodes[r].node_id for r in ranks])
        return [r for r, ok in zip(ranks, ready) if ok]

    # ------------------------------------------------------------------ re-forms

    def reform(self, dead: list[int], leave: list[int] = (), regrow: list[int] = ()) -> Reformed:
        """Re-form the process group after a failure or a pause; every worker must have
        stopped. The `dead` ranks get a new worker (the one started by `replacements` for
        them, else a warm spare, else one in their slot) if one is placed in time
        (policy.keep_waiting_for_placement), and are dropped otherwise; those in `regrow`
        are dropped at once, their replacements started once the group has re-formed (they
        join at a later re-form, `joinable`: policy.replacing). The `leave` ranks
        (alive, on a draining node) give way to their replacement where it is up, and are
        dropped otherwise. Workers ready to join are added. Ranks keep their order (the
        remaining ones close up, newcomers come last). Every worker gets the state of the
        survivor furthest ahead (one staying, among equals), unless it has it already; with
        no survivor, the state secured by an earlier attempt of this recovery. Raises
        NoSurvivors when there is neither, and ReformFailed when a worker is lost meanwhile
        (call again with its `dead`)."""
        scaling, roster = self.config.scaling, self.roster
        world = len(roster.actors)
        starting = self._starting_ranks(dead)
        leave = [r for r in leave if r not in dead and r not in starting]
        others = [r for r in range(world) if r not in dead and r not in starting]
        regrow = [r for r in regrow if r in dead] if others else []  # someone must go on
        asked = self._replace(dead, regrow)
        try:
            answers = self.forming.answers(others, "status")
            holders = {r: s for r, s in answers.items() if s.phase != "setup"}  # those with a training state
            source, state_ref, at = self._take_state(holders, leave)
        except ReformFailed as exc:  # before the ranks are renumbered: those left behind are gone too
            raise ReformFailed(exc.failures, sorted(set(exc.dead) | set(regrow)), world) from None
        moved: dict[int, Node] = {}
        for rank in leave:  # its state is secured: it goes, for its replacement if up
            self.kill(rank)
            node = self.moves.take(roster, rank) if rank in self.moves else None
            if node is not None:
                moved[rank] = node
        staying = len(others) - len(leave) + len(moved)
        waited = [r for r in dead if r not in regrow] + starting
        placed = self.slots.wait_placed(roster, waited, staying + len(self.slots.ready_joiners(take=False)), asked)
        self._starting = []
        for rank in dead + starting:
            if rank not in placed:  # its slot stays reserved: it may join later
                ray.kill(roster.actors[rank], no_restart=True)
        joiners = self.slots.ready_joiners(take=True)
        placed.update(moved)
        keep = [r for r in range(world) if r in placed or (r not in dead and r not in starting and r not in leave)]
        self.moves.cancel_all()  # ranks are renumbered: replacements still wanted are asked again
        if leave:
            self.spares.keep_only_on({(placed.get(r) or roster.nodes[r]).node_id for r in keep})
        roster.actors = [roster.actors[r] for r in keep] + [actor for _, actor, _ in joiners]
        roster.slots = [roster.slots[r] for r in keep] + [slot for slot, _, _ in joiners]
        roster.nodes = [placed.get(r) or roster.nodes[r] for r in keep] + [node for _, _, node in joiners]
        # Below min_workers only for lack of a replacement waited for; ranks left behind to
        # regrow are the controller's to bound (scaling.placement_timeout_s).
        if len(roster.actors) < scaling.min_workers and any(r not in placed for r in waited):
            raise PlacementError(
                f"only {len(roster.actors)} workers could be placed within scaling.placement_timeout_s="
                f"{scaling.placement_timeout_s:g} after losing rank(s) {dead}, fewer than "
                f"scaling.min_workers={scaling.min_workers}; {resources_text()}. Add nodes, or "
                "lower scaling.min_workers (or num_workers)"
            )
        # Holders regroup (taking the state only if behind); the others build the task from it.
        calls = {}
        for rank, old in enumerate(keep + [None] * len(joiners)):
            if old in holders and old not in moved:
                calls[rank] = (holders[old].position != at.position, state_ref)
            else:
                calls[rank] = (None, state_ref)
        dropped = [r for r in dead + starting + leave if r not in placed]
        try:
            self.forming.form(calls, self.use_gpu)
        except ReformFailed as exc:
            raise ReformFailed(exc.failures, exc.dead, len(roster.actors), renumbered=(keep, dropped)) from None
        from_copy = self.copies.holder is not None and not holders
        self.copies.after_form(roster, getattr(self.forming, "secured", None))
        self.forming.clear()
        self._restock()
        return Reformed(step=at.step, nodes=list(roster.nodes), source=source,
                        state_from="memory" if source is not None else "copy" if from_copy else "object_store",
                        replaced=sorted(r for r in placed if r in dead or r in starting),
                        dropped=dropped, moved=sorted(moved),
                        added=len(joiners),
                        resynced=[r for r in holders if holders[r].position != at.position])

    def _take_state(self, holders: dict[int, Status], leave: list[int]) -> tuple[int | None, Any, Status]:
        """forming.take_state; with no survivor and nothing secured by this recovery, the
        copy a lone survivor kept (copies.py), which is secured for this recovery then."""
        try:
            return self.forming.take_state(holders, avoid=leave)
        except NoSurvivors:
            kept = self.copies.newest()
            if kept is None:
                raise
            self.forming.secured = kept
            return None, kept[1], kept[0]

    def reform_from_peers(self, dead: list[int], regrow: list[int] = (), grow: bool = False,
                          leave: list[int] = ()) -> Reformed:
        """Sharded state: replace the `dead` ranks (the same slots, so the same world size)
        and form the group again from the newest peer snapshot left of every rank's state
        (policy.choose_snapshot): survivors load their own, each replacement the copy its
        successor holds, which the driver secures first (forming.secure_copies). Every
        worker builds its training state anew in the new group (a sharded model is bound to
        the group it was sharded over); the run replays the steps since the snapshot.
        Raises NoSurvivors when no snapshot serves or a replacement cannot be placed (a
        checkpoint is the way back then), and ReformFailed when a worker is lost meanwhile.

        The world size changes where ranks in `regrow` are dropped at once (a fast recovery:
        their replacements start once the group has formed and join at a later grow), where
        `grow` adds the workers ready to join, or where a `leave` rank (alive, on a
        draining node) has no replacement up: then every rank's snapshot is secured in the
        object store and each worker of the new group re-shards from all of them
        (worker/reshard.py)."""
        roster = self.roster
        world = len(roster.actors)
        leave = [r for r in leave if r not in dead]
        others = [r for r in range(world) if r not in dead]
        regrow = [r for r in regrow if r in dead] if others else []
        kept = self.forming.resharding  # every rank's snapshot, secured by an earlier attempt
        if not (regrow or grow or leave or kept):
            return self._same_size_from_peers(dead)
        asked = self._replace(dead, regrow)
        try:
            if kept is not None:
                step, parts, peers = kept[0], kept[1], {}
            else:
                held = self.forming.answers(others, "snapshots_held")
                secured = {rank: step for rank, (step, _) in self.forming.copies.items()}
                step, why = choose_snapshot(world, dead, held, secured)
                if step is None:
                    raise NoSurvivors(f"no peer snapshot serves: {why}")
                parts, peers = self.forming.secure_all(step, world, others, held)
        except ReformFailed as exc:  # before the ranks are renumbered: those left behind are gone too
            raise ReformFailed(exc.failures, sorted(set(exc.dead) | set(regrow)), world) from None
        moved: dict[int, Node] = {}
        for rank in leave:  # its snapshot is secured: it goes, for its replacement if up
            self.kill(rank)
            node = self.moves.take(roster, rank) if rank in self.moves else None
            if node is not None:
                moved[rank] = node
        waited = [r for r in dead if r not in regrow]
        placed = self.slots.wait_placed(roster, waited, len(others) - len(leave) + len(moved), asked)
        for rank in dead:
            if rank not in placed:
                ray.kill(roster.actors[rank], no_restart=True)
        missing = [r for r in waited if r not in placed]
        if missing:
            raise NoSurvivors(f"no replacement for rank(s) {missing} was placed within "
                              f"scaling.replace_timeout_s={self.config.scaling.replace_timeout_s:g}")
        joiners = self.slots.ready_joiners(take=True) if grow else []
        placed.update(moved)
        keep = [r for r in range(world) if r in placed or (r not in dead and r not in leave)]
        self.moves.cancel_all()
        if leave:
            self.spares.keep_only_on({(placed.get(r) or roster.nodes[r]).node_id for r in keep})
        # A worker that stays in its own process loads its own snapshot from memory.
        own = {r for r in keep if r not in placed and kept is None}
        loads = [Reshard(step, tuple(Snapshot(step, r) if r == old and r in own else parts[r]
                                     for r in range(len(parts))))
                 for old in keep + [None] * len(joiners)]
        roster.actors = [roster.actors[r] for r in keep] + [actor for _, actor, _ in joiners]
        roster.slots = [roster.slots[r] for r in keep] + [slot for slot, _, _ in joiners]
        roster.nodes = [placed.get(r) or roster.nodes[r] for r in keep] + [node for _, _, node in joiners]
        # Until the group has formed, any attempt can re-shard from these, whoever is left.
        self.forming.resharding = (step, parts)
        dropped = [r for r in dead + leave if r not in placed]
        try:
            self.forming.form({rank: (None, load) for rank, load in enumerate(loads)}, self.use_gpu)
        except ReformFailed as exc:
            raise ReformFailed(exc.failures, exc.dead, len(roster.actors), renumbered=(keep, dropped)) from None
        self.forming.clear()
        self._restock()
        return Reformed(step=step, nodes=list(roster.nodes), source=None, state_from="peers",
                        replaced=sorted(r for r in placed if r in dead),
                        dropped=dropped, moved=sorted(moved),
                        added=len(joiners), snapshot_step=step, peers=peers)

    def _same_size_from_peers(self, dead: list[int]) -> Reformed:
        roster = self.roster
        world = len(roster.actors)
        lost = dead + self._starting_ranks(dead)  # a replacement not up yet holds nothing either
        asked = self._replace(dead)
        others = [r for r in range(world) if r not in lost]
        held = self.forming.answers(others, "snapshots_held")
        secured = {rank: step for rank, (step, _) in self.forming.copies.items()}
        step, why = choose_snapshot(world, lost, held, secured)
        if step is None:
            raise NoSurvivors(f"no peer snapshot serves: {why}")
        loads, peers = self.forming.secure_copies(step, world, others, held)
        placed = self.slots.wait_placed(roster, lost, len(others), asked)
        self._starting = []
        missing = [r for r in lost if r not in placed]
        if missing:
            raise NoSurvivors(f"no replacement for rank(s) {missing} was placed within "
                              f"scaling.replace_timeout_s={self.config.scaling.replace_timeout_s:g}, and peer "
                              "snapshots restore the same world size only")
        roster.nodes = [placed.get(r) or roster.nodes[r] for r in range(world)]
        self.forming.form({rank: (None, loads[rank]) for rank in range(world)}, self.use_gpu)
        self.forming.clear()
        self._restock()
        return Reformed(step=step, nodes=list(roster.nodes), source=None, state_from="peers",
                        replaced=sorted(lost), snapshot_step=step, peers=peers)

    def _replace(self, dead: list[int], regrow: list[int] = ()) -> dict[int, Any]:
        """Kill the `dead` ranks' workers and start their replacements: the one started for
        a draining node's rank, else a warm spare that is up on its node (in the rank's
        slot), else a new worker in a new slot (its node may be lost: slots.py); none for the
        ranks in `regrow` (reform starts theirs later). Returns, by rank, the node() call a
        replacement already answers (a spare's, made as it started), for wait_placed."""
        roster = self.roster
        asked: dict[int, Any] = {}
        for rank in dead:
            self.kill(rank)
            if rank in self.moves:  # its node was drained: its replacement is elsewhere
                self.moves.take(roster, rank, wait=True)
                continue
            taken = None if rank in regrow else self.spares.take(roster.nodes[rank].node_id)
            if taken is not None:
                roster.actors[rank], asked[rank] = taken
                continue
            roster.slots[rank] = self.slots.renew(roster.slots[rank])
            if rank not in regrow:
                roster.actors[rank] = start_worker(self.config, self.bundle, roster.slots[rank])
                self._starting.append(roster.actors[rank])
        # Replacements of the ranks left behind, and the next spares, start once the group
        # has formed (_restock), not now: starting a process and importing torch took the
        # cores the recovery needed (on 2 cores, it held up the spare taking over when that
        # was still starting), and one started now would still be starting at a recovery's
        # next attempt.
        return asked

    def _starting_ranks(self, dead: list[int]) -> list[int]:
        """The ranks (not in `dead`) whose worker is a replacement that an earlier attempt
        of this recovery started and that was not waited for yet (the attempt failed first):
        a process still starting, importing torch, answers nothing and holds no state; it is
        waited for like the new ones, not asked and taken for hung."""
        return [r for r, actor in enumerate(self.roster.actors)
                if r not in dead and any(actor is a for a in self._starting)]

    def _restock(self) -> None:
        """Once a group has formed: start a worker in every free slot placed (the ranks left
        behind by a recovery get their replacements; they join at a resize), and, once none
        is starting, the spares used up."""
        self.slots.start_joiners(self.roster.slots + self.moves.slots_in_use(), self.draining)
        if not self.slots.starting():
            self.spares.start(self.roster)

    def _drain(self, timeout: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Rank 0's new rows and events. A call not answered within `timeout` (rank 0 is
        frozen, or the machine busy) is collected at the next poll, never asked twice."""
        if self._drain_ref is None:
            self._drain_ref = control(self.roster.actors[0], "drain").remote()
        if not ray.wait([self._drain_ref], timeout=timeout)[0]:
            return [], []
        ref, self._drain_ref = self._drain_ref, None
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError:
            return [], []  # rank 0 died; its run() ref says why
