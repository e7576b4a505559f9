"""The driver's state machine. It owns the run; a worker group does the work.

    STARTING -> RUNNING -> FINISHED
         \\        |  ^ \\-> FAILED
          \\       v  |
           \\-> RECOVERING -> FAILED
         (RUNNING -> RESIZING -> RUNNING when an elastic run grows)

The controller knows no torch and no Ray: it drives any worker group
(driver.group.RayWorkerGroup in production, a fake in tests), writes every lifecycle
change to the event log and every metric row to the sinks, asks the failure
policy what to do when workers fail or hang, and always shuts the group down,
whatever happened. Its larger parts are modules of their own: formation.py (the group as
it stands, Formation, which the controller and a recovery share, and the ways it is formed
and re-formed, Former), recovery.py (a failure: every worker stopped, the group re-formed
from what survives, attempt after attempt), resizing.py (when an elastic run grows, how
long a run may stay below min_workers, the events of a size change), recorder.py (the
workers' rows and events into the records), and two watches, watchdog.py (hangs) and
drainwatch.py (draining nodes).

Recovery keeps the survivors: they stop at the last step they completed, the
group replaces the lost workers and re-forms, the survivor furthest ahead gives
its state to the others, and training goes on. It never waits for a process to
start where the maths allow (policy.replacing): a lost worker is replaced by a warm
spare that is up, else the survivors go on without it at once, while its replacement
starts, and take it in at a step boundary once it is up (a resize). Only when no worker survived does
a checkpoint from storage (`restore`) take their place. When the state is sharded
(the strategy says so when the group forms), a lost worker's shards exist on no
survivor: the group goes back to the newest peer snapshot (each worker keeps its own
and a copy of its neighbour's in memory, snapshot.py), the replacements taking the
copies, and replays the steps since; where no snapshot serves (a worker lost with the
neighbour holding its copy) it restarts from the newest checkpoint. With
failure.recovery fast it does not wait for the lost workers' replacements either: every
worker of the smaller group re-shards the snapshots (worker/state/reshard.py), and a resize
re-shards the same way from the snapshots the workers keep as they pause (with snapshots
off, it restarts from the checkpoint they wrote, which reshards on load). In an elastic run a lost
worker that cannot be replaced in time is dropped (the group shrinks), and when
the cluster has room for more workers (up to max_workers) the workers pause at a
common step, the newcomers are started and take the state, and the group grows.
Every change of the world size is a `resized` event.

A node being drained for preemption (Ray's draining state, with a deadline) is left
before it goes, the same way: replacements are started on other nodes, the workers pause
at a common step, and the group re-forms with the replacements in place of the workers
on that node (or, in an elastic run, without them: policy.leave_draining_nodes), from
the survivors' memory; nothing is lost and no failure is counted. A `node_draining`
event says when the drain was seen, a `left_node` event when the workers left (and a
`resized` event with cause "preemption" if the world size changed). A node that goes
before its workers could leave is a lost node like any other: a failure, recovered.

A rank persistently slower than the others (stragglers.py, from the compute times that
come with the rows) is reported; with failure.stragglers: replace it leaves the same way
as a worker on a draining node, its replacement in its place (`slow_worker_replaced`).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..config import Config, FailureConfig
from ..contract import Failure, Poll, ReformFailed, ReformPlan, Resume, WorkerGroup
from ..errors import RaytrainerError, Stopped, WorkerError, warn
from .drainwatch import DrainWatch
from .formation import Formation, Former
from .stragglers import StragglerWatch
from .policy import FailurePolicy, poll_wait
from .recorder import Recorder, Records
from .recovery import Recovery
from .resizing import Resizing
from .watchdog import Watchdog


# The run's states, each carrying what is true only in it (Ray Train v2's style). What
# every state shares, the group as it stands, is the Formation.


@dataclass(frozen=True)
class StartingState:
    """The group forms for the first time (or is taken over from a lost driver)."""


@dataclass(frozen=True)
class RunningState:
    """Every worker trains; the controller polls, and watches hangs, drains, room and
    slow workers."""


@dataclass(frozen=True)
class RecoveringState:
    """A failure is being recovered from: these `failures`, ranks `lost` (None: the
    failures say)."""

    failures: tuple[Failure, ...]
    lost: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ResizingState:
    """Every worker paused at one step, `paused_at` (time.time()): the group re-forms with
    the newcomers and without `leaving` (rank -> why)."""

    paused_at: float
    leaving: dict[int, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class FinishedState:
    """Every worker finished: rank 0's `result` (RunEnd)."""

    result: Any


@dataclass(frozen=True)
class FailedState:
    """The run stopped on `error` (a signal's stop, or what the run raised); `gave_up`:
    the failure policy's reason, where it gave up."""

    error: BaseException
    gave_up: str | None = None


State = StartingState | RunningState | RecoveringState | ResizingState | FinishedState | FailedState


@dataclass(frozen=True, kw_only=True)
class ControllerSettings:
    """What the config tells the controller, and how often it looks (tests set 0)."""

    min_workers: int
    """scaling.min_workers: the fewest workers the run trains on."""
    max_workers: int | None = None
    """scaling.max_workers: an elastic run grows up to it; default the size."""
    size: int | None = None
    """scaling.size (num_workers within the bounds): the worker count the run waits for
    and grows back to; default min_workers."""
    failure: FailureConfig = field(default_factory=lambda: FailureConfig(max_failures=0, step_timeout_s=None))
    replace_timeout_s: float = 10.0
    """scaling.replace_timeout_s: how long a drain waits for replacements, and how long
    newcomers that are up wait for those started with them (policy.grow_now)."""
    placement_timeout_s: float = 60.0
    """scaling.placement_timeout_s: how long a run that went on below min_workers after a
    failure (failure.recovery: fast) waits for its replacements to be up before it fails."""
    per_worker_batch: bool = False
    """The global batch changes with the world size: trainer.batch_policy is per_worker, or
    the run is your own loop (its batches are its own: raytrainer cannot tell whether they
    are per worker, as a Hugging Face Trainer's are)."""
    poll_interval_s: float = 0.2
    """How long a poll waits for a worker's run() to end while the group forms or recovers."""
    max_poll_s: float = 1.0
    """The same while training runs, at most (policy.poll_wait: until the next check is due):
    metric rows reach the sinks in batches this far apart."""
    grow_check_s: float = 1.0
    """How often to look for room to grow."""
    drain_check_s: float = 1.0
    """How often to look for draining nodes."""
    launched: float | None = None
    """When raytrainer.train was called (time.time()): run_started's `launched`, so that the
    goodput ledger's `starting` counts Ray's start and the config's loading too."""

    @classmethod
    def of(cls, config: Config) -> ControllerSettings:
        scaling = config.scaling
        return cls(min_workers=scaling.min_workers, max_workers=scaling.max_workers, size=scaling.size,
                   failure=config.failure,
                   replace_timeout_s=scaling.replace_timeout_s, placement_timeout_s=scaling.placement_timeout_s,
                   per_worker_batch=config.trainer.batch_policy == "per_worker" or config.task.is_loop)


class Controller:
    def __init__(self, group: WorkerGroup, settings: ControllerSettings, records: Records, *,
                 resume: Resume | None = None, restore: Callable[..., Resume | None] | None = None,
                 takeover: Any = None):
        self.group = group
        self.resume = resume  # (step, checkpoint name, where it is) to start from
        self.takeover = takeover  # the workers a lost driver of the run left, for group.adopt
        self.failure = settings.failure
        self.policy = FailurePolicy(self.failure.max_failures, self.failure.failure_window_s, self.failure.max_losses)
        # The newest committed checkpoint (before a step, if given), if any.
        self.restore = restore or (lambda before=None: None)
        self.min_workers = settings.min_workers
        self.size = settings.size or settings.min_workers
        self.max_workers = settings.max_workers or self.size
        self.formation = Formation()  # the group as it stands: its size, nodes, step, the pause under way
        self.launched = settings.launched
        self.events, self.progress = records.events, records.progress
        self.poll_interval_s, self.max_poll_s = settings.poll_interval_s, settings.max_poll_s
        self.callbacks, self.ctx = records.callbacks, records.context
        self.state: State = StartingState()
        node_ip = self.formation.node_ip
        self.recorder = Recorder(records)
        self.watchdog = Watchdog(group, self.failure.step_timeout_s, lambda: self.ctx.run_dir, node_ip)
        self.drains = DrainWatch(group, self.events, settings.drain_check_s, settings.replace_timeout_s, node_ip)
        self.resizing = Resizing(group, self.events, min_workers=self.min_workers, size=self.size,
                                 max_workers=self.max_workers, check_s=settings.grow_check_s,
                                 patience_s=settings.replace_timeout_s,
                                 placement_timeout_s=settings.placement_timeout_s)
        self.stragglers = StragglerWatch(self.events, self.failure.stragglers, self.failure.straggler_margin,
                                         self.failure.straggler_window, node_ip)
        self.former = Former(group, self.formation, events=self.events, recorder=self.recorder,
                             resizing=self.resizing, stragglers=self.stragglers, watchdog=self.watchdog,
                             context=self.ctx, progress=self.progress, restore=self.restore)
        self.recovery = Recovery(group, self.formation, self.former, policy=self.policy, failure=self.failure,
                                 events=self.events, recorder=self.recorder, watchdog=self.watchdog,
                                 resizing=self.resizing, poll=self._poll,
                                 per_worker_batch=settings.per_worker_batch,
                                 elastic=self.max_workers > self.min_workers)
        self.stop_signal: int | None = None  # a signal asked the run to stop (request_stop)

    @property
    def world(self) -> int:
        """The world size."""
        return self.formation.size

    @property
    def step(self) -> int:
        """The last step the run completed, as the driver knows it."""
        return self.formation.step

    def request_stop(self, signum: int) -> None:
        """Stop at the next step boundary the workers agree on, commit a checkpoint there,
        and raise Stopped (called from the driver's signal handler: only sets a flag)."""
        self.stop_signal = signum

    def run(self) -> Any:
        """Train to the end and return rank 0's final state; raise what stopped the run."""
        t0 = time.monotonic()
        self.events.log("run_started", step=0, num_workers=self.size,
                        **({"launched": round(self.launched, 3)} if self.launched else {}),
                        **({"min_workers": self.min_workers} if self.min_workers < self.size else {}),
                        **({"max_workers": self.max_workers} if self.max_workers > self.size else {}))
        try:
            self._start(t0)
            while isinstance(self.state, RunningState):
                poll = self._poll()
                if poll.done:
                    self.state = FinishedState(poll.result)
                elif poll.failures:
                    self._recover(poll.failures)
                elif hung := self._hung():
                    self._recover(hung)
                elif self.formation.all_paused():
                    if self.stop_signal is not None:
                        self._stop()
                    self._resize()
                elif self.stop_signal is not None and self.formation.pause_asked is None:
                    # A stop pauses the workers as a resize or a drain does: at a step
                    # boundary every rank agrees on in its metrics reduction.
                    self._pause()
                else:
                    self.resizing.check_short(self.formation.size)
                    self._watch_drains()
                    self._move_stragglers()
                    self._look_for_room()
            return self._finish(t0)
        except Stopped as exc:
            self.state = FailedState(exc)
            raise
        except BaseException as exc:
            self.state = FailedState(exc, self.recovery.gave_up)
            gave_up = self.state.gave_up
            self.events.log("failed", step=self.step, **_describe(exc), **({"reason": gave_up} if gave_up else {}))
            raise
        finally:
            self.group.shutdown(keep=isinstance(self.state, FinishedState))

    # ------------------------------------------------------------------ lifecycle

    def _start(self, t0: float) -> None:
        """Form the group (recovering where a worker is lost meanwhile); training runs."""
        try:
            if self.takeover is not None:
                self.former.take_over(self.takeover, t0)
            else:
                self.former.form(self.resume, t0, first=True)
        except ReformFailed as exc:  # a worker lost while the group first formed
            self._recover(exc.failures, lost=exc.dead)
        if not isinstance(self.state, FinishedState):  # a recovery as it started can find training over
            self.state = RunningState()
        self.callbacks("on_run_start", self.ctx)
        self.callbacks("on_epoch_start", self.ctx)

    def _finish(self, t0: float) -> Any:
        """Every worker finished: the last callbacks, and the `finished` event; rank 0's
        result."""
        assert isinstance(self.state, FinishedState)
        result = self.state.result
        self.callbacks("on_epoch_end", self.ctx)
        self.callbacks("on_run_end", self.ctx)
        self.events.log("finished", step=self.step, seconds=round(time.monotonic() - t0, 3),
                        reason=result.stop_reason)
        return result

    def _stop(self) -> None:
        """Every worker paused for a stop: commit a checkpoint of that step, say so, raise
        Stopped (the group is shut down on the way out)."""
        self.formation.step = self.ctx.step = max(end.step for end in self.formation.paused.values())
        try:
            poll = self.group.save_paused()
            self._record(poll.rows)
            for event in poll.events:
                self.events.log(**event)
                if event["event"] == "checkpoint_committed":
                    self.callbacks("on_checkpoint", self.ctx, event["path"])
        except Exception as exc:  # a worker lost now: the newest checkpoint committed before stands
            message = f"the checkpoint at the stop (step {self.step}) could not be committed: {exc}"
            warn(message)
        newest = self.restore()
        name, at = (newest[1], newest[0]) if newest else (None, None)
        self.events.log("stopped", step=self.step, signal=signal.Signals(self.stop_signal).name,
                        checkpoint=name, checkpoint_step=at)
        raise Stopped(self.stop_signal, self.step, name, at)

    # ------------------------------------------------------------------ polls

    def _poll(self) -> Poll:
        poll = self.group.poll(self._poll_wait())
        self.formation.paused.update(poll.paused)
        self._record(poll.rows)
        self.recorder.worker_events(poll.events)
        return poll

    def _poll_wait(self) -> float:
        if not isinstance(self.state, RunningState):  # recovering, resizing: every moment counts
            return self.poll_interval_s
        due = [self.drains.checked_at + self.drains.check_s]
        if self.failure.step_timeout_s is not None:
            due.append(self.watchdog.checked_at + 1.0)  # the hang check
        if self.formation.size < self.max_workers and self.formation.pause_asked is None:
            due.append(self.resizing.checked_at + self.resizing.check_s)
        return poll_wait(time.monotonic(), due, self.poll_interval_s, self.max_poll_s)

    def _record(self, rows: list[dict[str, Any]]) -> None:
        """The rows not recorded before go to the records; the run's step follows them."""
        rows = self.recorder.fresh(rows)
        self.stragglers.rows(rows)  # takes the ranks' compute times out: not metrics
        if rows:
            self.formation.step = max(self.formation.step, rows[-1]["step"])
            self.recorder.write(rows)

    def _hung(self) -> list[Failure]:
        return self.watchdog.hung(self.step, recovering=isinstance(self.state, RecoveringState))

    # ------------------------------------------------------------------ failures and resizes

    def _recover(self, failures: list[Failure], lost: list[int] | None = None) -> None:
        """Recover from `failures` (recovery.py) and go on training, or finish where training
        was over as the workers stopped."""
        self.state = RecoveringState(tuple(failures), None if lost is None else tuple(lost))
        end = self.recovery.recover(failures, lost)
        self.state = RunningState() if end is None else FinishedState(end)

    def _pause(self) -> None:
        """Ask every worker to pause at a step boundary they agree on."""
        self.group.pause()
        self.formation.pause_asked = time.monotonic()

    def _look_for_room(self) -> None:
        """Once workers started where the cluster has room are up to join (Resizing.room),
        ask every worker to pause, so that the group re-forms with them (`_resize`)."""
        if self.formation.pause_asked is None and self.resizing.room(self.formation.size, self.step):
            self._pause()

    def _watch_drains(self) -> None:
        """Once workers on draining nodes are to leave (DrainWatch), ask every worker to
        pause, so that the group re-forms without those (`_resize`)."""
        if self.formation.pause_asked is not None:
            return
        leaving = self.drains.check(self.formation.nodes, self.formation.size, self.min_workers, self.step,
                                   self.recorder.pause_estimate(), keep=self.stragglers.to_replace())
        if leaving:
            self.formation.leaving = leaving
            self._pause()

    def _move_stragglers(self) -> None:
        """failure.stragglers replace: once the replacement started for a slow rank is up,
        ask every worker to pause, so that the group re-forms with it in the slow one's place
        (`_resize`), as a worker leaves a draining node: from the others' memory, nothing
        lost. Not a failure: the slow worker is alive and its state good."""
        slow = self.stragglers.to_replace()
        if not slow or self.formation.pause_asked is not None:
            return
        ready = self.group.replacements(sorted(set(slow) | set(self.drains.leaving)))
        if set(slow) <= set(ready):
            nodes = self.formation.nodes
            self.formation.leaving = {r: {"node_id": nodes[r].node_id, "deadline": None, "reason": "slow worker",
                                          "slow": True} for r in slow}
            self._pause()

    def _resize(self) -> None:
        """Every worker paused at the same step: re-form with the newcomers, and without
        the workers leaving a draining node."""
        formation = self.formation
        self.state = ResizingState(min(end.time for end in formation.paused.values()), dict(formation.leaving))
        paused_at, leaving = self.state.paused_at, formation.leaving
        old_world, old_nodes = formation.size, formation.nodes
        try:
            if formation.replicated:
                reformed = self.former.reform(ReformPlan(leave=sorted(leaving)))
            elif self.failure.snapshot_every_n_steps:  # re-sharded from the snapshots kept as they paused
                reformed = self.former.reform(ReformPlan(leave=sorted(leaving), state_from="peers", grow=True))
            else:
                reformed = self.former.restart(leave=sorted(leaving))
        except ReformFailed as exc:  # a worker lost while the group re-formed: a failure like any other
            formation.size = exc.world_size or formation.size
            self._recover(exc.failures, lost=exc.dead)
            return
        formation.step = reformed.step
        self.resizing.resized(old_world, formation.size, old_nodes, leaving, reformed,
                              seconds=round(time.time() - paused_at, 3))
        self.resizing.note_size(formation.size)
        self.state = RunningState()


def _describe(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, WorkerError):
        return {"rank": exc.rank, "cause": exc.message, "error": type(exc).__name__}
    if isinstance(exc, RaytrainerError):
        return {"cause": str(exc), "error": type(exc).__name__}
    if isinstance(exc, KeyboardInterrupt):
        return {"cause": "interrupted", "error": "KeyboardInterrupt"}
    return {"cause": f"{type(exc).__name__}: {exc}", "error": type(exc).__name__}

