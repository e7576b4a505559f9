"""Fail at start, not at the first checkpoint, when workers cannot see run.storage.

A local path on the driver's node is fine while every worker runs there too; once
workers live on other nodes they must reach the run directory through shared
storage. The driver drops a marker file into the run directory and asks every
worker whether it sees it: a plain file test, so it holds for NFS, bind mounts
or whatever makes the path shared, and fails for a node-local disk.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Callable

from ..contract import Node

from ..errors import ConfigError


def check_shared_storage(run_dir: Path, storage: str, nodes: list[Node], driver_node_id: str,
                         sees: Callable[[str], list[bool]]) -> dict[str, Any] | None:
    """Raise ConfigError unless every worker sees `run_dir`. `nodes[rank]` is rank's node
    info (node_id, ip); `sees(path)` answers, per rank, whether that worker sees the file.

    Returns what was checked, or None when all workers share the driver's node (the
    driver's own file system then is theirs)."""
    if all(n.node_id == driver_node_id for n in nodes):
        return None
    marker = Path(run_dir).resolve() / f".raytrainer-storage-check-{uuid.uuid4().hex}"
    marker.write_text("raytrainer checks that every worker sees the run directory\n")
    try:
        seen = sees(str(marker))  # absolute: workers' working directories differ from ours
    finally:
        marker.unlink(missing_ok=True)
    blind = [rank for rank, ok in enumerate(seen) if not ok]
    if blind:
        where = ", ".join(f"rank {r} on {nodes[r].ip} ({(nodes[r].node_id or '?')[:8]})" for r in blind)
        raise ConfigError(
            f"run.storage={storage!r} is not shared: the run directory {str(run_dir)!r} written by "
            f"the driver is not visible to {where}. Workers on several nodes need storage every "
            "node sees at the same path: set run.storage to a shared file system path (e.g. an "
            "NFS mount present on every node) or to a URI every node reaches (s3://, gs://, abfs://, ...)"
        )
    return {"nodes": len({n.node_id for n in nodes}), "workers": len(nodes)}
