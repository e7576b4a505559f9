"""The worker group as the controller formed it, and the ways it forms it (controller.py).

`Formation` is what the controller and a recovery (recovery.py) both read and change: how
many ranks the group has, where each runs, whether each holds the whole state, how far the
run trained, and the pause under way (who paused, since when it was asked, who leaves).

`Former` forms the group and re-forms it: from scratch (`form`: from a checkpoint, or an
older one where that one is corrupt), over the workers a lost driver left (`take_over`),
from what survives (`reform`, as a contract.ReformPlan says), or from the checkpoint the
workers wrote (`restart`, `from_storage`); each time the watches that count from a
forming are told (resizing, stragglers, watchdog), and the group is launched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..callbacks import RunContext
from ..contract import Formed, Node, ReformPlan, Reformed, Resume, RunEnd, WorkerGroup
from ..errors import CheckpointCorrupt, ConfigError, warn
from .metrics import EventLog
from .recorder import Recorder
from .resizing import Resizing
from .stragglers import StragglerWatch
from .watchdog import Watchdog


@dataclass
class Formation:
    """The group as it stands."""

    size: int = 0
    """The world size."""
    nodes: list[Node] = field(default_factory=list)
    """Where each rank runs."""
    replicated: bool = True
    """Every worker holds the whole state (contract.Formed)."""
    step: int = 0
    """The last step the run completed, as the driver knows it."""
    paused: dict[int, RunEnd] = field(default_factory=dict)
    """rank -> its "paused" RunEnd, while the workers pause (a resize, a drain, a stop)."""
    pause_asked: float | None = None
    """When the workers were asked to pause (time.monotonic()); None: not asked."""
    leaving: dict[int, dict[str, Any]] = field(default_factory=dict)
    """rank -> its node's drain (or a slow worker's move), while it leaves."""

    def node_ip(self, rank: int) -> str | None:
        return self.nodes[rank].ip if rank < len(self.nodes) else None

    def all_paused(self) -> bool:
        return len(self.paused) == self.size

    def regrouped(self, nodes: list[Node]) -> None:
        """The group (re-)formed over `nodes`: no pause under way."""
        self.nodes, self.size = list(nodes), len(nodes)
        self.paused, self.pause_asked, self.leaving = {}, None, {}


class Former:
    def __init__(self, group: WorkerGroup, formation: Formation, *, events: EventLog, recorder: Recorder,
                 resizing: Resizing, stragglers: StragglerWatch, watchdog: Watchdog, context: RunContext,
                 progress: Any = None, restore: Callable[..., Resume | None]):
        self.group, self.formation = group, formation
        self.events, self.recorder, self.progress, self.ctx = events, recorder, progress, context
        self.resizing, self.stragglers, self.watchdog = resizing, stragglers, watchdog
        self.restore = restore  # the newest committed checkpoint (before a step, if given), if any

    def form(self, resume: Resume | None, t0: float, first: bool = False) -> Resume | None:
        """Place and start the workers, form the group (from `resume` if given, or an older
        checkpoint where that one is corrupt), launch; return the checkpoint it formed from.
        `first`: the run's first forming (its storage is checked; with no intact checkpoint
        to start from, it fails)."""
        f = self.formation
        nodes = self.group.start()
        f.regrouped(nodes)
        self.resizing.formed(f.size)
        self.stragglers.formed()
        if first:
            checked = self.group.check_storage(nodes)  # before any work that storage would lose
            if checked:
                self.events.log("storage_checked", step=f.step, **checked)
        formed, resume = self._setup(resume, first)
        f.replicated = formed.replicated
        f.step = self.ctx.step = resume[0] if resume else 0
        self.recorder.train_step = max(self.recorder.train_step, f.step)
        if resume:
            self.recorder.kept(resume[0])
            self.events.log("resumed", step=f.step, checkpoint=resume[1])
        if self.progress is not None:
            self.progress.total_steps = formed.total_steps
        self.events.log("group_formed", step=f.step, world_size=f.size,
                        nodes=[n.ip for n in formed.nodes], pids=[n.pid for n in formed.nodes],
                        seconds=round(time.monotonic() - t0, 3), total_steps=formed.total_steps,
                        steps_per_epoch=formed.steps_per_epoch)
        self.group.launch()
        self.watchdog.reset()
        return resume

    def take_over(self, takeover: Any, t0: float) -> None:
        """The workers a lost driver of the run left, paused at one step with the state in
        memory: the group re-formed over them from that memory, and training goes on at
        their step (nothing lost but a step in flight)."""
        f = self.formation
        formed, step = self.group.adopt(takeover)
        f.nodes, f.size = formed.nodes, formed.world_size
        self.resizing.formed(f.size)
        f.replicated = formed.replicated
        f.step = self.ctx.step = step
        if self.progress is not None:
            self.progress.total_steps = formed.total_steps
        self.reform(ReformPlan())  # no one lost: from their memory
        self.events.log("group_formed", step=f.step, world_size=f.size, nodes=[n.ip for n in f.nodes],
                        pids=[n.pid for n in f.nodes], seconds=round(time.monotonic() - t0, 3),
                        total_steps=formed.total_steps, steps_per_epoch=formed.steps_per_epoch, taken_over=True)

    def _setup(self, resume: Resume | None, first: bool) -> tuple[Formed, Resume | None]:
        """Form the group from `resume`; where the workers find that checkpoint corrupt,
        say so and form it from the next older one (from step 0 when none is left)."""
        while True:
            try:
                return self.group.setup(resume[2] if resume else None), resume
            except CheckpointCorrupt as exc:
                message = f"{exc}; falling back to an older one"
                warn(message)  # once: the CLI shows it as a plain line, the API as a warning
                self.events.log("checkpoint_skipped", step=resume[0], checkpoint=resume[1], why=exc.why)
                resume = self.restore(resume[0])
                if resume is None and first:  # nothing to resume from after all
                    raise ConfigError(f"{exc}, and the run has no older intact checkpoint to start from: set "
                                      "run.resume to another checkpoint, or choose another run.name "
                                      "(e.g. --set run.name=NEW)") from None

    def reform(self, plan: ReformPlan) -> Reformed:
        """Re-form the group as `plan` says (contract.ReformPlan), and launch it."""
        reformed = self.group.reform(plan)
        self.formation.regrouped(reformed.nodes)
        self.stragglers.formed()
        self.group.launch()
        self.watchdog.reset()
        return reformed

    def from_storage(self) -> Resume | None:
        """Start the group again from the newest checkpoint (from step 0 where there is
        none); return that checkpoint."""
        self.group.shutdown()
        return self.form(self.restore(), time.monotonic())

    def restart(self, leave: list[int] = ()) -> Reformed:
        """Sharded state: start the group again, with every slot the cluster has, from the
        checkpoint the workers wrote when they paused (loading it reshards the state).
        Ray places nothing on a draining node, so the ranks in `leave` start elsewhere."""
        f = self.formation
        old_world = f.size
        self.from_storage()
        return Reformed(step=f.step, nodes=list(f.nodes), source=None, state_from="checkpoint",
                        added=max(0, f.size - old_world), dropped=list(range(f.size, old_world)),
                        moved=[r for r in leave if r < f.size])
