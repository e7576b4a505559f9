"""The way out of a run that a signal stopped, bounded where Ray is gone.

Once the stop's checkpoint is committed (the `stopped` event), what is left is letting Ray
go: shutting the worker group down (actors, placement groups), ray.shutdown, the kept Ray's
release. Each of those asks Ray's GCS; where the GCS died beside the run (a signal to a
whole process group or container, `ray stop`, its node lost), each waits on it, and 60 s
after it died Ray ends this process itself ("Failed to connect to GCS within 60 seconds"),
with status 1 and without the line that says how to continue. The run's work is safe by
then; the process only has to say so and exit as the signal asks.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from ..errors import Stopped
from ._internals import answers

GRACE_S = 5.0
"""How long the way out may take before it is checked for a GCS that is gone."""


class StopExit:
    """Armed by the `stopped` event (an EventLog listener), disarmed once the run has let
    Ray go. Armed, it waits GRACE_S; then, while the run is still on its way out and the
    GCS at `gcs_address` refuses connections, it prints what the CLI prints for a stop (the
    stop, and how to continue) and exits at once with the signal's status (128 + signal).
    While the GCS answers it waits on: the way out is slow, not stuck on Ray."""

    def __init__(self, gcs_address: str | None, run_dir: str, config: str | None = None,
                 grace_s: float = GRACE_S):
        self.gcs_address, self.run_dir, self.config, self.grace_s = gcs_address, run_dir, config, grace_s
        self._done = threading.Event()

    def event(self, record: dict[str, Any]) -> None:
        if record["event"] != "stopped" or self.gcs_address is None or self._done.is_set():
            return
        import signal

        stopped = Stopped(signal.Signals[record["signal"]], record["step"], record.get("checkpoint"),
                          record.get("checkpoint_step"), self.run_dir)
        threading.Thread(target=self._watch, args=(stopped,), name="raytrainer-stop-exit", daemon=True).start()

    def disarm(self) -> None:
        self._done.set()

    def _watch(self, stopped: Stopped) -> None:
        while not self._done.wait(self.grace_s):
            if answers(self.gcs_address):
                continue
            try:
                print(f"\nraytrainer: {stopped}", file=sys.stderr)
                print(f"raytrainer: Ray's GCS at {self.gcs_address} is gone (stopped beside the run?): exiting "
                      "without waiting on it", file=sys.stderr)
                if (command := stopped.how_to_continue(self.config)) is not None:
                    print(f"raytrainer: continue with: {command}", file=sys.stderr)
                sys.stderr.flush()
                sys.stdout.flush()
            finally:
                os._exit(128 + stopped.signum)


def gcs_address() -> str | None:
    """The GCS address of the Ray this process is connected to; None where it has none to
    give (a Ray Client connection)."""
    import ray

    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - then no way out is forced
        return None
