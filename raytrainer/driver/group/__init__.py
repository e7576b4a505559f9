"""The Ray edge: one Worker actor per reserved slot, driven as the contract's WorkerGroup.

The controller drives any object with the `contract.WorkerGroup` interface; tests give it
a fake one without a cluster. This one is split by concern:

    actors    the Roster (actor, node and slot by rank), making and calling an actor, kill
    slots     placement groups, one per slot, renewed when their node is lost; newcomers
    spares    warm spares, worker processes ready to replace a lost one on their node
    drains    nodes being drained, and replacements for the workers on them
    forming   forming the process group, its hang checks, the state workers continue from
    copies    the second copy of a lone survivor's state
    reforming the re-forms after a failure, a pause or a drain: from a survivor's state,
              or from peer snapshots

and RayWorkerGroup here puts them together: the lifecycle (start, setup, launch, poll,
shutdown), the control calls, and the re-forms.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import ray

from ...checkpoint import CheckpointRef
from ...config import Config
from ...contract import Failure, Formed, Node, Poll, ReformPlan, Reformed, RunEnd, Status
from ..storage_check import check_shared_storage
from . import actors, kept, orphans, reforming
from .actors import Roster, control, gather, start_worker, worker_bundle
from .drains import Moves, draining_nodes
from .copies import KeptCopies
from .forming import Forming
from .slots import Slots
from .spares import COLD_START_S, Pace, WarmSpares

__all__ = ["RayWorkerGroup", "worker_bundle"]


class RayWorkerGroup:
    def __init__(self, config: Config, use_gpu: bool, *, cluster_can_grow: bool = True,
                 run_dir: Path | None = None):
        kept.keep_s()  # a bad RAYTRAINER_KEEP_WORKERS: a clear error now, not at the run's end
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
        self.pace = Pace()  # the steps of the group launched last: when spares start (spares.py)
        self._total_steps: int | None = None
        self.unwaited = reforming.Unwaited()  # replacements a failed re-form started, not waited for

    @property
    def actors(self) -> list[Any]:
        return self.roster.actors

    @property
    def nodes(self) -> list[Node]:
        return self.roster.nodes

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> list[Node]:
        """Reserve the run's slots (Slots.reserve: its size, else at least min_workers), start a worker in each
        placed slot; return the workers' nodes."""
        self.roster.slots = self.slots.reserve()
        t0, kept_before = time.monotonic(), len(kept.kept_actors())
        self.roster.actors = [start_worker(self.config, self.bundle, slot, joining=False)
                              for slot in self.roster.slots]
        self.roster.nodes = gather([a.node.remote() for a in self.roster.actors])
        if len(kept.kept_actors()) > kept_before - len(self.roster.actors):  # one started cold
            COLD_START_S[:] = [time.monotonic() - t0]
        return self.roster.nodes  # the warm spares start once training runs (poll)

    def adopt(self, takeover: orphans.Takeover) -> tuple[Formed, int]:
        """The workers a lost driver of the run left, taken over (orphans.find), as this
        group's, with their slots and the run's other placement groups; the group is to be
        re-formed from their memory (they left theirs as they paused). Returns what a setup
        would, and the step they hold."""
        self.roster.actors = list(takeover.actors)
        self.roster.nodes = [o.node for o in takeover.found]
        self.roster.slots = list(takeover.slots)
        self.slots.pgs = [pg for pg, _ in takeover.groups]
        first = takeover.found[0]
        self._total_steps = first.total_steps
        return Formed(list(self.roster.nodes), first.total_steps, first.steps_per_epoch, first.replicated), first.step

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
        self._total_steps = total_steps
        return Formed(list(self.roster.nodes), total_steps, steps_per_epoch, replicated)

    def launch(self) -> None:
        self._runs = [a.run.remote() for a in self.roster.actors]
        self._pending = list(self._runs)
        self._finished = {}
        self._drain_ref = None
        self.pace = Pace()

    def poll(self, timeout: float) -> Poll:
        """Wait up to `timeout` for any worker's run() to end; collect new metric rows, and
        how each run() that ended did, if not by finishing."""
        ready, self._pending = ray.wait(self._pending, num_returns=1, timeout=timeout)
        if ready and self._pending:  # whatever else has ended too, without waiting
            more, self._pending = ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
            ready += more
        poll = Poll(*self._drain(timeout=1.0))
        self.pace.add(poll.rows)
        ends_in_s = self.pace.ends_in_s(self._total_steps)
        if ends_in_s is not None and not self.slots.starting():  # once training runs (spares.py)
            self.spares.start(self.roster, ends_in_s)
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

    def shutdown(self, keep: bool = False) -> None:
        """Kill every worker and spare; `keep` (the run finished): on a Ray started for this
        driver, keep the processes fit for its next run instead (kept.py)."""
        # Only on a Ray of one node started for this driver: on a cluster a kept process
        # would keep its node from being idle (an autoscaler's scale-down, a drained node's end).
        if keep and not self.slots.cluster_can_grow and actors.keepable(self.config, self.bundle):
            placed = len(self.roster.nodes)
            kept.keep([(a, n.node_id) for a, n in zip(self.roster.actors, self.roster.nodes)]
                      + self.spares.let_go_up(), actors.alive_nodes)
            self.roster.actors = self.roster.actors[placed:]
        for actor in self.roster.actors:
            ray.kill(actor, no_restart=True)
        self.moves.shutdown()
        self.spares.shutdown()
        self.slots.shutdown()  # its newcomers, and every placement group
        self.copies.remove_all()
        self.forming.clear()
        self.unwaited.clear()
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

    KILL_ANSWER_S = 5.0
    """How long peers known to answer get to say whether a worker they kill was still running."""

    def kill(self, rank: int, answering: Iterable[int] = ()) -> bool:
        """Kill a worker now; whether its process was still running (frozen, not gone), as
        a peer of `answering` on its node saw it as it killed it (False where none is)."""
        calls = actors.kill(self.roster, rank, answering)
        return any(actors.ask_refs(calls, self.KILL_ANSWER_S))

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

    def spares_ready(self, ranks: list[int]) -> dict[int, bool]:
        """Of the lost `ranks`, those a warm spare that is up can take over now (one on the
        node of the rank's slot, a node Ray holds alive, each spare for one rank), each with
        whether its spare has built the training state ahead too (spares.py)."""
        ready = self.spares.ready_on([self.roster.nodes[r].node_id for r in ranks])
        return {r: built for r, built in zip(ranks, ready) if built is not None}

    # ------------------------------------------------------------------ re-forms (reforming.py)

    def reform(self, plan: ReformPlan) -> Reformed:
        """Re-form the process group after a failure or a pause, as `plan` says: from a
        survivor's state (reforming.from_survivor) or from the newest peer snapshots
        (reforming.from_peers)."""
        dead, leave, regrow = list(plan.dead), list(plan.leave), list(plan.regrow)
        if plan.state_from == "peers":
            return reforming.from_peers(self, dead, regrow, plan.grow, leave)
        return reforming.from_survivor(self, dead, leave, regrow)
