"""Warm spares: idle worker processes, torch imported, each ready to take the place of a lost
worker of its node in a fraction of a cold start (failure.warm_spares of them).

A spare holds no resources (CPU workers only: a GPU worker needs its GPU assigned by Ray at
creation), so it can only stand in for a worker whose slot is on its own node: the spares
are spread over the nodes the workers run on. They start once training runs (the group has
reported a step), not beside the workers' start: a process starting and importing torch on
the same cores delays their set-up and first step. One used is replaced the same way, once
the recovered group has trained a step and no lost worker's replacement is still starting:
a spare started as the group re-formed slows the first steps after the recovery, which are
the ones that count. A spare imports torch on a thread at nice 19
(worker/process/actor.py, its warm-up thread), so that training keeps the cores meanwhile, and is ready once it
answers its node() call; only a ready one is taken: one still importing at the lowest
priority can take longer than a cold start at the workers' own on a busy machine. Before a
recovery counts on one, it must answer again, within PING_S: a spare on a node lost a moment
ago is gone with it while Ray still holds the node alive (for its health checks, ~15 s), and a
recovery that took it failed and started over (2 s in a node-loss test). That answer also
says whether it has built the task's training state ahead (worker/process/warm.py): one still building
at nice 19 leaves the rest of its build in the recovery (seconds at 2 GB of state:
docs/results/2026-11-27-spare-still-building.md), so where the survivors can
go on without the lost rank (policy.replacing) only a built one is taken.

A spare is up only a cold start after it is started (CPU-seconds, nearly all of it
importing torch), and it protects the run only from then on: where the run will have ended
before a spare could be up for as long again (its remaining steps at the pace rank 0 reports,
against the last cold start of this driver's workers), none is started cold. The process would
only take CPU from training, and a recovery meanwhile waits for a cold start either way. A kept
process (kept.py) is up already and still serves. Until the pace is known (two step rows since
the group launched) none starts; a run of no known length (no total steps) gets its spares.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from ...config import Config
from ...contract import Node
from .actors import Roster, alive_nodes, control, start_spare


@dataclass(eq=False)
class Spare:
    actor: Any
    up: Any
    """Its node() call, made as it started: answered once it is up (torch imported)."""
    node: str
    """The node it is pinned to."""
    built: bool = False
    """Whether it said, at its last ask, that it has built the task's training state ahead."""


COLD_START_S: list[float] = []
"""The last cold start of this driver's workers, from their start to their node() answer
(RayWorkerGroup.start measures it where a kept process did not serve them all)."""


class Pace:
    """When the run will end, from the step rows rank 0 reported since the group launched."""

    def __init__(self) -> None:
        self.first: tuple[int, float] | None = None
        self.last: tuple[int, float] | None = None

    def add(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            if "step" in row and "time" in row:
                self.first = self.first or (row["step"], row["time"])
                self.last = (row["step"], row["time"])

    def ends_in_s(self, total_steps: int | None) -> float | None:
        """Seconds until the last step at the pace so far; inf for a run of no known length
        (`total_steps` None); None while no step is reported (one, in a run of known length:
        no pace yet)."""
        if self.first is None or self.last is None:
            return None
        if total_steps is None:
            return float("inf")
        (step0, t0), (step, t) = self.first, self.last
        if step <= step0:
            return None
        return max(total_steps - step, 0) * (t - t0) / (step - step0)


def worth_a_cold_start(ends_in_s: float) -> bool:
    """Whether a spare started cold now would be up for as long as its start took before the
    run ends (no cold start measured yet: yes)."""
    return not COLD_START_S or ends_in_s > 2 * COLD_START_S[-1]


class WarmSpares:
    PING_S = 0.5
    """How long a spare that was up gets to answer again before a recovery counts on it."""

    def __init__(self, config: Config, count: int):
        self.config, self.count = config, count
        self.spares: list[Spare] = []

    def start(self, roster: Roster, ends_in_s: float) -> None:
        """Start spares up to the count, each on the node whose workers have the fewest
        spares each (then the one with the most workers); where the run ends in `ends_in_s`,
        too soon for a cold start to pay, only kept processes serve."""
        if len(self.spares) >= self.count or not roster.nodes:
            return
        cold = worth_a_cold_start(ends_in_s)
        workers = Counter(n.node_id for n in roster.nodes)
        on = Counter(s.node for s in self.spares)
        while len(self.spares) < self.count:
            node = min(workers, key=lambda n: (on[n] / workers[n], -workers[n]))
            actor = start_spare(self.config, node, cold)
            if actor is None:
                return
            self.spares.append(Spare(actor, actor.node.remote(), node))
            on[node] += 1

    def ready_on(self, node_ids: list[str]) -> list[bool | None]:
        """For each of `node_ids` in turn, whether a spare that is up there (and not counted
        for an earlier one) could take a worker's place now: True where it has built the
        training state ahead too (the built ones counted first), False where it is still
        building, None where no spare is up. One ping of the spares for all."""
        wanted = set(node_ids)
        up = [s for s in self._alive() if s.node in wanted and _answered(s.up)]
        if up:  # a node lost a moment ago: its spares are gone with it, not yet seen so
            alive = alive_nodes()
            up = self._answering([s for s in up if s.node in alive])
        free = {node: sorted((s.built for s in up if s.node == node), reverse=True) for node in wanted}
        return [free[node].pop(0) if free[node] else None for node in node_ids]

    def take(self, node_id: str) -> tuple[Any, Any, Node] | None:
        """A spare that is up on `node_id` (a built one first), its node() call, made as it
        started (a recovery waits for it through that call: one round trip fewer), and that
        call's answer (where it runs, its pid)."""
        up = [s for s in self._alive() if s.node == node_id and _answered(s.up)]
        if not up or node_id not in alive_nodes():
            return None
        spare = max(up, key=lambda s: s.built)
        self.spares.remove(spare)
        return spare.actor, spare.up, ray.get(spare.up)

    def keep_only_on(self, node_ids: set[str]) -> None:
        """Let go the spares beside no worker any more (they left the spare's node)."""
        for spare in [s for s in self.spares if s.node not in node_ids]:
            self._let_go(spare)

    def let_go_up(self) -> list[tuple[Any, str]]:
        """The spares that are up, (actor, node id) each, no longer this run's (a finished
        run keeps them for the next: kept.py); the others stay, for shutdown()."""
        up = [s for s in self.spares if _answered(s.up)]
        self.spares = [s for s in self.spares if s not in up]
        return [(s.actor, s.node) for s in up]

    def shutdown(self) -> None:
        for spare in self.spares:
            ray.kill(spare.actor, no_restart=True)
        self.spares = []

    def _answering(self, spares: list[Spare]) -> list[Spare]:
        """Of `spares`, those that answer a call within PING_S, each noting whether it has
        built its training state ahead; the others are let go (their process, or their
        node, is gone; one is started again at the next start())."""
        refs = [control(s.actor, "built").remote() for s in spares]
        ray.wait(refs, num_returns=len(refs), timeout=self.PING_S)
        out = []
        for spare, ref in zip(spares, refs):
            if _answered(ref):
                spare.built = ray.get(ref)
                out.append(spare)
            else:
                self._let_go(spare)
        return out

    def _alive(self) -> list[Spare]:
        """The spares, less those that died (with their node?): replaced at the next start."""
        for spare in list(self.spares):
            try:
                ray.get(spare.up, timeout=0)
            except GetTimeoutError:
                pass
            except (RayActorError, RayTaskError):
                self._let_go(spare)
        return list(self.spares)

    def _let_go(self, spare: Spare) -> None:
        ray.kill(spare.actor, no_restart=True)
        self.spares.remove(spare)


def _answered(ref: Any) -> bool:
    try:
        ray.get(ref, timeout=0)
        return True
    except (GetTimeoutError, RayActorError, RayTaskError):
        return False
