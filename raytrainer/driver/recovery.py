"""Recovery, from a failure to training again (docs/fault-tolerance.md, "How a recovery
goes"): every worker stops first (`settle`: the survivors are aborted out of their
collectives; a worker that raised, one silent once its peers stopped and one still blocked
in a collective are killed), then the group re-forms from what survives: the survivors'
state in memory, or where the state is sharded the newest peer snapshots (policy.replacing:
a warm spare, left behind or waited for, per lost rank), else the newest checkpoint, else
step 0. A failure while it re-forms is one more, counted through the failure policy, and
the next attempt starts over from what survives then.

A part of the controller, apart for its size: it works on the controller's run (its group,
world size and step) and re-forms through it (controller.py). What to do is the policy's
to say (policy.py), which workers are silent or blocked the watchdog's (watchdog.py).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..contract import Failure, ReformFailed, Reformed, RunEnd
from ..errors import NoSurvivors, RaytrainerError
from .policy import replacing, root_causes

if TYPE_CHECKING:
    from .controller import Controller


class Recovery:
    def __init__(self, controller: Controller):
        self.ctl = controller

    def recover(self, failures: list[Failure], lost: list[int] | None = None) -> RunEnd | None:
        """Recover from `failures`, and from every failure while recovering: each attempt
        counts its causes through the policy, and starts over from what survives (the
        survivors' state in memory, else the newest checkpoint, else step 0). `lost`: the
        group already stopped (a failed first forming) and these ranks are gone. Returns
        rank 0's end where training was over as the workers stopped (nothing to redo)."""
        ctl = self.ctl
        t0 = time.monotonic()
        if lost is None:
            failed, finished, killed = self.settle(failures)
            if 0 in finished:  # training was over; rank 0 holds the result: nothing to redo
                self._log_failures(list(failed.values()))
                return finished[0]
            failures = list(failed.values())
            lost = sorted(r for r, f in failed.items() if f.kind in ("died", "hung") or r in killed)
        ahead = max([ctl.recorder.train_step, ctl.watchdog.furthest_step()]
                    + [f.step for f in failures if f.step is not None])
        old_world, attempts, origins = ctl.world, 0, _Origins(ctl.world)
        while True:
            attempts += 1
            self._log_failures(failures)
            decision = ctl.policy.decide(failures, ctl.step)
            if not decision.recover:
                ctl._gave_up = decision.reason
                raise decision.error or RaytrainerError(decision.reason)
            try:
                reformed, how = self._reform(lost)
                break
            except ReformFailed as exc:  # lost again while re-forming: one more failure
                failures, lost = exc.failures, exc.dead
                ctl.world = exc.world_size or ctl.world  # as the group numbers its ranks now
                origins.renumbered(exc.renumbered, ctl.world)
            except NoSurvivors as exc:
                try:
                    reformed, how = None, self._from_storage(exc)
                    break
                except ReformFailed as again:
                    failures, lost = again.failures, again.dead
        if reformed is not None:  # every rank left behind, as numbered when the recovery began
            ctl.step = reformed.step
            reformed = replace(reformed, dropped=origins.dropped(reformed.dropped))
            how["dropped"] = reformed.dropped
        seconds = round(time.monotonic() - t0, 3)
        ctl.events.log("recovered", step=ctl.step, seconds=seconds, steps_lost=max(0, ahead - ctl.step),
                       failures=ctl.policy.failures, losses=ctl.policy.losses,
                       faults=ctl.policy.faults, attempts=attempts, cause=decision.reason, **how)
        if ctl.world != old_world and reformed is not None:
            ctl.resizing.log_resize(old_world, ctl.world, reformed, seconds, f"failure: {decision.reason}")
            ctl.resizing.regrowing += len(reformed.dropped)
        ctl.resizing.note_size(ctl.world)
        return None

    def _reform(self, lost: list[int]) -> tuple[Reformed, dict[str, Any]]:
        """One attempt from the survivors: the state in their memory, or (sharded) the newest
        peer snapshots. Returns the re-formed group and how, for the `recovered` event."""
        ctl = self.ctl
        if not ctl._replicated and not ctl.failure.snapshot_every_n_steps:
            raise NoSurvivors("the state is sharded, so the lost workers' shards are on no survivor, "
                              "and failure.snapshot_every_n_steps is 0")
        up = ctl.group.spares_ready(lost)  # rank -> whether its spare is built
        plan = replacing(lost, spares_ready=[r for r, built in up.items() if built], spares_up=list(up),
                         world=ctl.world,
                         replicated=ctl._replicated, exact=ctl.failure.recovery == "exact",
                         global_batch_fixed=not ctl.per_worker_batch, elastic=ctl.max_workers > ctl.min_workers)
        if ctl._replicated:
            reformed = ctl._reform(lost, regrow=list(plan.regrow))
            how = {"source_rank": reformed.source, "state_from": reformed.state_from,
                   "resynced": reformed.resynced, "spares": list(plan.spares),
                   "dropped": reformed.dropped, "replacing": plan.reason, "secured": reformed.secured}
        else:
            reformed = ctl._reform(lost, peers=True, regrow=list(plan.regrow))
            how = {"state_from": "peers", "snapshot_step": reformed.snapshot_step,
                   "peers": {str(rank): holder for rank, holder in reformed.peers.items()},
                   "spares": list(plan.spares), "dropped": reformed.dropped, "replacing": plan.reason}
        how.update(replaced=reformed.replaced, pids=[n.pid for n in reformed.nodes])
        return reformed, how

    def _from_storage(self, why: NoSurvivors) -> dict[str, Any]:
        """No survivor serves: the group starts again from the newest checkpoint (from step 0
        where there is none). Returns how, for the `recovered` event."""
        ctl = self.ctl
        ctl.group.shutdown()
        resume = ctl._form(ctl.restore(), time.monotonic())
        return {"state_from": "checkpoint" if resume else "start",
                "from_checkpoint": resume[1] if resume else None, "why": str(why)}

    def settle(self, failures: list[Failure]) -> tuple[dict[int, Failure], dict[int, Any], set[int]]:
        """Wait until every worker has stopped: failed, finished, or interrupted (a worker
        that paused for a resize has stopped too: a survivor). Returns the failures, the
        finished workers' ends, and the ranks killed to get there."""
        ctl = self.ctl
        failed: dict[int, Failure] = {}
        finished: dict[int, Any] = {}
        killed: set[int] = set()

        def absorb(new: list[Failure]) -> None:
            for f in new:  # a worker killed as hung then shows as died: it hung
                failed.setdefault(f.rank, f)

        absorb(failures)
        # Survivors stop now: NCCL's wait in their collective until its timeout whatever
        # happened to the peer (their communicators are aborted), and a Gloo survivor may
        # wait on another survivor rather than on the lost worker (its connections are shut
        # down, worker/dist.py): every survivor is to re-form anyway.
        ctl.group.abort([r for r in range(ctl.world) if r not in failed])
        stopped_at: float | None = None  # when a survivor first stopped, holding its state
        ctl.watchdog.settling()
        while True:
            settled = set(failed) | set(finished) | set(ctl._paused)
            # A worker that raised still holds its connections (its DDP keeps the process
            # group alive), so peers waiting on it would wait for the collective timeout:
            # kill it, and they fail at once.
            for rank, f in failed.items():
                if f.kind == "error" and rank not in killed and len(settled) < ctl.world:
                    ctl.group.kill(rank)
                    killed.add(rank)
            if len(settled) >= ctl.world:
                return failed, finished, killed
            if stopped_at is None and any(f.kind == "interrupted" for f in failed.values()):
                stopped_at = time.monotonic()
            if stopped_at is not None and time.monotonic() - stopped_at > ctl.SILENT_AFTER_S:
                stopped = [r for r, f in failed.items() if f.kind == "interrupted"] + list(finished)
                for rank in ctl.watchdog.silent(exclude=settled):
                    # A peer on its node that stopped says whether its process is still there:
                    # frozen (SIGSTOP, a stuck kernel or read), not gone with its node.
                    frozen = ctl.group.kill(rank, answering=stopped)
                    cause = ("the worker hung: it did not answer once its peers had stopped, its process still "
                             "there (frozen)" if frozen else "the worker died: it did not answer once its peers "
                             "had stopped (its process, or its node, is gone)")
                    killed.add(rank)
                    absorb([Failure(rank, "hung" if frozen else "died", cause, None, ctl._node_ip(rank))])
            if stopped_at is not None and time.monotonic() - stopped_at > ctl.UNBLOCK_AFTER_S:
                for rank in ctl.watchdog.blocked(exclude=settled):
                    ctl.group.kill(rank)
                    killed.add(rank)
                    absorb([Failure(rank, "interrupted", "still waiting in a collective for peers that had "
                                    "stopped (a Gloo collective cannot be aborted): killed to unblock it",
                                    None, ctl._node_ip(rank))])
            poll = ctl._poll()
            finished.update(poll.finished)
            absorb(poll.failures)
            absorb(ctl._hung(exclude=settled))

    def _log_failures(self, failures: list[Failure]) -> None:
        for f in root_causes(failures):
            trace = getattr(f.error, "traceback", "")  # a WorkerError's: the user's code, on the worker
            self.ctl.events.log("worker_failed", step=f.step if f.step is not None else self.ctl.step,
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
