"""Worker processes kept from a finished run for the next run of this driver process.

A short run's workers cost more to start than to train (worker/process/keeping.py;
docs/results/2026-11-29-kept-worker-processes.md).
A run that finished hands its CPU workers' processes (and its spares') back here instead
of killing them; the next run's workers and spares on the same node take them, each made
a fresh Worker of that run (`renew`), before any new process is started. What a process
must be to be kept, and when it is not taken, is worker/process/keeping.py's.

Kept processes hold no resources (a CPU worker runs pinned to its slot's node, beside the
slot's placement group, which holds the slot's resources: actors.start_worker). They go
when the driver process ends (Ray ends the actors a driver made), when its Ray is shut
down, and otherwise after KEEP_S unused (RAYTRAINER_KEEP_WORKERS): a script's last run
leaves nothing beyond that.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any, Callable

import ray

from ...errors import ConfigError
from .._internals import draining_nodes

log = logging.getLogger(__name__)

KEEP_S = 60.0
"""How long a kept process waits for a run to take it before it is ended, unless
RAYTRAINER_KEEP_WORKERS says (seconds; 0: keep none)."""


def keep_s() -> float:
    value = os.environ.get("RAYTRAINER_KEEP_WORKERS", "")
    try:
        return max(0.0, float(value)) if value.strip() else KEEP_S
    except ValueError:
        raise ConfigError(f"RAYTRAINER_KEEP_WORKERS={value!r} must be a number of seconds "
                          "(0: no worker process kept between runs)") from None


RELEASE_S = 10.0
"""How long a finished run waits for its workers to say whether they can be kept (the
run returns after it: a worker that has not answered is killed)."""

RENEW_S = 30.0
"""How long a kept process gets to answer that it is taken (else a fresh one starts)."""

_lock = threading.Lock()
_kept: list[tuple[Any, str, float]] = []  # (actor, node id, kept until)
_session: list[str] = [""]  # the Ray job the kept actors belong to
_timer: list[threading.Timer | None] = [None]


def _job() -> str:
    return ray.get_runtime_context().get_job_id() if ray.is_initialized() else ""


def keep(actors_on: list[tuple[Any, str]], alive_nodes: Callable[[], set[str]]) -> None:
    """Release each (actor, node id) of a finished run and keep those fit for another;
    kill the others. All released at once: one round trip, not one per actor.
    `alive_nodes`: the ids of the nodes Ray holds alive (actors.alive_nodes)."""
    seconds = keep_s()
    if not seconds:
        for actor, _ in actors_on:
            _end(actor)
        return
    if actors_on:  # not on a node being drained, which ends only once nothing runs there
        ok = alive_nodes() - set(draining_nodes())
        for actor, _ in [(a, n) for a, n in actors_on if n not in ok]:
            _end(actor)
        actors_on = [(a, n) for a, n in actors_on if n in ok]
    if not actors_on:
        return
    refs = [actor.release.remote() for actor, _ in actors_on]
    ray.wait(refs, num_returns=len(refs), timeout=RELEASE_S)
    until = time.monotonic() + seconds
    fit = []
    for (actor, node), ref in zip(actors_on, refs):
        try:
            why = ray.get(ref, timeout=0)
        except Exception:  # noqa: BLE001 (dead, or not answering: not kept)
            why = "no answer"
        if why is None:
            fit.append((actor, node, until))
        else:
            log.debug("a worker process not kept: %s", why)
            _end(actor)
    with _lock:
        if _session[0] != _job():
            _forget()
            _session[0] = _job()
        _kept.extend(fit)
        _arm()


def take(node_id: str, config: dict[str, Any], payload: Any, **kwargs: Any) -> Any | None:
    """A kept process on `node_id` made a fresh Worker of this run (Worker.renew), or None."""
    while True:
        with _lock:
            if _session[0] != _job():
                _forget()
                return None
            found = next((k for k in _kept if k[1] == node_id), None)
            if found is None:
                return None
            _kept.remove(found)
        actor = found[0]
        try:
            why = ray.get(actor.renew.remote(config, payload, **kwargs), timeout=RENEW_S)
        except Exception:  # noqa: BLE001 (gone with its node, or not answering)
            why = "no answer"
        if why is None:
            return actor
        _end(actor)


def kept_actors() -> list[Any]:
    """The kept processes' actors (tests tell them from actors a run left behind)."""
    with _lock:
        return [k[0] for k in _kept] if _session[0] == _job() else []


def end_all() -> None:
    """End every kept process now."""
    with _lock:
        for actor, _, _ in _kept:
            _end(actor)
        _kept.clear()
        _arm()


def _forget() -> None:
    """The kept actors of a Ray this process left: gone with it."""
    _kept.clear()


def _arm() -> None:
    """End the processes kept past their time, checked once the first of them is due."""
    if _timer[0] is not None:
        _timer[0].cancel()
        _timer[0] = None
    if not _kept:
        return
    due = max(0.0, min(k[2] for k in _kept) - time.monotonic()) + 0.1
    _timer[0] = timer = threading.Timer(due, _expire)
    timer.daemon = True
    timer.start()


def _expire() -> None:
    with _lock:
        _timer[0] = None
        now = time.monotonic()
        if _session[0] == _job():
            for kept in [k for k in _kept if k[2] <= now]:
                _kept.remove(kept)
                _end(kept[0])
        else:
            _forget()
        _arm()


def _end(actor: Any) -> None:
    with contextlib.suppress(Exception):
        ray.kill(actor, no_restart=True)
