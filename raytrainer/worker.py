"""One training process: builds the task itself, joins the process group, runs the loop.

A plain class; group.py makes it a Ray actor (with a second thread, so the
driver can drain metrics while `run` trains).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import traceback
from typing import Any

from .callbacks import Callbacks
from .config import load_config
from .errors import RaytrainerError, WorkerError
from .task import build_task

# torch is imported inside the methods: the driver imports this module to create
# the actors and should not pay for importing torch before its first step.


class Worker:
    def __init__(self, config: dict[str, Any]):
        # Import torch now, on every actor in parallel, not on the first call.
        from . import loop  # noqa: F401

        self.config = load_config(config)
        self.rank: int | None = None
        self.loop = None
        self._rows: list[dict[str, Any]] = []
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def node(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {
            "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "node_id": ctx.get_node_id(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }

    def sees_file(self, path: str) -> bool:
        """Whether this worker's node sees `path` (the shared-storage check at start)."""
        import os

        return os.path.exists(path)

    def rendezvous(self) -> tuple[str, int]:
        """Address for the process group's store; asked of rank 0 only."""
        from .dist import free_port

        return self.node()["ip"], free_port()

    def setup(self, rank: int, world_size: int, addr: str, port: int, use_gpu: bool,
              resume: bytes | None = None) -> dict[str, int]:
        """Join the group, build the task, and load `resume` (checkpoint bytes) if given."""
        import io

        import torch

        from .checkpoint import Checkpoints, Storage
        from .dist import choose_backend, choose_device, init_group
        from .loop import Loop

        self.rank = rank
        cfg = self.config
        with _as_worker_error(self):
            device = choose_device(use_gpu)
            task = build_task(cfg.task.target, cfg.task.args)
            init_group(rank, world_size, addr, port, choose_backend(cfg.scaling.backend, use_gpu))
            callbacks = Callbacks.build(cfg.callbacks, on_driver=False)
            checkpoints = Checkpoints(Storage(cfg.run.storage), cfg.run.name, cfg.checkpoint) if rank == 0 else None
            self.loop = Loop(task, cfg.trainer, rank=rank, world_size=world_size, device=device,
                             report=self._push, callbacks=callbacks, checkpoints=checkpoints,
                             checkpoint_cfg=cfg.checkpoint, notify=self._notify)
            if resume is not None:
                self.loop.load_state_dict(torch.load(io.BytesIO(resume), weights_only=True))
            return {"total_steps": self.loop.total_steps, "steps_per_epoch": self.loop.plan.steps_per_epoch}

    def run(self) -> dict[str, Any]:
        """Train to the end; rank 0 also returns the final weights as torch.save bytes."""
        import io

        import torch

        from .dist import destroy_group

        try:
            with _as_worker_error(self):
                weights = self.loop.fit()
        finally:
            destroy_group()
        result = {"stop_reason": self.loop.stop_reason, "model": None}
        if weights is not None:
            buffer = io.BytesIO()
            torch.save(weights, buffer)
            result["model"] = buffer.getvalue()
        return result

    def drain(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Metric rows and lifecycle events since the last drain (rank 0 holds the
        reduced rows and writes the checkpoints)."""
        with self._lock:
            rows, self._rows = self._rows, []
            events, self._events = self._events, []
        return rows, events

    def _push(self, rows: list[dict[str, Any]]) -> None:
        with self._lock:
            self._rows.extend(rows)

    def _notify(self, event: dict[str, Any]) -> None:
        with self._lock:  # also called from the checkpoint writer thread
            self._events.append({**event, "rank": self.rank})


@contextlib.contextmanager
def _as_worker_error(worker: Worker):
    """Our own errors pass through (their messages name the fix); anything else
    becomes a WorkerError carrying the rank, the step and the worker's traceback."""
    try:
        yield
    except RaytrainerError:
        raise
    except Exception as exc:
        loop = worker.loop
        raise WorkerError(
            worker.rank if worker.rank is not None else -1,
            f"{type(exc).__name__}: {exc}",
            traceback.format_exc(),
            step=loop.step + 1 if loop else None,
        ) from None
