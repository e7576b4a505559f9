"""The re-forms of a RayWorkerGroup: after a failure, a pause for a resize or a drain, a new
process group over the workers that stay and those that replace or join them.

Two ways, by where the state to continue from is: `from_survivor` (replicated state: the
survivor furthest ahead gives it to the others) and `from_peers` (sharded state: every
rank goes back to the newest peer snapshot left of it, re-sharded where the world size
changes). Around that they take the same steps: the lost ranks' replacements are started
(`_replace`), the state is secured (forming.py), the workers leaving a draining node go,
the replacements are waited for (slots.py), the ranks are renumbered (the remaining ones
close up, newcomers come last) and the group forms; a worker lost meanwhile is a
ReformFailed that says who is gone and how the ranks were numbered, for the controller's
next attempt.

They are the group's methods, apart for their size: each takes the group and looks its
parts (slots, spares, moves, forming, copies) up there at every call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray

from ...contract import CopiedState, Holdings, Node, ReformFailed, Reformed, Reshard, Snapshot, Status
from ...errors import NoSurvivors, PlacementError
from ..policy import choose_snapshot, choose_source, hand_over_by_copy, secure_at_once, secure_where
from .actors import Roster, resources_text, start_worker
from .slots import Joiner

if TYPE_CHECKING:
    from . import RayWorkerGroup


class Unwaited:
    """The replacements an attempt of a recovery started (`_replace`) and did not wait for
    (the attempt failed first): a process still starting, importing torch, answers nothing
    and holds no state; the next attempt waits for it like a new one, not asking it and
    taking it for hung."""

    def __init__(self) -> None:
        self.actors: list[Any] = []

    def add(self, actor: Any) -> None:
        self.actors.append(actor)

    def ranks(self, roster: Roster, dead: list[int]) -> list[int]:
        """The ranks (not in `dead`) whose worker is such a replacement."""
        return [r for r, actor in enumerate(roster.actors) if r not in dead and any(actor is a for a in self.actors)]

    def clear(self) -> None:
        """Waited for (or the group shut down)."""
        self.actors = []


def from_survivor(group: RayWorkerGroup, dead: list[int], leave: list[int] = (),
                  regrow: list[int] = ()) -> Reformed:
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
    scaling, roster = group.config.scaling, group.roster
    world = len(roster.actors)
    starting = group.unwaited.ranks(roster, dead)
    leave = [r for r in leave if r not in dead and r not in starting]
    others = [r for r in range(world) if r not in dead and r not in starting]
    regrow = [r for r in regrow if r in dead] if others else []  # someone must go on
    asked = _replace(group, dead, regrow)
    waited = [r for r in dead if r not in regrow] + starting
    try:
        answers = group.forming.answers(others, "status")
        holders = {r: s for r, s in answers.items() if s.phase != "setup"}  # those with a training state
        early = secure_at_once(leaving=bool(leave), waited=bool(waited), holders=bool(holders),
                               joiners=bool(group.slots.ready_joiners(take=False)))
        secured = _secure_early(group, holders, leave, [r if r in asked else None for r in waited]) if early else None
    except ReformFailed as exc:
        raise _before_renumbering(exc, regrow, world) from None
    moved = _leave(group, leave)  # the state is secured: they go, for their replacements if up
    staying = len(others) - len(leave) + len(moved)
    placed = group.slots.wait_placed(roster, waited, staying + len(group.slots.ready_joiners(take=False)), asked)
    group.unwaited.clear()
    for rank in dead + starting:
        if rank not in placed:  # its slot stays reserved: it may join later
            ray.kill(roster.actors[rank], no_restart=True)
    placed.update(moved)
    keep = [r for r in range(world) if r in placed or (r not in dead and r not in starting and r not in leave)]
    if secured is None:
        try:
            secured = _secure(group, holders, keep)
        except ReformFailed as exc:
            raise _before_renumbering(exc, regrow, world) from None
    source, state_ref, at, secured_in = secured
    # Joiners take the state where it was secured for them; one up since waits for a resize.
    joiners = group.slots.ready_joiners(take=True) if state_ref is not None else []
    _renumber(group, keep, placed, joiners, leave)
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
    _form(group, calls, keep, dropped)
    from_copy = group.copies.holder is not None and not holders
    group.copies.after_form(roster, getattr(group.forming, "secured", None))
    group.forming.clear()
    _restock(group)
    return Reformed(step=at.step, nodes=list(roster.nodes), source=source,
                    state_from="memory" if source is not None else "copy" if from_copy else "object_store",
                    replaced=sorted(r for r in placed if r in dead or r in starting),
                    dropped=dropped, moved=sorted(moved),
                    added=len(joiners),
                    resynced=[r for r in holders if holders[r].position != at.position], secured=secured_in)


def _secure(group: RayWorkerGroup, holders: dict[int, Status],
            keep: list[int]) -> tuple[int | None, Any, Status, str | None]:
    """The state the group continues from (no newcomer takes it), secured where
    policy.secure_where says: in the object store (_take_state), in the lone holder's copy
    written now (copies.py; the object store where it has no room), or nowhere more."""
    forming = group.forming
    where = secure_where(holders, keep, secured_before=forming.secured is not None,
                         copies_wanted=group.copies.wanted)
    source = choose_source(holders)
    if where == "copy" and _write_copy(group, source) is None:
        where = "object_store"  # no room for the copy
    if where == "object_store":
        return *_take_state(group, holders, []), where
    return source, None, holders[source], where


def _secure_early(group: RayWorkerGroup, holders: dict[int, Status], leave: list[int],
                  takers: list[int | None]) -> tuple[int | None, Any, Status, str]:
    """The state secured before the re-form knows who stays (policy.secure_at_once), with
    `takers` the ranks waited for (None: one with no spare up to take it). Where all of
    them, and the survivors behind, are on the node of the survivor that gives it
    (policy.hand_over_by_copy), that survivor writes its copy into the node's shared memory
    and they read it there, about three times faster than through a put into the object
    store (docs/results/2026-11-27-spare-from-survivor-copy.md). Else, or where the copy has no room, the object store (_take_state)."""
    roster, forming = group.roster, group.forming
    if holders:
        source = choose_source(holders, leave)
        node = roster.nodes[source].node_id
        behind = [r for r in holders if holders[r].position != holders[source].position]  # they take it too
        takers = takers + behind
        nodes = [roster.nodes[r].node_id if r is not None else None for r in takers]
        if hand_over_by_copy(node, nodes, leaving=bool(leave), secured_before=forming.secured is not None,
                             joiners=bool(group.slots.ready_joiners(take=False))):
            step = _write_copy(group, source)
            if step is not None:
                return source, CopiedState(group.copies.holder[2], step), holders[source], "copy"
    return (*_take_state(group, holders, leave), "object_store")


def _write_copy(group: RayWorkerGroup, source: int) -> int | None:
    """Have survivor `source` write its state into its node's copy (copies.py): the step
    written, or None where the copy has no room."""
    roster = group.roster
    return group.forming.answer(source, group.copies.copy_now(roster.actors[source], roster.nodes[source].node_id))


def _take_state(group: RayWorkerGroup, holders: dict[int, Status], leave: list[int]) -> tuple[int | None, Any, Status]:
    """forming.take_state; with no survivor and nothing secured by this recovery, the
    copy a lone survivor kept (copies.py), which is secured for this recovery then."""
    try:
        return group.forming.take_state(holders, avoid=leave)
    except NoSurvivors:
        kept = group.copies.newest()
        if kept is None:
            raise
        group.forming.secured = kept
        return None, kept[1], kept[0]


def from_peers(group: RayWorkerGroup, dead: list[int], regrow: list[int] = (), grow: bool = False,
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
    (worker/state/reshard.py)."""
    roster = group.roster
    world = len(roster.actors)
    leave = [r for r in leave if r not in dead]
    others = [r for r in range(world) if r not in dead]
    regrow = [r for r in regrow if r in dead] if others else []
    kept = group.forming.resharding  # every rank's snapshot, secured by an earlier attempt
    if not (regrow or grow or leave or kept):
        return _same_size_from_peers(group, dead)
    asked = _replace(group, dead, regrow)
    try:
        if kept is not None:
            step, parts, peers = kept[0], kept[1], {}
        else:
            step, held = _newest_snapshot(group, world, dead, others)
            parts, peers = group.forming.secure_all(step, world, others, held)
    except ReformFailed as exc:
        raise _before_renumbering(exc, regrow, world) from None
    moved = _leave(group, leave)  # the snapshots are secured: they go, for their replacements if up
    waited = [r for r in dead if r not in regrow]
    placed = group.slots.wait_placed(roster, waited, len(others) - len(leave) + len(moved), asked)
    for rank in dead:
        if rank not in placed:
            ray.kill(roster.actors[rank], no_restart=True)
    missing = [r for r in waited if r not in placed]
    if missing:
        raise NoSurvivors(f"no replacement for rank(s) {missing} was placed within "
                          f"scaling.replace_timeout_s={group.config.scaling.replace_timeout_s:g}")
    joiners = group.slots.ready_joiners(take=True) if grow else []
    placed.update(moved)
    keep = [r for r in range(world) if r in placed or (r not in dead and r not in leave)]
    # A worker that stays in its own process loads its own snapshot from memory.
    own = {r for r in keep if r not in placed and kept is None}
    loads = [Reshard(step, tuple(Snapshot(step, r) if r == old and r in own else parts[r]
                                 for r in range(len(parts))))
             for old in keep + [None] * len(joiners)]
    _renumber(group, keep, placed, joiners, leave)
    # Until the group has formed, any attempt can re-shard from these, whoever is left.
    group.forming.resharding = (step, parts)
    dropped = [r for r in dead + leave if r not in placed]
    _form(group, {rank: (None, load) for rank, load in enumerate(loads)}, keep, dropped)
    group.forming.clear()
    _restock(group)
    return Reformed(step=step, nodes=list(roster.nodes), source=None, state_from="peers",
                    replaced=sorted(r for r in placed if r in dead),
                    dropped=dropped, moved=sorted(moved),
                    added=len(joiners), snapshot_step=step, peers=peers)


def _same_size_from_peers(group: RayWorkerGroup, dead: list[int]) -> Reformed:
    roster = group.roster
    world = len(roster.actors)
    lost = dead + group.unwaited.ranks(roster, dead)  # a replacement not up yet holds nothing either
    asked = _replace(group, dead)
    others = [r for r in range(world) if r not in lost]
    step, held = _newest_snapshot(group, world, lost, others)
    loads, peers = group.forming.secure_copies(step, world, others, held)
    placed = group.slots.wait_placed(roster, lost, len(others), asked)
    group.unwaited.clear()
    missing = [r for r in lost if r not in placed]
    if missing:
        raise NoSurvivors(f"no replacement for rank(s) {missing} was placed within "
                          f"scaling.replace_timeout_s={group.config.scaling.replace_timeout_s:g}, and peer "
                          "snapshots restore the same world size only")
    roster.nodes = [placed.get(r) or roster.nodes[r] for r in range(world)]
    group.forming.form({rank: (None, loads[rank]) for rank in range(world)}, group.use_gpu)
    group.forming.clear()
    _restock(group)
    return Reformed(step=step, nodes=list(roster.nodes), source=None, state_from="peers",
                    replaced=sorted(lost), snapshot_step=step, peers=peers)


def _newest_snapshot(group: RayWorkerGroup, world: int, lost: list[int],
                     others: list[int]) -> tuple[int, dict[int, Holdings]]:
    """The step of the newest peer snapshots from which every rank's state can be had
    (policy.choose_snapshot), and what the `others` hold; NoSurvivors where none serves."""
    held = group.forming.answers(others, "snapshots_held")
    secured = {rank: step for rank, (step, _) in group.forming.copies.items()}
    choice = choose_snapshot(world, lost, held, secured)
    if choice.step is None:
        raise NoSurvivors(f"no peer snapshot serves: {choice.why}")
    return choice.step, held


def _replace(group: RayWorkerGroup, dead: list[int], regrow: list[int] = ()) -> dict[int, Any]:
    """Kill the `dead` ranks' workers and start their replacements: the one started for
    a draining node's rank, else a warm spare that is up on its node (in the rank's
    slot), else a new worker in a new slot (its node may be lost: slots.py); none for the
    ranks in `regrow` (reform starts theirs later). Returns, by rank, the node() call a
    replacement already answers (a spare's, made as it started), for wait_placed."""
    roster = group.roster
    asked: dict[int, Any] = {}
    for rank in dead:
        group.kill(rank)
        if rank in group.moves:  # its node was drained: its replacement is elsewhere
            group.moves.take(roster, rank, wait=True)
            continue
        taken = None if rank in regrow else group.spares.take(roster.nodes[rank].node_id)
        if taken is not None:
            # From now on the roster names the spare (its node, its pid), even where this
            # attempt fails before the placement (a worker lost while the state is secured).
            roster.actors[rank], asked[rank], roster.nodes[rank] = taken
            continue
        roster.slots[rank] = group.slots.renew(roster.slots[rank])
        if rank not in regrow:
            roster.actors[rank] = start_worker(group.config, group.bundle, roster.slots[rank])
            group.unwaited.add(roster.actors[rank])
    # Replacements of the ranks left behind start once the group has formed (_restock),
    # the next spares once it has trained a step (RayWorkerGroup.poll), not now: starting a
    # process and importing torch takes the cores the recovery needs (on a small machine,
    # it held up the spare taking over when that was still starting), and one started now would
    # still be starting at a recovery's next attempt.
    return asked


def _before_renumbering(exc: ReformFailed, regrow: list[int], world: int) -> ReformFailed:
    """A worker lost while the state was secured, before the ranks were renumbered: the
    ranks left behind to regrow are gone too."""
    return ReformFailed(exc.failures, sorted(set(exc.dead) | set(regrow)), world)


def _leave(group: RayWorkerGroup, leave: list[int]) -> dict[int, Node]:
    """The `leave` ranks' workers go, each replaced by the worker started for it elsewhere
    where that is up (moves): rank -> its replacement's node."""
    moved: dict[int, Node] = {}
    for rank in leave:
        group.kill(rank)
        node = group.moves.take(group.roster, rank) if rank in group.moves else None
        if node is not None:
            moved[rank] = node
    return moved


def _renumber(group: RayWorkerGroup, keep: list[int], placed: dict[int, Node], joiners: list[Joiner],
              leave: list[int]) -> None:
    """The roster becomes the `keep` ranks (in their places, `placed`: on their replacements'
    nodes), then the joiners."""
    roster = group.roster
    group.moves.cancel_all()  # ranks are renumbered: replacements still wanted are asked again
    if leave:
        group.spares.keep_only_on({(placed.get(r) or roster.nodes[r]).node_id for r in keep})
    roster.actors = [roster.actors[r] for r in keep] + [actor for _, actor, _ in joiners]
    roster.slots = [roster.slots[r] for r in keep] + [slot for slot, _, _ in joiners]
    roster.nodes = [placed.get(r) or roster.nodes[r] for r in keep] + [node for _, _, node in joiners]


def _form(group: RayWorkerGroup, calls: dict[int, tuple[bool | None, Any]], keep: list[int],
          dropped: list[int]) -> None:
    """forming.form over the renumbered ranks; a worker lost meanwhile is a ReformFailed
    that says how they were renumbered."""
    try:
        group.forming.form(calls, group.use_gpu)
    except ReformFailed as exc:
        raise ReformFailed(exc.failures, exc.dead, len(group.roster.actors), renumbered=(keep, dropped)) from None


def _restock(group: RayWorkerGroup) -> None:
    """Once a group has formed: start a worker in every free slot placed (the ranks left
    behind by a recovery get their replacements; they join at a resize). The spares used
    up start once the group has trained a step (RayWorkerGroup.poll)."""
    group.slots.start_joiners(group.roster.slots + group.moves.slots_in_use(), group.draining)
