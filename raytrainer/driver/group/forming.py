"""Forming a process group over the roster's workers, and the state they continue from.

Rank 0 hosts the group's store (its `rendezvous`), then every worker is asked to join: a
new one builds the task (`setup`), one that trained in the last group keeps its state
(`regroup`, taking the state it is given if it was behind). A worker that fails, freezes
or never reaches the rendezvous meanwhile is found (`wait_answering`) and killed, and the
attempt raises ReformFailed for the controller to count and try again.

During a recovery the state to continue from is secured first, in the object store: a
survivor's state where a worker is to take it (`take_state`; the worker creates the object,
the driver holds its reference until the group has formed), or for sharded state the
copies of lost ranks' peer snapshots (`secure_copies`). A second failure meanwhile, even of
every survivor, does not lose them. (Where no worker takes it, two holders or more stay,
or the lone one writes its copy beside it: reforming._secure.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any

import ray

from ...checkpoint import CheckpointRef
from ...config import Config
from ...contract import Failure, Holdings, ReformFailed, Reshard, Snapshot, Status
from ...errors import CheckpointCorrupt, NoSurvivors
from ..policy import choose_state, progressed
from .actors import Roster, ask_once, control, outcome


class Forming:
    # After one worker's call failed while the group formed, how long the others get to
    # return (they fail at once where the lost peer had connected) before those still
    # blocked waiting for it are killed.
    FORM_GRACE_S = 2.0

    def __init__(self, config: Config, roster: Roster, kill: Callable[[int], None]):
        self.config, self.roster, self.kill = config, roster, kill
        self._aborts: list[tuple[int, Any]] = []  # (rank, its abort call) while a forming fails
        # The state every worker is to continue from, once taken from a survivor, with that
        # survivor's status; kept until the group has re-formed.
        self.secured: tuple[Status, Any] | None = None
        # The same for sharded state: rank -> (step, its peer snapshot's reference), for the
        # lost ranks whose copy was taken from its holder.
        self.copies: dict[int, tuple[int, Any]] = {}
        # For a re-shard (a change of world size): the step and every rank's snapshot of it,
        # by the rank it had, once all are secured; any later attempt re-shards from them.
        self.resharding: tuple[int, tuple[Any, ...]] | None = None

    def clear(self) -> None:
        self.secured, self.copies, self.resharding = None, {}, None

    def answers(self, ranks: list[int], method: str) -> dict[int, Any]:
        """A control call on each of `ranks`, which must all answer: one that does not is
        dead (its process gone), failed, or frozen (no answer in 10 s), is killed, and is
        replaced at the next attempt (ReformFailed)."""
        refs = [control(self.roster.actors[r], method).remote() for r in ranks]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=10.0)[0])
        answers: dict[int, Any] = {}
        failures: list[Failure] = []
        for rank, ref in zip(ranks, refs):
            got = (outcome(self.roster, rank, ref) if ref in ready else
                   Failure(rank, "hung", "did not answer while the group re-formed", None, self.roster.ip(rank)))
            if isinstance(got, Failure):
                failures.append(got)
            else:
                answers[rank] = got
        if failures:
            for failure in failures:
                self.kill(failure.rank)
            raise ReformFailed(failures, [f.rank for f in failures])
        return answers

    def take_state(self, holders: dict[int, Status], avoid: list[int] = ()) -> tuple[int | None, Any, Status]:
        """The state to continue from: the furthest survivor's (not one of `avoid` among
        equals), put in the object store by that worker and kept there until the group has
        re-formed, else one secured earlier."""
        choice = choose_state(holders, self.secured[0] if self.secured else None, avoid=avoid)
        source = choice.source
        if not choice.take:
            if self.secured is None:
                raise NoSurvivors("no worker survived")
            at, ref = self.secured
            return source, ref, at
        at = holders[source]
        # The size answers; the state stays in the object store (owned here, never fetched
        # here) for the workers that take it.
        size, ref = self.roster.actors[source].get_state.options(num_returns=2).remote()
        self.answer(source, size)
        self.secured = (at, ref)
        return source, ref, at

    def read_checkpoint(self, ref: CheckpointRef) -> Any:
        """Rank 0 reads checkpoint `ref` and checks it; a reference to what the workers load
        (the state stays in the object store, never fetched here). CheckpointCorrupt if it
        does not match its manifest; ReformFailed if rank 0 is lost meanwhile."""
        why, state = self.roster.actors[0].read_checkpoint.options(num_returns=2).remote(ref)
        why = self.answer(0, why)
        if why is not None:
            raise CheckpointCorrupt(ref.name, why)
        return state

    def answer(self, rank: int, ref: Any) -> Any:
        """What rank `rank`'s call `ref` returns, waited for with the hang check; a rank
        lost meanwhile is killed and a ReformFailed."""
        answers, failures, _ = self.wait_answering({ref: rank}, grace_s=0.0)
        if failures:
            self.kill(rank)
            raise ReformFailed(failures, [rank])
        return answers[rank]

    def secure_copies(self, step: int, world: int, others: list[int],
                      held: dict[int, Holdings]) -> tuple[dict[int, Any], dict[int, int]]:
        """What each rank loads to go back to the peer snapshots of `step`: its own (a
        survivor holding it), else a copy secured earlier, else the copy its successor in
        the ring holds, secured now. Returns (rank -> what it loads, rank -> the holder of
        the copy it loads)."""
        loads: dict[int, Any] = {}
        peers: dict[int, int] = {}
        fetch: dict[Any, int] = {}  # a holder's answer -> the rank whose copy it gives
        for rank in range(world):
            if rank in others and step in held[rank].own:
                loads[rank] = Snapshot(step, rank)  # its own, in its memory
            elif rank in self.copies and self.copies[rank][0] == step:
                loads[rank] = self.copies[rank][1]
            else:
                peers[rank] = (rank + 1) % world
                ok, loads[rank] = self.roster.actors[peers[rank]].peer_snapshot.options(num_returns=2).remote(step)
                fetch[ok] = rank
        # The small answer says whether the copy is there; the copy itself stays in the
        # object store (owned here) for the replacement to load.
        _, failures, _ = self.wait_answering({ok: peers[rank] for ok, rank in fetch.items()}, grace_s=0.0)
        failed = sorted({f.rank for f in failures})
        for rank in fetch.values():
            if peers[rank] not in failed:
                self.copies[rank] = (step, loads[rank])
        if failures:
            for holder in failed:
                self.kill(holder)
            raise ReformFailed(failures, failed)
        return loads, peers

    def secure_all(self, step: int, world: int, others: list[int],
                   held: dict[int, Holdings]) -> tuple[tuple[Any, ...], dict[int, int]]:
        """Every rank's snapshot of `step` in the object store, for a re-shard: a survivor's
        own, else a copy secured earlier, else the copy its successor in the ring holds.
        Returns (the references by rank, lost rank -> the holder of the copy taken)."""
        parts: dict[int, Any] = {}
        peers: dict[int, int] = {}
        fetch: dict[Any, tuple[int, int]] = {}  # a giver's answer -> (whose snapshot, the giver)
        for rank in range(world):
            if rank in self.copies and self.copies[rank][0] == step:
                parts[rank] = self.copies[rank][1]
                continue
            if rank in others and step in held[rank].own:
                giver, call = rank, "own_snapshot"
            else:
                giver = peers[rank] = (rank + 1) % world
                call = "peer_snapshot"
            ok, parts[rank] = getattr(self.roster.actors[giver], call).options(num_returns=2).remote(step)
            fetch[ok] = (rank, giver)
        _, failures, _ = self.wait_answering({ok: giver for ok, (_, giver) in fetch.items()}, grace_s=0.0)
        failed = sorted({f.rank for f in failures})
        for rank, giver in fetch.values():
            if giver not in failed:
                self.copies[rank] = (step, parts[rank])
        if failures:
            for giver in failed:
                self.kill(giver)
            raise ReformFailed(failures, failed)
        return tuple(parts[r] for r in range(world)), peers

    def form(self, calls: dict[int, tuple[bool | None, Any]], use_gpu: bool) -> dict[int, Any]:
        """Form the group over all the roster's actors: per rank (None: build the task with
        `setup`; True/False: `regroup`, taking the state or not) and the state's reference.
        Returns each rank's result. If a call fails, the others are asked to abort the
        forming (their rendezvous would wait for the lost peer until the collective timeout)
        and get FORM_GRACE_S to return, each then a survivor holding what it held; those
        still blocked (frozen, or not answering) are killed, and ReformFailed says who. A
        worker that holds training state of its own (_holds) is killed only once it stops
        answering (wait_answering's `holding`): killing it would lose what it holds."""
        actors = self.roster.actors
        world = len(actors)
        refs: dict[Any, int] = {}
        # Waited for like the forming calls below, with the same hang check: a rank 0 that
        # froze (or never answers) would otherwise hold the driver here for ever.
        where, failures, _ = self.wait_answering({actors[0].rendezvous.remote(): 0}, grace_s=0.0)
        if failures:
            self.kill(0)
            raise ReformFailed(failures, [0])
        addr, port = where[0]
        for rank, (take, state) in calls.items():
            if take is None:
                refs[actors[rank].setup.remote(rank, world, addr, port, use_gpu, state)] = rank
            else:
                refs[actors[rank].regroup.remote(rank, world, addr, port, state if take else None)] = rank
        holding = [rank for rank, (take, state) in calls.items() if _holds(take, state)]
        results, failures, pending = self.wait_answering(refs, grace_s=self.FORM_GRACE_S, abort=True,
                                                         holding=holding)
        if not failures:
            return results
        lost = sorted({f.rank for f in failures if f.kind != "interrupted"} | set(pending))
        for rank in lost:
            self.kill(rank)
        raise ReformFailed(failures, lost)

    def wait_answering(self, refs: dict[Any, int], grace_s: float, abort: bool = False,
                       holding: Collection[int] = ()) -> tuple[dict[int, Any], list[Failure], list[int]]:
        """Wait for the calls `refs` (ref -> rank) to return: their results and failures,
        and the ranks still pending. After the first failure the others get `grace_s`
        (with `abort`, asked to abort what they wait in, as a group forming does, and again
        every second: a worker not in the rendezvous yet as it was asked, still loading the
        state or its call not started on a loaded machine, found nothing to end). The
        ranks of `holding` (holders of the training state) are waited for after the grace
        too, while they answer their control channel (_hold_on). A
        worker frozen meanwhile would hold the others (in a rendezvous, until
        failure.collective_timeout_s) or this wait: one that has not answered its control
        channel for step_timeout_s is hung. So is one that answers but has not reached the
        group's rendezvous for step_timeout_s while a peer has waited there as long (stuck
        in its own code, or its call never started): the peers wait for it, not the
        reverse, and would otherwise wait failure.collective_timeout_s. Both on the worker's
        own clock: one that works on its way there (building the task, loading the state),
        however slowly a loaded machine lets it, is not stuck (policy.progressed)."""
        results: dict[int, Any] = {}
        failures: list[Failure] = []
        pending, deadline = list(refs), None
        answered = {rank: time.monotonic() for rank in refs.values()}  # when each last answered
        # rank -> (before, in or past the rendezvous, since when it was seen there)
        where = {rank: ("before", time.monotonic()) for rank in refs.values()}
        last: dict[int, tuple[Status, float]] = {}  # rank -> (its last answer, when)
        timeout_s = self.config.failure.step_timeout_s

        def fail(failure: Failure) -> None:
            nonlocal deadline
            failures.append(failure)
            if deadline is None:
                deadline = time.monotonic() + grace_s

        def collect(ready: list[Any]) -> None:
            for ref in ready:
                result = outcome(self.roster, refs[ref], ref)
                if isinstance(result, Failure):
                    fail(result)
                else:
                    results[refs[ref]] = result

        while pending and (deadline is None or time.monotonic() < deadline):
            if abort and deadline is not None:
                self._abort([refs[ref] for ref in pending if refs[ref] not in {f.rank for f in failures}])
            ready, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            collect(ready)
            if ready or timeout_s is None:
                continue
            waiting, now = [refs[ref] for ref in pending], time.monotonic()
            for rank, status in zip(waiting, ask_once(self.roster, waiting, "status", timeout=1.0)):
                if status is not None:
                    answered[rank] = now
                    at = {"joining": "in", "joined": "past"}.get(status.forming, "before")
                    before, then = last.get(rank, (None, now))
                    if at != where[rank][0] or (at == "before" and before is not None
                                                and progressed(before, status, now - then)):
                        where[rank] = (at, now)
                    last[rank] = (status, now)
                elif now - answered[rank] > timeout_s and rank not in {f.rank for f in failures}:
                    fail(Failure(rank, "hung", f"did not answer for {timeout_s:g} s (failure.step_timeout_s) "
                                 "while the group re-formed", None, self.roster.ip(rank)))
            if any(where[r][0] == "in" and now - where[r][1] > timeout_s for r in waiting):
                for rank in waiting:
                    if (where[rank][0] == "before" and now - where[rank][1] > timeout_s
                            and now - answered[rank] < timeout_s and rank not in {f.rank for f in failures}):
                        fail(Failure(rank, "hung", f"did not reach the group's rendezvous for {timeout_s:g} s "
                                     "(failure.step_timeout_s) while its peers waited there", None,
                                     self.roster.ip(rank)))
        failed = {f.rank for f in failures}
        holders = {ref: refs[ref] for ref in pending if refs[ref] in holding and refs[ref] not in failed}
        if holders and abort:
            pending = self._hold_on(pending, holders, answered, collect)
        self._aborted({refs[ref] for ref in pending})
        return results, failures, [refs[ref] for ref in pending]

    HOLDER_SILENT_S = 10.0
    """After the grace, a holder that has not answered its control channel this long is frozen."""

    def _hold_on(self, pending: list[Any], holders: dict[Any, int], heard: dict[int, float],
                 collect: Callable[[list[Any]], None]) -> list[Any]:
        """After the grace of a forming that failed: wait on for the calls of the holders of
        the training state still `pending` (ref -> rank), asking them to abort each second,
        while each answers its control channel (`heard`: rank -> when it last did; frozen:
        silent HOLDER_SILENT_S), for at most failure.collective_timeout_s (their rendezvous
        ends by then anyway). Killing one that is slow, not stuck, would lose its state: a
        holder late to the rendezvous was killed after the grace, and a 3-worker run that
        lost two others close together started again from step 0. Returns the
        calls still pending."""
        start = time.monotonic()
        while time.monotonic() - start < self.config.failure.collective_timeout_s:
            waiting = [rank for ref, rank in holders.items() if ref in pending]
            now = time.monotonic()
            for rank, status in zip(waiting, ask_once(self.roster, waiting, "status", timeout=1.0)):
                if status is not None:
                    heard[rank] = now
            waiting = [rank for rank in waiting if now - heard[rank] < self.HOLDER_SILENT_S]
            if not waiting:
                break
            self._abort(waiting)
            ready, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            collect(ready)
        return pending

    def _abort(self, ranks: list[int]) -> None:
        """Ask `ranks` to abort the forming they wait in (waited for by _aborted)."""
        for rank in ranks:
            self._aborts.append((rank, control(self.roster.actors[rank], "abort").remote()))

    def _aborted(self, still: set[int]) -> None:
        """Wait (2 s at most) until the aborts asked of the ranks not `still` pending are
        done: one arriving late would end the next attempt's rendezvous instead."""
        refs = [ref for rank, ref in self._aborts if rank not in still]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=2.0)
        self._aborts = []


def _holds(take: bool | None, state: Any) -> bool:
    """Whether a worker forming with the call (`take`, `state`) of Forming.form holds training
    state that is lost with its process: a survivor keeping its state (`regroup`), or one
    going on from its own peer snapshot, in its memory (sharded state: a Snapshot without
    data, alone or a part of a Reshard), which its successor's copy covers for one loss,
    not for two."""
    if take is not None:
        return True
    parts = state.parts if isinstance(state, Reshard) else (state,)
    return any(isinstance(part, Snapshot) and part.data is None for part in parts)
