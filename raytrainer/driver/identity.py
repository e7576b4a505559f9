"""Which run a command continues: the run's identity, kept in its run directory.

A scheduler reruns the same command after its driver died (a SLURM requeue, a RayJob
retry under `backoffLimit`, `ray job submit` again, a person pressing up-arrow after an
OOM kill). With the default `run.name` (`<stem>-<UTC time>`) each of those would be a new
run from step 0, beside the unfinished one. So a run without a `run.name` records what
identifies it (`identity.json`), and the next command with the same identity continues the
newest such run that did not finish. The identity is the scheduler's own where there is
one (a SLURM job and array task keep their id through a requeue; `RAYTRAINER_RUN_ID` for
any other, e.g. a RayJob's name set in its manifest), together with the resolved config
but for `run.name` and `run.resume` (a relative `run.storage` resolved against the launch
directory): two different configs never share a run, and a new SLURM job of the same
script is a new run.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint import Storage
from ..config import Config

FILE = "identity.json"
RUN_ID_ENV = "RAYTRAINER_RUN_ID"
ENDS = ("finished", "failed", "stopped")


@dataclass(frozen=True)
class Identity:
    key: str
    """A digest of the scheduler's id and the config: what a rerun must match."""
    source: str
    """What the key stands for, in words: `the config`, `SLURM job 123_4 and the config`."""

    def record(self) -> bytes:
        return json.dumps({"key": self.key, "source": self.source}).encode()


def of(config: Config, environ: Mapping[str, str] = os.environ) -> Identity:
    """The identity of a run of `config` started in this environment."""
    scheduler = scheduler_id(environ)
    settings = config.to_dict()
    # Not the directory it runs from: a relative run.storage carries it already, and a job
    # whose --working-dir Ray unpacks under its session's directory runs from another one
    # on every cluster (a RayJob's retry).
    settings["run"] = {k: v for k, v in settings["run"].items() if k not in ("name", "resume")}
    text = json.dumps([scheduler, settings], sort_keys=True, default=str)
    source = f"{scheduler} and the config" if scheduler else "the config"
    return Identity(hashlib.sha256(text.encode()).hexdigest()[:24], source)


def scheduler_id(environ: Mapping[str, str]) -> str | None:
    """The id the scheduler keeps through a rerun of the same job, if any."""
    if environ.get(RUN_ID_ENV):
        return f"{RUN_ID_ENV}={environ[RUN_ID_ENV]}"
    if environ.get("SLURM_JOB_ID"):
        # An array task has a job id of its own too, but the array's and its index are what
        # the docs and the user's script name.
        array, index = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
        return f"SLURM job {array}_{index}" if array and index else f"SLURM job {environ['SLURM_JOB_ID']}"
    return None


@dataclass(frozen=True)
class Previous:
    """The newest earlier run with the same identity."""

    name: str
    ended: str | None
    """How its last attempt ended: "finished", "failed", "stopped", or None (no end
    recorded: its driver was lost)."""
    how: str
    """The same in words, for the line the run starts with."""


def find(storage: Storage, stem: str, identity: Identity) -> Previous | None:
    """The newest run directory named `<stem>-...` (the default names) under `storage` whose
    identity is `identity`, with how its last attempt ended."""
    for name in sorted(storage.list_dirs(""), reverse=True):  # <stem>-<UTC time>: newest first
        if not name.startswith(f"{stem}-"):
            continue
        try:
            recorded = json.loads(storage.read(f"{name}/{FILE}"))
        except (OSError, ValueError):
            continue
        if recorded.get("key") == identity.key:
            return Previous(name, *last_end(_events(storage, name)))
    return None


def _events(storage: Storage, name: str) -> list[dict[str, Any]]:
    try:
        return parse_events(storage.read(f"{name}/events.jsonl").decode(errors="replace"))
    except OSError:
        return []


def events_of(path: Path) -> list[dict[str, Any]]:
    try:
        return parse_events(path.read_text(errors="replace"))
    except OSError:
        return []


def parse_events(text: str) -> list[dict[str, Any]]:
    events = []
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:  # a line cut short by the driver's death
            continue
    return events


def last_end(events: list[dict[str, Any]]) -> tuple[str | None, str]:
    """How the last attempt of a run ended, from its events: (the end event, in words)."""
    last = max((i for i, e in enumerate(events) if e.get("event") == "run_started"), default=0)
    attempt = events[last:]
    end = next((e for e in reversed(attempt) if e.get("event") in ENDS), None)
    if end is None:
        steps = [e["step"] for e in attempt if isinstance(e.get("step"), int)]
        return None, f"its driver was lost{f' near step {max(steps)}' if steps else ''}, with no end recorded"
    step = end.get("step")
    if end["event"] == "finished":
        return "finished", f"finished at step {step}"
    if end["event"] == "stopped":
        return "stopped", f"stopped by {end.get('signal', 'a signal')} at step {step}"
    cause = str(end.get("cause", "")).splitlines()[0] if end.get("cause") else end.get("error", "")
    return "failed", f"failed at step {step}: {cause[:160]}"
