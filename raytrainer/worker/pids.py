"""Whether a process still runs on this machine: what the control channel's kill reports,
what a scratch sweep keeps a folder for, and what a loader process lives as long as."""

from __future__ import annotations


def running(pid: int) -> bool:
    """Whether process `pid` runs on this machine, stopped (SIGSTOP) or not; a zombie (killed,
    not yet reaped by its parent) does not."""
    import os
    from pathlib import Path

    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        if os.path.isdir("/proc/self"):
            return False
    try:  # no /proc (macOS): whether a signal could reach it
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process
    return True
