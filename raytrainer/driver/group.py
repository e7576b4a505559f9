"""The Ray edge: placement groups and one Worker actor per reserved slot.

The controller drives any object with this interface (start, check_storage, setup, launch,
poll, status, dump_stacks, kill, reform, joinable, pause, shutdown); tests give it a fake
one without a cluster.

Slots: one placement group of scaling.min_workers bundles (with the placement strategy),
reserved all at once before anything starts, and for an elastic run one single-bundle
group per worker it may grow by, created after it. Those stay pending until the cluster
has room, which is also what asks the autoscaler for it; a slot whose group is placed
and whose worker is up is `joinable`. A slot whose node is lost is rescheduled by Ray
when room appears, and used again the same way.

A worker on a node being drained (preemption) gets a replacement in a new single-bundle
group, which Ray places on another node (it never places on a draining node); once the
workers have paused, the replacement takes the worker's rank and the state, and the
worker leaves. Its old slot stays with its group: a core bundle is rescheduled by Ray
once the node is gone (Ray cannot release one bundle of a group) and serves an elastic
run as a slot to grow into; an elastic extra's own group is removed.
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from ..config import Config
from ..contract import WORKER_ACTOR, Failure, Formed, Node, Poll, ReformFailed, Reformed, RunEnd, Snapshot, Status
from ..errors import NoSurvivors, PeerFailure, PlacementError, RaytrainerError, WorkerError
from .policy import choose_snapshot, choose_state, keep_waiting_for_placement
from .storage_check import check_shared_storage
from ..task import import_object

from pathlib import Path

# Calls the driver makes while run() trains or is blocked: a concurrency group of their
# own, so that a worker stuck in a collective still answers them.
CONTROL = "control"


def worker_bundle(config: Config, use_gpu: bool) -> dict[str, float]:
    bundle = dict(config.scaling.resources_per_worker or {"CPU": 1})
    if use_gpu:
        bundle.setdefault("GPU", 1)
    return {k: float(v) for k, v in bundle.items() if v}


class RayWorkerGroup:
    def __init__(self, config: Config, use_gpu: bool, *, cluster_can_grow: bool = True,
                 run_dir: Path | None = None):
        self.config = config
        self.run_dir = run_dir
        self.use_gpu = use_gpu
        self.cluster_can_grow = cluster_can_grow
        self.bundle = worker_bundle(config, use_gpu)
        self.actors: list[Any] = []  # by rank
        self.nodes: list[Node] = []  # by rank
        self.slots: list[tuple[Any, int]] = []  # by rank: (placement group, bundle index)
        self.pgs: list[Any] = []  # the core group first
        self._joining: list[tuple[tuple[Any, int], Any, Any]] = []  # (slot, actor, its node() ref)
        self._runs: list[Any] = []
        self._pending: list[Any] = []
        self._finished: dict[int, RunEnd] = {}
        # A warm spare: an idle actor with torch imported, on a bundle's node but holding no
        # resources, takes a lost worker's place in a fraction of a cold start (CPU workers
        # only: a GPU worker needs its GPU assigned by Ray at creation).
        self._spare: Any = None
        self._spare_node: Any = None
        # During a recovery: the state every worker is to continue from, once taken from a
        # survivor, with that survivor's status. Kept in the object store (the driver owns
        # the reference) until the group re-forms, so a second failure meanwhile, even of
        # every survivor, does not lose it.
        self._secured: tuple[Status, Any] | None = None
        # The same for sharded state: rank -> (step, its peer snapshot's reference), for the
        # lost ranks whose copy was taken from its holder (reform_from_peers).
        self._copies: dict[int, tuple[int, Any]] = {}
        self._drain_ref: Any = None  # rank 0's drain() call, while it has not answered
        # rank -> (its new slot, the worker started there, that worker's node() ref), for
        # workers on a draining node until they leave (`replacements`, `reform(leave=)`).
        self._moves: dict[int, tuple[tuple[Any, int], Any, Any]] = {}

    # ------------------------------------------------------------------ lifecycle

    # An elastic run starts with the slots beyond min_workers that the cluster places
    # this quickly; the others join later, at a resize.
    EXTRA_AT_START_S = 1.0
    # After one worker's call failed while the group formed, how long the others get to
    # return (they fail at once where the lost peer had connected) before those still
    # blocked waiting for it are killed.
    FORM_GRACE_S = 2.0

    def start(self) -> list[Node]:
        """Reserve min_workers slots at once (and ask for the rest), start a worker in each
        placed slot; return the workers' nodes."""
        scaling = self.config.scaling
        self._check_fits(scaling.min_workers)
        core = placement_group([self.bundle] * scaling.min_workers, strategy=scaling.placement)
        self.pgs = [core]
        timeout = scaling.placement_timeout_s
        ready, _ = ray.wait([core.ready()], timeout=timeout)
        if not ready:
            raise PlacementError(
                f"could not place {scaling.min_workers} workers of {self.bundle} each "
                f"({scaling.placement}) within scaling.placement_timeout_s={timeout:g}; "
                f"{_resources_text()}. Lower scaling.num_workers (or min_workers) or "
                "scaling.resources_per_worker, or add nodes"
            )
        self.slots = [(core, i) for i in range(scaling.min_workers)]
        # Only now: single bundles asked for first could take the room the core needs.
        extras = [placement_group([self.bundle]) for _ in range(scaling.max_workers - scaling.min_workers)]
        self.pgs += extras
        if extras:
            refs = [pg.ready() for pg in extras]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.EXTRA_AT_START_S)
            self.slots += [(pg, 0) for pg, ref in zip(extras, refs) if ref in ready]
        self.actors = [self._actor(slot) for slot in self.slots]
        self.nodes = _gather([a.node.remote() for a in self.actors])
        return self.nodes  # the warm spare starts once training runs (poll)

    def _actor(self, slot: tuple[Any, int], spare: bool = False) -> Any:
        extra = {k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")}
        pg, bundle = slot
        return _remote_worker().options(
            num_cpus=0 if spare else self.bundle.get("CPU", 0),
            num_gpus=0 if spare else self.bundle.get("GPU", 0),
            resources=None if spare else extra or None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
        ).remote(self.config.to_dict())

    def check_storage(self, nodes: list[Node]) -> dict[str, Any] | None:
        """Fail now if workers on other nodes cannot see the run directory."""
        if self.run_dir is None:
            return None
        return check_shared_storage(
            self.run_dir, self.config.run.storage, nodes, ray.get_runtime_context().get_node_id(),
            lambda path: _gather([a.sees_file.remote(path) for a in self.actors]),
        )

    def setup(self, resume: bytes | str | None = None) -> Formed:
        """Form the process group and build the task on every worker, loading `resume`
        (checkpoint bytes, put in the object store once for all workers, or a sharded
        checkpoint's URI). Raises ReformFailed if a worker is lost meanwhile."""
        self._secured, self._copies = None, {}
        state = ray.put(resume) if resume is not None else None
        results = self._form_group({rank: (None, state) for rank in range(len(self.actors))})
        total_steps, steps_per_epoch, replicated = results[0]
        return Formed(list(self.nodes), total_steps, steps_per_epoch, replicated)

    def launch(self) -> None:
        self._runs = [a.run.remote() for a in self.actors]
        self._pending = list(self._runs)
        self._finished = {}
        self._drain_ref = None

    def poll(self, timeout: float) -> Poll:
        """Wait up to `timeout` for any worker's run() to end; collect new metric rows, and
        how each run() that ended did, if not by finishing."""
        ready, self._pending = ray.wait(self._pending, num_returns=1, timeout=timeout)
        # The warm spare, started here rather than with the workers: a process importing
        # torch beside workers that build their task and take their first step, on the
        # same cores, delays that step.
        self._start_spare()
        if ready and self._pending:  # whatever else has ended too, without waiting
            more, self._pending = ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
            ready += more
        poll = Poll(*self._drain(timeout=1.0))
        for ref in ready:
            rank = self._runs.index(ref)
            outcome = self._outcome(rank, ref)
            if isinstance(outcome, Failure):
                poll.failures.append(outcome)
            elif outcome.status == "interrupted":
                poll.failures.append(Failure(rank, "interrupted", outcome.cause, outcome.step, self.nodes[rank].ip))
            elif outcome.status == "paused":
                poll.paused[rank] = outcome
            else:
                self._finished[rank] = poll.finished[rank] = outcome
        if len(self._finished) == len(self._runs) and not poll.failures:
            poll.done = True
            poll.result = self._finished[0]
            rows, events = self._drain(timeout=30.0)
            poll.rows += rows
            poll.events += events
        return poll

    def _outcome(self, rank: int, ref: Any) -> Any:
        """What a call on `rank` returned, or the Failure it ended in."""
        ip = self.nodes[rank].ip if rank < len(self.nodes) else None
        try:
            return ray.get(ref)
        except RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            if isinstance(cause, PeerFailure):
                return Failure(rank, "interrupted", str(cause), None, ip)
            step = cause.step - 1 if isinstance(cause, WorkerError) and cause.step else None
            message = cause.message if isinstance(cause, WorkerError) else f"{type(cause).__name__}: {cause}"
            if not isinstance(cause, RaytrainerError):
                cause = WorkerError(rank, message)
            return Failure(rank, "error", message, step, ip, cause)
        except RayActorError as exc:
            return Failure(rank, "died", f"the worker process died ({type(exc).__name__}): "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}", None, ip)

    # ------------------------------------------------------------------ control

    def status(self, timeout: float = 1.0) -> list[Status | None]:
        """Each worker's progress (None: no answer within `timeout`, or dead)."""
        return self._ask(range(len(self.actors)), "status", timeout)

    def _ask(self, ranks: Any, method: str, timeout: float) -> list[Any]:
        """A control call on each of `ranks`; None for those that did not answer in time."""
        refs = [_control(self.actors[r], method).remote() for r in ranks]
        ray.wait(refs, num_returns=len(refs), timeout=timeout)
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref, timeout=0))
            except (GetTimeoutError, RayActorError, RayTaskError):
                out.append(None)
        return out

    def dump_stacks(self, rank: int, timeout: float = 5.0) -> str | None:
        return self._ask([rank], "dump_stacks", timeout)[0]

    def flight_record(self, rank: int, timeout: float = 5.0) -> bytes | None:
        return self._ask([rank], "flight_record", timeout)[0]

    def abort(self, ranks: list[int]) -> None:
        """Abort the NCCL communicators of `ranks` (a no-op on Gloo workers), so that they
        stop waiting for a lost peer now, not at failure.collective_timeout_s."""
        self._ask(ranks, "abort", timeout=5.0)

    def kill(self, rank: int) -> None:
        """Kill a worker now. ray.kill alone waits for a frozen (SIGSTOPed) process to exit
        gracefully for RAY_kill_worker_timeout_milliseconds (5 s) before Ray kills it, and
        its peers wait with it: a SIGKILL from another of our processes on its node (a
        peer's control channel answers at once; else a task there, which may first have
        to start a process) ends it in milliseconds."""
        node = self.nodes[rank] if rank < len(self.nodes) else None
        if node is not None and node.pid:
            helpers = [a for r, a in enumerate(self.actors) if r != rank and r < len(self.nodes)
                       and self.nodes[r].node_id == node.node_id]
            if helpers:
                _control(helpers[0], "kill_process").remote(node.pid)
            elif node.node_id:
                ray.remote(_sigkill).options(
                    num_cpus=0, max_retries=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)).remote(node.pid)
        ray.kill(self.actors[rank], no_restart=True)

    def joinable(self) -> int:
        """Start a worker in every free slot the cluster has placed; return how many
        started workers are ready to join at the next `reform`."""
        placed: dict[Any, dict[int, str] | None] = {}  # pg -> its bundles' nodes, once placed
        draining = None
        for slot in self._free_slots():
            pg = slot[0]
            if pg not in placed:
                table = placement_group_table(pg)
                placed[pg] = table.get("bundles_to_node_id", {}) if table.get("state") == "CREATED" else None
            if placed[pg] is not None:
                if draining is None:
                    draining = self.draining()
                if placed[pg].get(slot[1]) in draining:  # a slot on a node about to go: not now
                    continue
                actor = self._actor(slot)
                self._joining.append((slot, actor, actor.node.remote()))
        return len(self._ready_joiners(take=False))

    def draining(self) -> dict[str, float | None]:
        """The nodes being drained: node id -> deadline (time.time() seconds, None: none).
        Ray's own view, as Ray Train's and Ray Data's preemption handling read it (a
        private API: none public yet); {} if it cannot be read."""
        try:
            from ray._private import state

            nodes = state.state.get_draining_nodes()  # node id hex -> deadline ms, 0: none
        except Exception:  # noqa: BLE001 - an older Ray, or the GCS busy: look again later
            return {}
        return {node: (ms / 1000 if ms else None) for node, ms in nodes.items()}

    def replacements(self, ranks: list[int]) -> list[int]:
        """Start a worker on another node for each of `ranks` (in a new single-bundle
        group, which Ray places off draining nodes; pending until the cluster has room,
        which asks the autoscaler for it); give up those started for ranks not asked now;
        return the ranks whose replacement is up."""
        for rank in [r for r in self._moves if r not in ranks]:
            self._cancel_move(rank)
        for rank in ranks:
            if rank not in self._moves:
                slot = (placement_group([self.bundle]), 0)
                self.pgs.append(slot[0])
                actor = self._actor(slot)
                self._moves[rank] = (slot, actor, actor.node.remote())
        ready = []
        for rank, (slot, actor, ref) in list(self._moves.items()):
            try:
                ray.get(ref, timeout=0)
                ready.append(rank)
            except GetTimeoutError:
                pass
            except (RayActorError, RayTaskError):  # it died (its node with it?): start another
                ray.kill(actor, no_restart=True)
                actor = self._actor(slot)
                self._moves[rank] = (slot, actor, actor.node.remote())
        return sorted(ready)

    def _cancel_move(self, rank: int) -> None:
        slot, actor, _ = self._moves.pop(rank)
        ray.kill(actor, no_restart=True)
        self._release(slot)

    def _release(self, slot: tuple[Any, int]) -> None:
        """Give back a slot no worker uses, where Ray allows it: a group of its own is
        removed; a bundle of the core group stays reserved (a slot to grow into)."""
        pg = slot[0]
        if pg is not self.pgs[0] and len(pg.bundle_specs) == 1 and pg in self.pgs:
            self.pgs.remove(pg)
            remove_placement_group(pg)

    def _take_move(self, rank: int, wait: bool = False) -> Node | None:
        """Put the replacement started for `rank` in its place if it is up (or, with
        `wait`, whether or not: the caller waits for it to be placed); its node if up."""
        slot, actor, ref = self._moves[rank]
        try:
            node = ray.get(ref, timeout=0)
        except (GetTimeoutError, RayActorError, RayTaskError):
            node = None
            if not wait:
                return None
        del self._moves[rank]
        old = self.slots[rank]
        self.actors[rank], self.slots[rank] = actor, slot
        self._release(old)
        return node

    def pause(self) -> None:
        """Ask every worker to pause at a step boundary they agree on (run() returns "paused")."""
        for actor in self.actors:
            _control(actor, "request_pause").remote()

    # ------------------------------------------------------------------ recovery

    def reform(self, dead: list[int], leave: list[int] = ()) -> Reformed:
        """Re-form the process group after a failure or a pause; every worker must have
        stopped. The `dead` ranks get a new worker (the one started by `replacements` for
        them, else one in their slot) if one is placed in time
        (policy.keep_waiting_for_placement), and are dropped otherwise. The `leave` ranks
        (alive, on a draining node) give way to their replacement where it is up, and are
        dropped otherwise. Workers ready to join are added. Ranks keep their order (the
        remaining ones close up, newcomers come last). Every worker gets the state of the
        survivor furthest ahead (one staying, among equals), unless it has it already; with
        no survivor, the state secured by an earlier attempt of this recovery. Raises
        NoSurvivors when there is neither, and ReformFailed when a worker is lost meanwhile
        (call again with its `dead`)."""
        scaling = self.config.scaling
        world = len(self.actors)
        leave = [r for r in leave if r not in dead]
        asked = self._replace(dead)
        others = [r for r in range(world) if r not in dead]
        answers = self._answers(others, "status")
        holders = {r: s for r, s in answers.items() if s.phase != "setup"}  # those with a training state
        source, state_ref, at = self._take_state(holders, avoid=leave)
        moved: dict[int, Node] = {}
        for rank in leave:  # its state is secured: it goes, for its replacement if up
            self.kill(rank)
            node = self._take_move(rank) if rank in self._moves else None
            if node is not None:
                moved[rank] = node
        staying = len(others) - len(leave) + len(moved)
        placed = self._wait_placed(dead, staying + len(self._ready_joiners(take=False)), asked)
        for rank in dead:
            if rank not in placed:  # its slot stays reserved: it may join later
                ray.kill(self.actors[rank], no_restart=True)
        joiners = self._ready_joiners(take=True)
        placed.update(moved)
        keep = [r for r in range(world) if r in placed or (r not in dead and r not in leave)]
        for rank in list(self._moves):  # ranks are renumbered: replacements still wanted are asked again
            self._cancel_move(rank)
        staying_on = {(placed.get(r) or self.nodes[r]).node_id for r in keep}
        if leave and self._spare is not None and self._spare_node[1] not in staying_on:
            ray.kill(self._spare, no_restart=True)  # it was beside a worker that left
            self._spare = None
        self.actors = [self.actors[r] for r in keep] + [actor for _, actor, _ in joiners]
        self.slots = [self.slots[r] for r in keep] + [slot for slot, _, _ in joiners]
        self.nodes = [placed.get(r) or self.nodes[r] for r in keep] + [node for _, _, node in joiners]
        if len(self.actors) < scaling.min_workers:
            raise PlacementError(
                f"only {len(self.actors)} workers could be placed within scaling.placement_timeout_s="
                f"{scaling.placement_timeout_s:g} after losing rank(s) {dead}, fewer than "
                f"scaling.min_workers={scaling.min_workers}; {_resources_text()}. Add nodes, or "
                "lower scaling.min_workers (or num_workers)"
            )
        # Holders regroup (taking the state only if behind); the others build the task from it.
        calls = {}
        for rank, old in enumerate(keep + [None] * len(joiners)):
            if old in holders and old not in moved:
                calls[rank] = (holders[old].position != at.position, state_ref)
            else:
                calls[rank] = (None, state_ref)
        self._form_group(calls)
        self._secured = None
        self._start_spare()
        return Reformed(step=at.step, nodes=list(self.nodes), source=source,
                        state_from="memory" if source is not None else "object_store",
                        replaced=sorted(r for r in placed if r in dead),
                        dropped=[r for r in dead + leave if r not in placed], moved=sorted(moved),
                        added=len(joiners),
                        resynced=[r for r in holders if holders[r].position != at.position])

    def reform_from_peers(self, dead: list[int]) -> Reformed:
        """Sharded state: replace the `dead` ranks (the same slots, so the same world size)
        and form the group again from the newest peer snapshot left of every rank's state
        (policy.choose_snapshot): survivors load their own, each replacement the copy its
        successor holds, which the driver secures first (kept in the object store until the
        group has formed, so a failure meanwhile does not lose it). Every worker builds its
        training state anew in the new group (a sharded model is bound to the group it was
        sharded over); the run replays the steps since the snapshot. Raises NoSurvivors when
        no snapshot serves or a replacement cannot be placed (a checkpoint is the way back
        then), and ReformFailed when a worker is lost meanwhile."""
        world = len(self.actors)
        asked = self._replace(dead)
        others = [r for r in range(world) if r not in dead]
        held = self._answers(others, "snapshots_held")
        secured = {rank: step for rank, (step, _) in self._copies.items()}
        step, why = choose_snapshot(world, dead, held, secured)
        if step is None:
            raise NoSurvivors(f"no peer snapshot serves: {why}")
        loads: dict[int, Any] = {}  # rank -> what its worker loads
        peers: dict[int, int] = {}  # rank -> the holder of the copy it loads
        fetch: dict[Any, int] = {}  # a holder's answer -> the rank whose copy it gives
        for rank in range(world):
            if rank in others and step in held[rank].own:
                loads[rank] = Snapshot(step, rank)  # its own, in its memory
            elif secured.get(rank) == step:
                loads[rank] = self._copies[rank][1]
            else:
                peers[rank] = (rank + 1) % world
                ok, loads[rank] = self.actors[peers[rank]].peer_snapshot.options(num_returns=2).remote(step)
                fetch[ok] = rank
        # The small answer says whether the copy is there; the copy itself stays in the
        # object store (owned here) for the replacement to load.
        _, failures, _ = self._wait_answering({ok: peers[rank] for ok, rank in fetch.items()}, grace_s=0.0)
        failed = sorted({f.rank for f in failures})
        for rank in fetch.values():
            if peers[rank] not in failed:
                self._copies[rank] = (step, loads[rank])
        if failures:
            for holder in failed:
                self.kill(holder)
            raise ReformFailed(failures, failed)
        placed = self._wait_placed(dead, len(others), asked)
        missing = [r for r in dead if r not in placed]
        if missing:
            raise NoSurvivors(f"no replacement for rank(s) {missing} was placed within "
                              f"scaling.replace_timeout_s={self.config.scaling.replace_timeout_s:g}, and peer "
                              "snapshots restore the same world size only")
        self.nodes = [placed.get(r) or self.nodes[r] for r in range(world)]
        self._form_group({rank: (None, loads[rank]) for rank in range(world)})
        self._copies = {}
        self._start_spare()
        return Reformed(step=step, nodes=list(self.nodes), source=None, state_from="peers",
                        replaced=sorted(dead), snapshot_step=step, peers=peers)

    def _replace(self, dead: list[int]) -> dict[int, Any]:
        """Kill the `dead` ranks' workers and start their replacements: the one started for
        a draining node's rank, else the warm spare, else a new worker in the rank's slot.
        Returns, by rank, the node() call a replacement already answers or will (the spare's,
        made as it started), for _wait_placed: one call fewer to wait for."""
        asked: dict[int, Any] = {}
        for rank in dead:
            self.kill(rank)
            if rank in self._moves:  # its node was drained: its replacement is elsewhere
                self._take_move(rank, wait=True)
                continue
            call = self._spare_node[0] if self._spare is not None else None
            spare = self._take_spare(rank)
            if spare is not None:
                asked[rank] = call
            self.actors[rank] = spare or self._actor(self.slots[rank])  # its slot is free again
        # The next spare starts once the group has formed (reform, reform_from_peers), not
        # now: starting a process and importing torch took the cores the recovery needed
        # (on 2 cores, it held up the spare taking over when that was still starting),
        # and one started now would still be starting at a recovery's next attempt.
        return asked

    def _answers(self, ranks: list[int], method: str) -> dict[int, Any]:
        """A control call on each of `ranks`, which must all answer: one that does not is
        dead or frozen, killed, and replaced at the next attempt (ReformFailed)."""
        answers = dict(zip(ranks, self._ask(ranks, method, timeout=10.0)))
        silent = [r for r, a in answers.items() if a is None]
        if silent:
            for rank in silent:
                self.kill(rank)
            raise ReformFailed([Failure(r, "hung", "did not answer while the group re-formed", None,
                                        self.nodes[r].ip) for r in silent], silent)
        return answers

    def _take_state(self, holders: dict[int, Status], avoid: list[int] = ()) -> tuple[int | None, Any, Status]:
        """The state to continue from: the furthest survivor's (not one of `avoid` among
        equals), put in the object store (and kept there until the group has re-formed),
        else one secured earlier."""
        source, take = choose_state(holders, self._secured[0] if self._secured else None, avoid=avoid)
        if not take:
            if self._secured is None:
                raise NoSurvivors("no worker survived")
            at, ref = self._secured
            return source, ref, at
        at = holders[source]
        ref = self.actors[source].get_state.remote()
        _, failures, _ = self._wait_answering({ref: source}, grace_s=0.0)
        if failures:
            self.kill(source)
            raise ReformFailed(failures, [source])
        self._secured = (at, ref)
        return source, ref, at

    def _form_group(self, calls: dict[int, tuple[bool | None, Any]]) -> dict[int, Any]:
        """Form the group over all actors: per rank (None: build the task with `setup`;
        True/False: `regroup`, taking the state or not) and the state's reference. Returns
        each rank's result. If a call fails, the others get FORM_GRACE_S to return, those
        still blocked (waiting for the lost peer) are killed, and ReformFailed says who."""
        world = len(self.actors)
        refs: dict[Any, int] = {}
        # Waited for like the forming calls below, with the same hang check: a rank 0 that
        # froze (or never answers) would otherwise hold the driver here for ever.
        where, failures, _ = self._wait_answering({self.actors[0].rendezvous.remote(): 0}, grace_s=0.0)
        if failures:
            self.kill(0)
            raise ReformFailed(failures, [0])
        addr, port = where[0]
        for rank, (take, state) in calls.items():
            actor = self.actors[rank]
            if take is None:
                refs[actor.setup.remote(rank, world, addr, port, self.use_gpu, state)] = rank
            else:
                refs[actor.regroup.remote(rank, world, addr, port, state if take else None)] = rank
        results, failures, pending = self._wait_answering(refs, grace_s=self.FORM_GRACE_S)
        if not failures:
            return results
        stuck = sorted(pending)
        lost = sorted({f.rank for f in failures if f.kind != "interrupted"} | set(stuck))
        for rank in lost:
            self.kill(rank)
        raise ReformFailed(failures, lost)

    def _wait_answering(self, refs: dict[Any, int], grace_s: float) -> tuple[dict[int, Any], list[Failure], list[int]]:
        """Wait for the calls `refs` (ref -> rank) to return: their results and failures,
        and the ranks still pending. After the first failure the others get `grace_s`. A
        worker frozen meanwhile would hold the others (in a rendezvous, until
        failure.collective_timeout_s) or this wait: one that has not answered its control
        channel for step_timeout_s is hung. So is one that answers but has not reached the
        group's rendezvous for step_timeout_s while a peer has waited there as long (stuck
        in its own code, or its call never started): the peers wait for it, not the
        reverse, and would otherwise wait failure.collective_timeout_s."""
        results: dict[int, Any] = {}
        failures: list[Failure] = []
        pending, deadline = list(refs), None
        answered = {rank: time.monotonic() for rank in refs.values()}  # when each last answered
        # rank -> (before, in or past the rendezvous, since when it was seen there)
        where = {rank: ("before", time.monotonic()) for rank in refs.values()}
        timeout_s = self.config.failure.step_timeout_s
        while pending and (deadline is None or time.monotonic() < deadline):
            ready, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in ready:
                outcome = self._outcome(refs[ref], ref)
                if isinstance(outcome, Failure):
                    failures.append(outcome)
                    deadline = deadline or time.monotonic() + grace_s
                else:
                    results[refs[ref]] = outcome
            if ready or timeout_s is None:
                continue
            waiting, now = [refs[ref] for ref in pending], time.monotonic()
            for rank, status in zip(waiting, self._ask(waiting, "status", timeout=1.0)):
                if status is not None:
                    answered[rank] = now
                    at = {"joining": "in", "joined": "past"}.get(status.forming, "before")
                    if at != where[rank][0]:
                        where[rank] = (at, now)
                elif now - answered[rank] > timeout_s and rank not in {f.rank for f in failures}:
                    failures.append(Failure(rank, "hung", f"did not answer for {timeout_s:g} s "
                                            "(failure.step_timeout_s) while the group re-formed", None,
                                            self.nodes[rank].ip))
                    deadline = deadline or now + grace_s
            if any(where[r][0] == "in" and now - where[r][1] > timeout_s for r in waiting):
                for rank in waiting:
                    if (where[rank][0] == "before" and now - where[rank][1] > timeout_s
                            and now - answered[rank] < timeout_s and rank not in {f.rank for f in failures}):
                        failures.append(Failure(rank, "hung", f"did not reach the group's rendezvous for "
                                                f"{timeout_s:g} s (failure.step_timeout_s) while its peers "
                                                "waited there", None, self.nodes[rank].ip))
                        deadline = deadline or now + grace_s
        return results, failures, [refs[ref] for ref in pending]

    def _start_spare(self) -> None:
        if self._spare is None and self.config.failure.warm_spare and not self.use_gpu and self.slots:
            self._spare = self._actor(self.slots[0], spare=True)
            self._spare_node = (self._spare.node.remote(), self.nodes[0].node_id)

    def _take_spare(self, rank: int) -> Any:
        """The spare, if it is (or is being) started on the node of `rank`'s bundle; used
        even while it still imports torch, it is ahead of a cold start."""
        if self._spare is None:
            return None
        ref, node_id = self._spare_node
        try:
            node_id = ray.get(ref, timeout=0).node_id
        except GetTimeoutError:
            pass
        except (RayActorError, RayTaskError):  # it died (its node with it?): start a new one later
            self._spare = None
            return None
        if node_id != self.nodes[rank].node_id:
            return None
        spare, self._spare = self._spare, None
        if not any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            ray.kill(spare, no_restart=True)  # the node is gone, and the spare with it
            return None
        return spare

    def _wait_placed(self, ranks: list[int], others: int, asked: dict[int, Any] | None = None) -> dict[int, Node]:
        """Wait for the new workers of `ranks` to be placed and up (through their node()
        calls in `asked`, else new ones); return their nodes by rank. How long:
        policy.keep_waiting_for_placement."""
        scaling = self.config.scaling
        asked = asked or {}
        refs = {asked[r] if r in asked else self.actors[r].node.remote(): r for r in ranks}
        placed: dict[int, Node] = {}
        t0 = time.monotonic()
        while refs:
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0.1)
            for ref in ready:
                rank = refs.pop(ref)
                try:
                    placed[rank] = ray.get(ref)
                except (RayActorError, RayTaskError):
                    # Lost before it started: sent to the node that was just lost, before Ray
                    # knew it dead. Its slot is placed again elsewhere once there is room.
                    ray.kill(self.actors[rank], no_restart=True)
                    self.actors[rank] = self._actor(self.slots[rank])
                    refs[self.actors[rank].node.remote()] = rank
            if not keep_waiting_for_placement(time.monotonic() - t0, len(placed), others,
                                              min_workers=scaling.min_workers,
                                              replace_timeout_s=scaling.replace_timeout_s,
                                              placement_timeout_s=scaling.placement_timeout_s):
                break
        return placed

    def _free_slots(self) -> list[tuple[Any, int]]:
        taken = set(self.slots) | {slot for slot, _, _ in self._joining} | {m[0] for m in self._moves.values()}
        return [(pg, i) for pg in self.pgs for i in range(len(pg.bundle_specs)) if (pg, i) not in taken]

    def _ready_joiners(self, take: bool) -> list[tuple[tuple[Any, int], Any, Node]]:
        """The started workers that are up, as (slot, actor, node); `take` removes them
        from those joining. Workers that failed to start are dropped."""
        ready, still = [], []
        for slot, actor, ref in self._joining:
            try:
                node = ray.get(ref, timeout=0)
            except GetTimeoutError:
                still.append((slot, actor, ref))
                continue
            except (RayActorError, RayTaskError):
                ray.kill(actor, no_restart=True)
                continue
            ready.append((slot, actor, node))
            if not take:
                still.append((slot, actor, ref))
        self._joining = still
        return ready

    def shutdown(self) -> None:
        joining = [actor for _, actor, _ in self._joining] + [actor for _, actor, _ in self._moves.values()]
        for actor in self.actors + joining + ([self._spare] if self._spare is not None else []):
            ray.kill(actor, no_restart=True)
        self._spare = self._secured = None
        self._copies = {}
        self.actors, self._runs, self._pending, self._finished, self._joining = [], [], [], {}, []
        self._moves = {}
        for pg in self.pgs:
            remove_placement_group(pg)
        self.pgs, self.slots = [], []

    # ------------------------------------------------------------------ helpers

    def _drain(self, timeout: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Rank 0's new rows and events. A call not answered within `timeout` (rank 0 is
        frozen, or the machine busy) is collected at the next poll, never asked twice."""
        if self._drain_ref is None:
            self._drain_ref = _control(self.actors[0], "drain").remote()
        if not ray.wait([self._drain_ref], timeout=timeout)[0]:
            return [], []
        ref, self._drain_ref = self._drain_ref, None
        try:
            return ray.get(ref)
        except RayActorError:
            return [], []  # rank 0 died; its run() ref says why

    def _check_fits(self, num_workers: int) -> None:
        """Fail at once when no placement can ever succeed: the cluster cannot grow and
        lacks the resources in total."""
        if self.cluster_can_grow:
            return
        total = ray.cluster_resources()
        short = {k: v * num_workers for k, v in self.bundle.items() if v * num_workers > total.get(k, 0)}
        if short:
            raise PlacementError(
                f"{num_workers} workers of {self.bundle} each need {short} in total but "
                f"{_resources_text(free=False)}. Lower scaling.num_workers or "
                "scaling.resources_per_worker, or connect to a larger cluster (--address)"
            )


_REMOTE_WORKER: Any = None


def _remote_worker() -> Any:
    global _REMOTE_WORKER
    if _REMOTE_WORKER is None:
        _REMOTE_WORKER = ray.remote(concurrency_groups={CONTROL: 4})(import_object(WORKER_ACTOR, "contract.WORKER_ACTOR"))
    return _REMOTE_WORKER


def _control(actor: Any, method: str) -> Any:
    return getattr(actor, method).options(concurrency_group=CONTROL)


def _sigkill(pid: int) -> bool:
    import os
    import signal

    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def _resources_text(free: bool = True) -> str:
    """The cluster's schedulable resources, for error messages (placement groups' own
    bundle resources and node labels left out)."""
    total = ray.cluster_resources()
    keys = sorted(k for k in total if not k.startswith(("node:", "accelerator_type:"))
                  and "_group_" not in k and k not in ("memory", "object_store_memory"))
    if not free:
        return "the cluster has " + ", ".join(f"{k} {total[k]:g}" for k in keys) + " in total"
    available = ray.available_resources()
    return "the cluster has " + ", ".join(f"{k} {available.get(k, 0):g} free of {total[k]:g}" for k in keys)


def _get(ref: Any, rank: int) -> Any:
    try:
        return ray.get(ref)
    except RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, RaytrainerError):
            raise cause from None
        raise WorkerError(rank, str(cause or exc)) from None
    except RayActorError as exc:
        raise WorkerError(rank, f"the worker process died ({exc.__class__.__name__}): {exc}") from None


def _gather(refs: list[Any]) -> list[Any]:
    """ray.get of all refs, but raise the first failure as soon as it happens (the
    other workers may be blocked waiting for the failed one in a collective)."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        _get(ready[0], refs.index(ready[0]))
    return [ray.get(r) for r in refs]

