"""Where the second copy of a lone survivor's state is: the driver's metadata only.

"Two copies, always" (DESIGN.md): when a re-formed group has one worker (a fast recovery
down to one worker of two, its replacement still starting), that worker is the state's
only holder. Its copy in its node's shared memory (worker/state/copies.py) is the second: the
re-form waits for the copy of the step it re-forms at (copy_now), and the worker writes one
at every step boundary after that (keep_copy). Where the re-form secured the state in the
object store anyway (a worker took it from there), that is the first, and the worker's
copies start at the step after. If that worker dies
too, the recovery finds no survivor and starts from the newer of the two: the shared
memory copy is read by a Ray task on its node into the object store, and the workers of the
next group load it from there, as they would a survivor's state. At most the step in
flight is lost. Once a second holder is back (the replacement joined) or the run ends, the
copy is removed. The bytes never pass through this process.
"""

from __future__ import annotations

import uuid
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ...config import Config
from ...contract import STATE_COPIES, Status
from ...task import import_object
from .actors import Roster

# A read starts a Ray worker process on the copy's node (seconds on a busy machine) and
# maps the copy into the object store.
READ_TIMEOUT_S = 120.0
REMOVE_TIMEOUT_S = 20.0


class KeptCopies:
    def __init__(self, config: Config):
        scaling = config.scaling
        # A run of one worker by choice has never had a second holder to lose.
        self.wanted = max(scaling.num_workers, scaling.max_workers or 0) > 1
        self.run_name = config.run.name or "run"
        # The lone holder: (its actor, its node's id, the copy's name), while there is one.
        self.holder: tuple[Any, str, str] | None = None
        # The state secured in the object store by the recovery that left one holder.
        self.secured: tuple[Status, Any] | None = None
        self._stale: list[tuple[str, str]] = []  # (node id, name): copies whose holder is gone

    def copy_now(self, actor: Any, node_id: str) -> Any:
        """A re-form leaves `actor` the state's only holder, with no worker taking the state
        from it: it writes its copy of the step it is at before the group forms, the second
        copy in place of one in the object store. As long to write (fresh memory either way),
        it leaves the object store's memory free, and its
        file is the first of the two its copies take turns in. Returns the call's reference:
        the step written, or None where there is no room for it."""
        self._hold(actor, node_id)  # a holder before it is gone: it is the only worker left
        return actor.copy_now.remote(self.holder[2])

    def after_form(self, roster: Roster, secured: tuple[Status, Any] | None) -> None:
        """A group has formed over `roster`: a lone worker keeps a copy (keep_copy is queued
        ahead of run(); its first is of the step after `secured`, the state this re-form
        secured in the object store, if any, else of the step it is at, unless it wrote
        that one as the group re-formed: copy_now); with two or more none is kept."""
        lone = len(roster.actors) == 1 and self.wanted
        self._hold(roster.actors[0] if lone else None, roster.nodes[0].node_id if lone else "", roster.actors)
        if not lone:
            self.secured = None
            return
        if secured is not None:
            self.secured = secured
        # The step it re-formed at is secured already: its first copy is of the next one.
        roster.actors[0].keep_copy.remote(self.holder[2], secured[0].step if secured is not None else None)

    def _hold(self, actor: Any, node_id: str, alive: list[Any] = ()) -> None:
        """`actor` (None: none) is the lone holder from now on. A holder before it stops and
        removes its copy where it is among `alive`; else its copy is removed from its node."""
        if self.holder is not None and self.holder[0] is not actor:
            old, old_node, name = self.holder
            if any(a is old for a in alive):
                old.keep_copy.remote(None)  # alive, with a peer now: it stops and removes its copy
            else:
                self._stale.append((old_node, name))
            self.holder = None
        self._remove_stale()
        if actor is not None and self.holder is None:
            name = f"raytrainer-copy-{_safe(self.run_name)}-{uuid.uuid4().hex[:12]}"
            self.holder = (actor, node_id, name)

    def newest(self) -> tuple[Status, Any] | None:
        """For a recovery with no survivor: (where the state is, its object-store reference),
        from the lone holder's copy or the state secured as it became the lone holder,
        whichever is newer; None if there is neither."""
        if self.holder is None:
            return self.secured
        _, node_id, name = self.holder
        step_ref, state_ref = _task(node_id, num_returns=2).remote("read", name)
        try:
            step = ray.get(step_ref, timeout=READ_TIMEOUT_S)
        except (GetTimeoutError, RayError):
            step = None  # its node is gone too
        if step is None or (self.secured is not None and self.secured[0].step >= step):
            return self.secured
        return Status(step=step, progress=0, phase="framework"), state_ref

    def remove_all(self) -> None:
        """At the end of the run: no copy is left behind."""
        if self.holder is not None:
            self._stale.append(self.holder[1:])
            self.holder = None
        self._remove_stale(wait=True)
        self.secured = None

    def _remove_stale(self, wait: bool = False) -> None:
        refs = [_task(node_id).remote("remove", name) for node_id, name in self._stale]
        self._stale = []
        if wait and refs:
            try:
                ray.wait(refs, num_returns=len(refs), timeout=REMOVE_TIMEOUT_S)
            except RayError:
                pass  # a lost node took its copy along


def _task(node_id: str, num_returns: int = 1) -> Any:
    """A function of STATE_COPIES as a Ray task on `node_id`: no CPU asked (the workers'
    slots hold the node's), run there or not at all."""
    return _run_copies_function.options(
        num_cpus=0, num_returns=num_returns, max_retries=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    )


@ray.remote
def _run_copies_function(function: str, *args: Any) -> Any:
    # By import path: the driver does not import the worker package (tests/test_layout.py).
    return import_object(f"{STATE_COPIES}:{function}")(*args)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64]
