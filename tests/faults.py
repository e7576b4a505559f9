"""Faults from outside, as a cluster produces them: a run trains in a thread while the test
kills, freezes or removes what it runs on, by process id (from the run's events)."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import raytrainer

from .waits import join, wait_until


class Run:
    """raytrainer.train(config) in a thread; `result()` waits for it (and raises its error)."""

    def __init__(self, config, **kwargs):
        self.run_dir = Path(config["run"]["storage"]) / config["run"]["name"]
        self._result = self._error = None
        self._thread = threading.Thread(target=self._main, args=(config,), kwargs=kwargs, daemon=True)
        self._thread.start()

    def _main(self, config, **kwargs):
        try:
            self._result = raytrainer.train(config, **{"progress": False, **kwargs})
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self._error = exc

    def result(self, timeout: float = 300.0):
        """The run's result once it ended, within `timeout` seconds of a quiet machine (waits.py)."""
        join(self._thread, timeout)
        assert not self._thread.is_alive(), f"the run did not end within {timeout:g} s (of a quiet machine)"
        if self._error is not None:
            raise self._error
        return self._result

    def events(self) -> list[dict]:
        return _read(self.run_dir / "events.jsonl")

    def wait_for_step(self, step: int, timeout: float = 120.0) -> None:
        """Until a training row at or after `step` is in metrics.jsonl."""
        wait_until(lambda: any(r["step"] >= step for r in _read(self.run_dir / "metrics.jsonl") if "loss" in r),
                   f"step {step}", timeout, alive=self._thread.is_alive)

    def wait_for_worker_step(self, prefix: str | Path, step: int, timeout: float = 120.0) -> None:
        """Until a worker has trained `step` micro-batches, as its task writes them (the
        RegressionTask's `steps_to=prefix`): the workers' own progress, where metrics.jsonl
        trails them by the driver's lag (3.6 s in a CI run: all of a short run's steps could
        be done before a kill meant for its middle)."""
        prefix = Path(prefix)

        def trained():
            counts = [p.read_text() for p in prefix.parent.glob(prefix.name + "*")]
            return any(c.strip().isdigit() and int(c) >= step for c in counts)

        wait_until(trained, f"a worker at micro-batch {step}", timeout, every_s=0.01, alive=self._thread.is_alive)

    def rows(self) -> list[dict]:
        return _read(self.run_dir / "metrics.jsonl")

    def wait_for(self, ready, what: str, timeout: float = 120.0) -> None:
        """Until `ready()` is true."""
        wait_until(ready, what, timeout, every_s=0.1, alive=self._thread.is_alive)

    def pids(self) -> list[int]:
        """The workers' process ids by rank, as of the newest group_formed, recovered or
        resized event ([] before the group formed)."""
        return next((e["pids"] for e in reversed(self.events()) if "pids" in e), [])


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def kill(pid: int) -> None:
    signal_pid(pid, signal.SIGKILL)


def freeze(pid: int) -> None:
    signal_pid(pid, signal.SIGSTOP)


def _read(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]
