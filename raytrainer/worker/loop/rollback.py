"""trainer.nonfinite: rollback. A step whose loss is not finite, or (trainer.spike_factor)
finite but far above the recent steps' (a spike), is undone rather than stopped at: every
rank goes back to a recent state it keeps in host memory, the data position moves past the
batches trained on since that state (the bad one among them), and the run goes on. Nothing
is read from storage, and no step is lost but those gone back over (at most one interval).

A spike's update may have started the weights diverging a few steps before its loss shows
it, and the batches that made it are the likeliest to make it again: hence back to the kept
state, and past the batches since (as large-model runs do by hand from a checkpoint).

Every rank must decide the same at the same step: the spike rule judges the loss summed over
ranks (the one the gradient all-reduce carries under DDP, one all-reduce of its own
otherwise), the kept states are taken at the same steps on every rank, and what the rule
has seen is part of the training state (`where`), so a replacement judges as its peers do.

The kept state is the peer snapshots' own copy where they are kept (sharded state:
snapshot.py), else one host copy of this rank's state, taken at the peer snapshots' interval
(failure.snapshot_every_n_steps; `auto` measures what a copy costs as they do, the ranks
agreeing on it with one small all-reduce per copy). Without a copy yet (the run's or a
group's first steps) a rollback goes back to the step before the bad one: its update is
dropped, which is `skip`.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from ...checkpoint import to_cpu
from ...config import TrainerConfig
from ...config.failure import AUTO, AUTO_FIRST
from ...errors import ConfigError, NonFiniteLoss
from ..state.snapshot import AutoInterval, PeerSnapshots, load, restore

if TYPE_CHECKING:
    from .face import RollbackFace

SPIKE_WINDOW = 32  # the recent steps whose median loss a spike is measured against
SPIKE_MIN = 8  # losses seen before the rule applies: a run's first steps have no "usual" yet
ROLLBACK_SPAN = 100  # steps: more than trainer.rollback_max rollbacks within it stop the run


class LossSpikes:
    """The spike rule: a finite loss over `factor` times the median of the last SPIKE_WINDOW
    steps' losses (which it is then not one of). Meant for losses >= 0 (a median <= 0 never
    judges a spike). `recent` is (step, loss) pairs, kept in the training state."""

    def __init__(self, factor: float | None):
        self.factor = factor
        self.recent: list[tuple[int, float]] = []

    def judge(self, step: int, loss: float) -> str | None:
        """Why step `step`'s loss `loss` is a spike, or None (then it joins the recent ones)."""
        if self.factor is None:
            return None
        if len(self.recent) >= SPIKE_MIN:
            median = statistics.median(value for _, value in self.recent)
            if median > 0 and loss > self.factor * median:
                return (f"step {step}: the loss {loss:.4g} is over trainer.spike_factor={self.factor:g} times "
                        f"the median of the last {len(self.recent)} steps' ({median:.4g})")
        self.recent.append((step, loss))
        del self.recent[:-SPIKE_WINDOW]
        return None

    def forget_after(self, step: int) -> None:
        """The steps after `step` were undone: their losses are not the run's any more."""
        self.recent = [(s, value) for s, value in self.recent if s <= step]


def agreed_loss(loss_col: int, total: torch.Tensor, carried: list[float] | None, world_size: int,
                waiting: Callable[[], contextlib.AbstractContextManager]) -> float:
    """The step's loss summed over ranks (each rank's weighted by its share: the global
    batch's mean), the same on every rank: carried with the gradients, else one all-reduce
    (`waiting` marks it for the hang check)."""
    if carried is not None:
        return carried[loss_col]
    loss = total[loss_col].detach().reshape(1).clone()
    if world_size > 1:
        with waiting():
            dist.all_reduce(loss)
    return float(loss.item())


class KeptState:
    """The state of a recent step this rank can go back to: the peer snapshots' own copy
    where they are kept, else a host copy taken at their interval (`every`: an int, 0 for
    none, or auto). Only the newest is kept: one copy of the state in host memory."""

    def __init__(self, every: int | str, peer: PeerSnapshots | None, start: int = 0):
        self.peer = peer
        self.start = start  # the group's first step: no rank goes back past it (a newcomer holds nothing older)
        self.auto = every == AUTO
        self.every = AUTO_FIRST if self.auto else int(every)
        self.interval = AutoInterval()
        self.step: int | None = None
        self.state: dict[str, Any] | None = None

    def reset(self, start: int) -> None:
        """A new group, from step `start`: no rank of it goes back past it, and auto measures anew."""
        self.step, self.state, self.start = None, None, start
        self.interval.reset()
        if self.auto:
            self.every = self.interval.every

    def due(self, step: int) -> bool:
        """As the peer snapshots': at a group's first step boundary but step 0 (a fresh
        optimizer's state has another shape), then every interval."""
        if self.peer is not None or self.every <= 0 or step in (0, self.step):
            return False
        if self.step is None:
            return True
        return self.interval.due(step) if self.auto else step % self.every == 0

    def take(self, step: int, state_dict: Callable[[], dict[str, Any]], world_size: int) -> None:
        """Keep the state after `step` (collective under auto, at the same steps on every rank)."""
        started = time.perf_counter()
        step_s = self.interval.taken(step, started)[0] if self.auto else 0.0
        self.state = None  # the old copy goes first: at most one (and the one being made)
        self.state, self.step = to_cpu(state_dict()), step
        if self.auto:
            measured = torch.tensor([time.perf_counter() - started, step_s], dtype=torch.float64)
            if world_size > 1:  # the most any rank paid: every rank's next interval the same
                dist.all_reduce(measured, op=dist.ReduceOp.MAX)
            self.interval.agree(float(measured[0]), float(measured[1]))
            self.every = self.interval.every

    def newest(self, now: int, template: Callable[[], dict[str, Any]]) -> tuple[int, dict[str, Any]] | None:
        """(step, state) of the newest state kept at or before step `now`, or None."""
        if self.peer is None:
            if self.step is None or self.step > now:
                return None
            return self.step, restore(template(), self.state)  # into this rank's tensors (shards)
        self.peer.wait()  # its exchange of the newest step: then every rank holds that step
        held = self.peer.holdings()
        steps = [s for s in held.own if self.start <= s <= now]
        if not steps or (held.rank, held.world_size) != (self.peer.rank, self.peer.world):
            return None
        like, saved = template(), load(self.peer.own_snapshot(max(steps)))
        return max(steps), restore(like, {key: saved[key] for key in like})  # the training state's part


class Rollbacks:
    """What trainer.nonfinite: rollback does at a bad step, and when it gives up."""

    def __init__(self, most: int, kept: KeptState):
        self.most, self.kept = most, kept
        self.at: list[int] = []  # the bad steps rolled back from, within ROLLBACK_SPAN

    def check(self, step: int, why: str) -> None:
        """Raise NonFiniteLoss where this rollback would be one too many."""
        self.at = [s for s in self.at if s > step - ROLLBACK_SPAN] + [step]
        if len(self.at) > self.most:
            raise NonFiniteLoss(
                f"{why}: the {len(self.at)}th rollback within {ROLLBACK_SPAN} steps, over trainer.rollback_max="
                f"{self.most}, so the run stops before applying that update (the weights and checkpoints hold "
                "the state before it). Look for the data or the learning rate that makes it, then "
                "`raytrainer resume` the run")


def rollbacks(cfg: TrainerConfig, every: int | str, peer: PeerSnapshots | None, train_input: Any,
              start: int) -> Rollbacks | None:
    """The loop's rollbacks under trainer.nonfinite: rollback, else None (`start`: its first step)."""
    if cfg.nonfinite != "rollback":
        return None
    if not hasattr(train_input, "pass_over"):  # a rollback moves the data past batches
        raise ConfigError("trainer.nonfinite: rollback cannot move a Ray Data training dataset past "
                          "batches; use stop or skip with it")
    return Rollbacks(cfg.rollback_max, KeptState(every, peer, start))


def roll_back(loop: RollbackFace, step: int, why: str) -> None:
    """Undo everything since the newest kept state (or just step `step`'s update, none being
    kept), move the data past step `step`'s batch, and tell the driver. Every rank calls it at
    the same step, with no collective."""
    loop.rollbacks.check(step, why)  # or the run stops here
    loop.train.abandon_step()
    kept = loop.rollbacks.kept.newest(step - 1, loop.train.state_dict)
    to_step = step - 1
    if kept is not None:
        to_step, state = kept
        loop.train.load_state_dict(state)
    loop.train_input.pass_over(step, to_step)
    loop.spikes.forget_after(to_step)
    loop.step = to_step
    loop.position += loop.plan.global_batch_size  # past the bad batch; those before it already were
    if loop.rank == 0:
        loop.notify({"event": "rolled_back", "step": step, "to_step": to_step, "skipped_batches": step - to_step,
                     "why": why})
