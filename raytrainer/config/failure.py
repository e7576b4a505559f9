"""The failure section: how a run recovers from lost workers, and the faults it may inject."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from ..errors import ConfigError

AUTO = "auto"
AUTO_BUDGET = 0.02
"""snapshot_every_n_steps auto: the share of the training time the snapshots are to take."""
AUTO_FIRST = 5
"""auto: the interval until the ranks of a group have agreed on one measured in it."""
AUTO_MOST = 1000
"""auto: the longest interval, whatever the snapshots cost."""


def auto_interval(every: int, cost_s: float, step_s: float) -> int:
    """The interval (steps) to snapshot at after `every`: the one at which snapshots costing
    `cost_s` each take AUTO_BUDGET of steps of `step_s` (worker/state/snapshot.py measures both),
    once it is over half as long again as `every` or under two thirds of it (the measures
    vary from one snapshot to the next: the interval does not follow them); `every` while
    no step time is measured."""
    if step_s <= 0:
        return every
    target = max(1, min(AUTO_MOST, math.ceil(cost_s / (AUTO_BUDGET * step_s))))
    return target if target > 1.5 * every or 1.5 * target < every else every


@dataclass(kw_only=True)
class ChaosFault:
    """A fault to inject, for tests and for checking a setup. It acts on one rank at the
    end of an optimizer step (after the weights are updated), once per run."""

    action: Literal["kill", "freeze", "hang", "delay", "raise"]
    """kill: SIGKILL the worker process; freeze: SIGSTOP it (alive, holding its sockets,
    answering nothing: a paused VM); hang: stop making progress in the task's code (until
    the driver's step_timeout_s kills it); delay: sleep `seconds`; raise: raise in the worker."""
    step: int | None = None
    """The step it acts after; or null with `probability`."""
    probability: float | None = None
    """Act after any step with this probability (seeded by trainer.seed: reproducible)."""
    rank: int | None = None
    """The rank it acts on; null: a rank drawn at random (seeded)."""
    seconds: float = 1.0
    """How long a delay lasts."""
    at: Literal["end", "random"] = "end"
    """end: after the step's update; random (kill, freeze): from another thread, at a
    random moment of the step (up to the previous step's duration after it begins:
    in the forward, the backward, a collective or the optimizer)."""

    def __post_init__(self):
        if self.at == "random" and self.action not in ("kill", "freeze"):
            raise ConfigError(f"failure.chaos ({self.action}): at=random is for kill and freeze only")
        if (self.step is None) == (self.probability is None):
            raise ConfigError(f"failure.chaos ({self.action}): give exactly one of step or probability")
        if self.step is not None and self.step < 1:
            raise ConfigError(f"failure.chaos ({self.action}): step={self.step} must be >= 1")
        if self.probability is not None and not 0.0 < self.probability <= 1.0:
            raise ConfigError(f"failure.chaos ({self.action}): probability={self.probability} must be in (0, 1]")
        if self.rank is not None and self.rank < 0:
            raise ConfigError(f"failure.chaos ({self.action}): rank={self.rank} must be >= 0 (or null)")
        if self.seconds < 0:
            raise ConfigError(f"failure.chaos ({self.action}): seconds={self.seconds} must be >= 0")


@dataclass(kw_only=True)
class FailureConfig:
    max_failures: int = 3
    """Recoveries from the run's own faults (an error in the task's code, a hang, a worker
    that keeps dying at the same step) allowed within failure_window_s; the next one fails
    the run. 0: fail at the first. Lost workers count apart (max_losses)."""
    failure_window_s: float | None = 3600.0
    """The window max_failures counts in: faults older than this are forgotten, so a long
    run is not failed by its age. null: the whole run."""
    max_losses: int | None = None
    """Recoveries from lost workers allowed in the run: a worker process killed from outside
    (SIGKILL, the OOM killer), its node lost or preempted. null: no limit (each costs a
    fraction of a second; a spot node's loss is the cluster's, not the run's)."""
    step_timeout_s: float | None = 300.0
    """A worker that makes no progress (no micro-batch, no validation batch) for this long
    is hung: its Python stacks are dumped into the run directory and it is replaced.
    null: never time out."""
    collective_timeout_s: float = 600.0
    """How long a collective (and the forming of a group) may wait for a peer before it
    fails. Detection of a lost or hung peer does not wait for it (the driver sees a death
    at once and a hang after step_timeout_s); it bounds what nothing else catches. Keep it
    above the longest wait ranks have for rank 0 alone (a synchronous checkpoint write)."""
    recovery: Literal["fast", "exact"] = "fast"
    """What the survivors do when a lost worker has no warm spare up to take its place.
    fast: go on at once without it, one world size smaller, while its replacement starts;
    it joins at a step boundary once up (a pause of a fraction of a second, as any grow).
    The global batch and the sample order stay the same at any world size, so nothing is
    lost, but the run ends within float tolerance of an undisturbed one, not bit for bit.
    Below scaling.min_workers only while the replacements come (up to
    scaling.placement_timeout_s, then the run fails as when they cannot be placed). exact:
    wait for the replacement (a process start and torch import: seconds), keeping the world
    size, so a run with failures ends bit-identical to an undisturbed one. Either way a
    ready warm spare takes the lost worker's place at once, bit-identically; a fixed-size
    run with trainer.batch_policy per_worker always waits. Sharded state (fsdp) goes back
    to its peer snapshots, re-sharded onto the ranks left (fast) or at the same size (exact)."""
    warm_spares: int = 1
    """Idle worker processes kept ready (torch and torch._dynamo imported, no resources
    held) to take a lost CPU worker's place at once, keeping the world size (a GPU worker
    needs its GPU at creation: none for GPU runs). Spread over the nodes the workers run
    on (a spare replaces a worker of its own node); started once training runs, and again
    after one is used, once no replacement is starting, so their start does not take the
    cores a recovery needs. A spare also builds the model and optimizer ahead; one still
    building is taken only where the lost worker would be waited for (with recovery fast,
    the survivors go on without it). Each is a process holding torch in memory. 0: none."""
    snapshot_every_n_steps: Literal["auto"] | int = AUTO
    """Sharded state (trainer.strategy: fsdp): every this many optimizer steps each worker
    copies its shards of the training state to host memory and to one peer's, so that a
    lost worker's state is recovered from its peer and the run replays at most this many
    steps (twice that where the newest snapshot was still being exchanged), reading no
    checkpoint (the memory it takes: docs/fault-tolerance.md, "FSDP: peer snapshots").
    auto: the fewest steps at which the snapshots, as measured in the run, take about 2% of
    its time (a "snapshot_interval" event says each interval chosen; 5 steps until the first
    is measured). 0: recover from the newest checkpoint instead. Replicated state (ddp) needs
    none: every survivor holds it. Your own loop (task.loop) under fsdp copies at every
    report with state instead (any value but 0), so that it loses at most the steps since
    that report."""
    driver_grace_s: float = 300.0
    """How long the workers outlive a driver that died without stopping them (SIGKILL, an
    OOM kill, a lost head process): they pause at a step boundary, keep the state in memory
    and wait this long for a new driver of the run (the same command run again, or
    `raytrainer resume`), which takes them over and continues at their step; then they end
    by themselves, releasing their resources (`raytrainer release RUN_DIR` at once). 0:
    they end with their driver, as Ray's actors do, and a new driver continues from the
    newest checkpoint."""
    stragglers: Literal["report", "replace", "off"] = "report"
    """A worker persistently slower than the others (straggler_margin times their median
    compute time per step, over straggler_window steps, twice in a row) holds every step
    back. report: a `slow_worker` event and a console line; replace: that too, then the
    worker is moved to a new process (a warm spare or a fresh worker) at a step boundary,
    as a worker leaves a draining node: from the others' memory, no step lost, no failure
    counted; off: not judged (the times still ride along: a float per rank and step). Each rank's compute time (its data, forward and backward,
    not its waits for its peers) rides the gradient all-reduce: DDP on 2 or more workers."""
    straggler_margin: float = 1.3
    """How much slower than the other ranks' median a rank's compute must be to count."""
    straggler_window: int = 20
    """The steps a slow rank is judged over (twice: one slow window may be a hiccup)."""
    chaos: list[ChaosFault] = field(default_factory=list)
    """Faults to inject (see ChaosFault)."""

    def __post_init__(self):
        every = self.snapshot_every_n_steps
        if every != AUTO and (not isinstance(every, int) or isinstance(every, bool) or every < 0):
            raise ConfigError(f"failure.snapshot_every_n_steps={every!r} must be >= 0 "
                              "(0: no peer snapshots) or auto")
        if self.max_failures < 0:
            raise ConfigError(f"failure.max_failures={self.max_failures} must be >= 0")
        if self.failure_window_s is not None and self.failure_window_s <= 0:
            raise ConfigError(f"failure.failure_window_s={self.failure_window_s} must be > 0 (or null: the whole run)")
        if self.max_losses is not None and self.max_losses < 0:
            raise ConfigError(f"failure.max_losses={self.max_losses} must be >= 0 (or null: no limit)")
        if self.warm_spares < 0:
            raise ConfigError(f"failure.warm_spares={self.warm_spares} must be >= 0 (0: none)")
        if self.step_timeout_s is not None and self.step_timeout_s <= 0:
            raise ConfigError(f"failure.step_timeout_s={self.step_timeout_s} must be > 0 (or null)")
        if self.driver_grace_s < 0:
            raise ConfigError(f"failure.driver_grace_s={self.driver_grace_s} must be >= 0 (0: workers end with "
                              "their driver)")
        if self.straggler_margin <= 1.0:
            raise ConfigError(f"failure.straggler_margin={self.straggler_margin} must be > 1 (e.g. 1.3: 30% slower)")
        if self.straggler_window < 1:
            raise ConfigError(f"failure.straggler_window={self.straggler_window} must be >= 1")
        if self.collective_timeout_s <= 0:
            raise ConfigError(f"failure.collective_timeout_s={self.collective_timeout_s} must be > 0")
