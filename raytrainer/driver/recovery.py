"""Recovery, from a failure to training again (docs/fault-tolerance.md, "How a recovery
goes"): every worker stops first (`settle`: the survivors are aborted out of their
collectives; a worker that raised, one silent once its peers stopped and one still blocked
in a collective are killed), then the group re-forms from what survives: the survivors'
state in memory, or where the state is sharded the newest peer snapshots (policy.replacing:
a warm spare, left behind or waited for, per lost rank), else the newest checkpoint, else
step 0. A failure while it re-forms is one more, counted through the failure policy, and
the next attempt starts over from what survives then.

A part of the controller (controller.py): it works on the group as the controller formed it
(formation.Formation: its world size, nodes and step) and re-forms it through the
controller's Former (formation.py); the workers' rows and events while they stop reach the
records through the controller's poll. What to do is the policy's to say (policy.py), which
workers are silent or blocked the watchdog's (watchdog.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, Callable

from ..config import FailureConfig
from ..contract import Failure, Poll, ReformFailed, ReformPlan, Reformed, RunEnd, WorkerGroup
from ..errors import NoSurvivors, RaytrainerError
from .formation import Formation, Former
from .metrics import EventLog
from .policy import FailurePolicy, replacing, root_causes
from .recorder import Recorder
from .resizing import Resizing
from .watchdog import Watchdog


class Recovery:
    # While a failure settles (`settle`): after a survivor stopped with its state, how long
    # the others get to stop before those still waiting in a collective are killed: a last
    # resort, for a collective that the shut-down connections (the survivors' abort, and
    # each survivor's as it leaves) did not fail, which would wait for
    # failure.collective_timeout_s. The state is in the stopped ones.
    UNBLOCK_AFTER_S = 2.0

    # The same: after a survivor stopped, how long Ray gets to report a worker's death itself
    # (with its cause: an OOM kill, a segfault) before one that does not answer is taken for
    # dead.
    SILENT_AFTER_S = 0.5

    def __init__(self, group: WorkerGroup, formation: Formation, former: Former, *, policy: FailurePolicy,
                 failure: FailureConfig, events: EventLog, recorder: Recorder, watchdog: Watchdog,
                 resizing: Resizing, poll: Callable[[], Poll], per_worker_batch: bool, elastic: bool):
        """`poll`: the controller's (the rows and events that come meanwhile go to the
        records, the workers that pause to the formation); `per_worker_batch`, `elastic`:
        whether the global batch changes with the world size, and whether the run may
        change its size (policy.replacing)."""
        self.group, self.formation, self.former = group, formation, former
        self.policy, self.failure, self.events = policy, failure, events
        self.recorder, self.watchdog, self.resizing = recorder, watchdog, resizing
        self.poll = poll
        self.per_worker_batch, self.elastic = per_worker_batch, elastic
        self.gave_up: str | None = None  # why the policy stopped recovering, for the `failed` event

    def recover(self, failures: list[Failure], lost: list[int] | None = None) -> RunEnd | None:
        """Recover from `failures`, and from every failure while recovering: each attempt
        counts its causes through the policy, and starts over from what survives (the
        survivors' state in memory, else the newest checkpoint, else step 0). `lost`: the
        group already stopped (a failed first forming) and these ranks are gone. Returns
        rank 0's end where training was over as the workers stopped (nothing to redo)."""
        formation = self.formation
        t0 = time.monotonic()
        if lost is None:
            failed, finished, killed = self.settle(failures)
            if 0 in finished:  # training was over; rank 0 holds the result: nothing to redo
                self._log_failures(list(failed.values()))
                return finished[0]
            failures = list(failed.values())
            lost = sorted(r for r, f in failed.items() if f.kind in ("died", "hung") or r in killed)
        ahead = max([self.recorder.train_step, self.watchdog.furthest_step()]
                    + [failure.step for failure in failures if failure.step is not None])
        old_world, attempts, origins = formation.size, 0, _Origins(formation.size)
        while True:
            attempts += 1
            self._log_failures(failures)
            decision = self.policy.decide(failures, formation.step)
            if not decision.recover:
                self.gave_up = decision.reason
                raise decision.error or RaytrainerError(decision.reason)
            try:
                reformed, how = self._reform(lost)
                break
            except ReformFailed as exc:  # lost again while re-forming: one more failure
                failures, lost = exc.failures, exc.dead
                formation.size = exc.world_size or formation.size  # as the group numbers its ranks now
                origins.renumbered(exc.renumbered, formation.size)
            except NoSurvivors as exc:
                try:
                    reformed, how = None, self._from_storage(exc)
                    break
                except ReformFailed as again:
                    failures, lost = again.failures, again.dead
        if reformed is not None:  # every rank left behind, as numbered when the recovery began
            formation.step = reformed.step
            reformed = replace(reformed, dropped=origins.dropped(reformed.dropped))
            how["dropped"] = reformed.dropped
        seconds = round(time.monotonic() - t0, 3)
        self.events.log("recovered", step=formation.step, seconds=seconds,
                        steps_lost=max(0, ahead - formation.step), failures=self.policy.failures,
                        losses=self.policy.losses, faults=self.policy.faults, attempts=attempts,
                        cause=decision.reason, **how)
        if formation.size != old_world and reformed is not None:
            self.resizing.log_resize(old_world, formation.size, reformed, seconds, f"failure: {decision.reason}")
            self.resizing.regrowing += len(reformed.dropped)
        self.resizing.note_size(formation.size)
        return None

    def _reform(self, lost: list[int]) -> tuple[Reformed, dict[str, Any]]:
        """One attempt from the survivors: the state in their memory, or (sharded) the newest
        peer snapshots. Returns the re-formed group and how, for the `recovered` event."""
        formation = self.formation
        if not formation.replicated and not self.failure.snapshot_every_n_steps:
            raise NoSurvivors("the state is sharded, so the lost workers' shards are on no survivor, "
                              "and failure.snapshot_every_n_steps is 0")
        up = self.group.spares_ready(lost)  # rank -> whether its spare is built
        how_replaced = replacing(lost, spares_ready=[r for r, built in up.items() if built], spares_up=list(up),
                                 world=formation.size,
                                 replicated=formation.replicated, exact=self.failure.recovery == "exact",
                                 global_batch_fixed=not self.per_worker_batch, elastic=self.elastic)
        reformed = self.former.reform(self.plan(lost, how_replaced.regrow))
        if formation.replicated:
            how = {"source_rank": reformed.source, "state_from": reformed.state_from,
                   "resynced": reformed.resynced, "spares": list(how_replaced.spares),
                   "dropped": reformed.dropped, "replacing": how_replaced.reason, "secured": reformed.secured}
        else:
            how = {"state_from": "peers", "snapshot_step": reformed.snapshot_step,
                   "peers": {str(rank): holder for rank, holder in reformed.peers.items()},
                   "spares": list(how_replaced.spares), "dropped": reformed.dropped,
                   "replacing": how_replaced.reason}
        how.update(replaced=reformed.replaced, pids=[n.pid for n in reformed.nodes])
        return reformed, how

    def plan(self, lost: list[int], regrow: Iterable[int]) -> ReformPlan:
        """The re-form of an attempt: without the `lost` ranks, those in `regrow` left behind
        to join later (policy.replacing), from the survivors' memory (replicated state) or
        the peer snapshots (sharded)."""
        return ReformPlan(dead=lost, regrow=regrow, state_from="survivor" if self.formation.replicated else "peers")

    def _from_storage(self, why: NoSurvivors) -> dict[str, Any]:
        """No survivor serves: the group starts again from the newest checkpoint (from step 0
        where there is none). Returns how, for the `recovered` event."""
        resume = self.former.from_storage()
        return {"state_from": "checkpoint" if resume else "start",
                "from_checkpoint": resume[1] if resume else None, "why": str(why)}

    def settle(self, failures: list[Failure]) -> tuple[dict[int, Failure], dict[int, Any], set[int]]:
        """Wait until every worker has stopped: failed, finished, or interrupted (a worker
        that paused for a resize has stopped too: a survivor). Returns the failures, the
        finished workers' ends, and the ranks killed to get there."""
        formation = self.formation
        failed: dict[int, Failure] = {}
        finished: dict[int, Any] = {}
        killed: set[int] = set()

        def absorb(new: list[Failure]) -> None:
            for failure in new:  # a worker killed as hung then shows as died: it hung
                failed.setdefault(failure.rank, failure)

        absorb(failures)
        # Survivors stop now: NCCL's wait in their collective until its timeout whatever
        # happened to the peer (their communicators are aborted), and a Gloo survivor may
        # wait on another survivor rather than on the lost worker (its connections are shut
        # down, worker/dist.py): every survivor is to re-form anyway.
        self.group.abort([r for r in range(formation.size) if r not in failed])
        stopped_at: float | None = None  # when a survivor first stopped, holding its state
        self.watchdog.settling()
        while True:
            settled = set(failed) | set(finished) | set(formation.paused)
            # A worker that raised still holds its connections (its DDP keeps the process
            # group alive), so peers waiting on it would wait for the collective timeout:
            # kill it, and they fail at once.
            for rank, failure in failed.items():
                if failure.kind == "error" and rank not in killed and len(settled) < formation.size:
                    self.group.kill(rank)
                    killed.add(rank)
            if len(settled) >= formation.size:
                return failed, finished, killed
            if stopped_at is None and any(failure.kind == "interrupted" for failure in failed.values()):
                stopped_at = time.monotonic()
            if stopped_at is not None and time.monotonic() - stopped_at > self.SILENT_AFTER_S:
                stopped = [r for r, failure in failed.items() if failure.kind == "interrupted"] + list(finished)
                for rank in self.watchdog.silent(exclude=settled):
                    # A peer on its node that stopped says whether its process is still there:
                    # frozen (SIGSTOP, a stuck kernel or read), not gone with its node.
                    frozen = self.group.kill(rank, answering=stopped)
                    cause = ("the worker hung: it did not answer once its peers had stopped, its process still "
                             "there (frozen)" if frozen else "the worker died: it did not answer once its peers "
                             "had stopped (its process, or its node, is gone)")
                    killed.add(rank)
                    absorb([Failure(rank, "hung" if frozen else "died", cause, None, formation.node_ip(rank))])
            if stopped_at is not None and time.monotonic() - stopped_at > self.UNBLOCK_AFTER_S:
                for rank in self.watchdog.blocked(exclude=settled):
                    self.group.kill(rank)
                    killed.add(rank)
                    absorb([Failure(rank, "interrupted", "still waiting in a collective for peers that had "
                                    "stopped (a Gloo collective cannot be aborted): killed to unblock it",
                                    None, formation.node_ip(rank))])
            poll = self.poll()
            finished.update(poll.finished)
            absorb(poll.failures)
            absorb(self.watchdog.hung(formation.step, recovering=True, exclude=settled))

    def _log_failures(self, failures: list[Failure]) -> None:
        for f in root_causes(failures):
            trace = getattr(f.error, "traceback", "")  # a WorkerError's: the user's code, on the worker
            self.events.log("worker_failed", step=f.step if f.step is not None else self.formation.step,
                            rank=f.rank, node=f.node, kind=f.kind, cause=f.cause,
                            **({"traceback": trace} if trace else {}))


class _Origins:
    """Each rank's number when the recovery began (None: a newcomer since), and the ranks
    left behind by attempts that failed after renumbering them."""

    def __init__(self, world: int):
        self.origin: list[int | None] = list(range(world))
        self.left: list[int] = []

    def renumbered(self, renumbered: tuple[list[int], list[int]] | None, world: int) -> None:
        """An attempt failed after renumbering the ranks (ReformFailed.renumbered); the group
        numbers `world` ranks now."""
        if renumbered is None:
            return
        kept, dropped = renumbered
        self.left += [self.origin[r] for r in dropped if self.origin[r] is not None]
        self.origin = [self.origin[r] for r in kept] + [None] * (world - len(kept))

    def dropped(self, dropped: list[int]) -> list[int]:
        """Every rank left behind, as numbered when the recovery began: by the attempts that
        failed, and `dropped` by the last one."""
        return sorted(self.left + [self.origin[r] for r in dropped if self.origin[r] is not None])
