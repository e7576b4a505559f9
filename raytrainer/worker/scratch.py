"""ctx.scratch_dir: a folder on the worker's local disk for your loop's own files (a Hugging
Face Trainer's output_dir, a framework's checkpoint to resume from).

Each is its worker's alone, named by the worker's pid and node, under
`<tempdir>/raytrainer-scratch/`, and removed when fn ends, however it ends. A worker killed
from outside cannot remove its own: the next worker on that node that asks for a scratch
folder removes every folder whose process is gone (a replacement, the next run's workers).
A Trainer's checkpoints left by each kill (a real model's, each the size of its state) would
otherwise fill the node's temp disk run after run.

A worker's multiprocessing sockets (its loader processes' fork server, loaders.loader_context)
are made in such a folder too, for the same reason."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

from .pids import running

ROOT = "raytrainer-scratch"


def make() -> Path:
    """A new scratch folder for this process, once the folders of processes gone from this
    node are removed."""
    root = Path(tempfile.gettempdir()) / ROOT
    root.mkdir(exist_ok=True)
    host = socket.gethostname()
    sweep(root, host)
    return Path(tempfile.mkdtemp(prefix=f"{os.getpid()}@{host}.", dir=root))


class Folder:
    """One scratch folder, made when first asked for (`path`) and removed by `remove`: your
    loop's ctx.scratch_dir, which the UserLoop that hands it to ctx removes when fn ends."""

    def __init__(self):
        self._path: Path | None = None

    @property
    def path(self) -> Path:
        if self._path is None:
            self._path = make()
        return self._path

    def remove(self) -> None:
        """Remove it, if it was made (the loop's own files: what it keeps it has committed)."""
        if self._path is not None:
            shutil.rmtree(self._path, ignore_errors=True)


def sweep(root: Path, host: str) -> list[Path]:
    """Remove the folders under `root` of this node's processes that are gone; the removed."""
    removed = []
    for entry in root.iterdir():
        pid, at, rest = entry.name.partition("@")
        if not (at and pid.isdigit() and rest.startswith(f"{host}.")) or running(int(pid)):
            continue  # another node's (a shared temp dir), or a process still running
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed
