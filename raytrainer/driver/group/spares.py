"""The warm spare: an idle worker process, torch imported, ready to take a lost worker's
place in a fraction of a cold start.

It runs on a slot's node but holds no resources (CPU workers only: a GPU worker needs its
GPU assigned by Ray at creation). It starts once training runs (the group's first poll),
not beside the workers' start: a process importing torch on the same cores delays their
set-up and first step; and the next one once a recovered group has formed, not as the
recovery begins, so its start does not take the cores the recovery needs. It imports
torch on a thread at nice 19 (worker.actor._Imports), so that training keeps the cores
meanwhile, and is ready once it answers its node() call.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from ...config import Config
from .actors import Roster, start_worker


class WarmSpare:
    def __init__(self, config: Config, bundle: dict[str, float], enabled: bool):
        self.config, self.bundle, self.enabled = config, bundle, enabled
        self.actor: Any = None
        self._node: tuple[Any, str] | None = None  # (its node() call, the node it was sent to)

    def start(self, roster: Roster) -> None:
        """Start one beside rank 0's slot, unless one is up or starting."""
        if self.actor is None and self.enabled and roster.slots:
            self.actor = start_worker(self.config, self.bundle, roster.slots[0], spare=True)
            self._node = (self.actor.node.remote(), roster.nodes[0].node_id)

    def take(self, node_id: str) -> tuple[Any, Any] | None:
        """The spare and its node() call, made as it started, if it is ready (it has answered
        that call: torch imported) on `node_id`. One still importing is left to go on:
        it imports at the lowest priority (worker.actor._Imports), which on a busy machine
        can take longer than a cold start at the workers' own."""
        if self.actor is None:
            return None
        ref, _ = self._node
        try:
            on = ray.get(ref, timeout=0).node_id
        except GetTimeoutError:
            return None
        except (RayActorError, RayTaskError):  # it died (its node with it?): start a new one later
            self.actor = None
            return None
        if on != node_id:
            return None
        spare, self.actor = self.actor, None
        if not any(n["NodeID"] == on and n["Alive"] for n in ray.nodes()):
            ray.kill(spare, no_restart=True)  # the node is gone, and the spare with it
            return None
        return spare, ref

    def keep_only_on(self, node_ids: set[str]) -> None:
        """Let the spare go if it is beside no worker any more (they left its node)."""
        if self.actor is not None and self._node[1] not in node_ids:
            ray.kill(self.actor, no_restart=True)
            self.actor = None

    def shutdown(self) -> None:
        if self.actor is not None:
            ray.kill(self.actor, no_restart=True)
        self.actor = None
