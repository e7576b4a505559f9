"""A worker process kept for the next run of the same driver (driver/group/kept.py).

A worker's process costs more to start than a short run costs to train: importing torch,
torch._dynamo (which every optimizer step imports) and Ray's worker are CPU-seconds each
process, most of a short run's CPU (docs/results/2026-11-29-kept-worker-processes.md). A run that finished hands its processes back instead of having them killed,
and the next run in that driver process takes them: its workers' start is then the
build of its task.

Only a process that can be seen to hold nothing of the run it served is kept (`release`):
no process group (not even one aborted after a failure), no thread or child process the
run started, torch's global settings as they were, no environment variable changed but
the group's own. The next run takes it only where no code it imported has changed since
(`renew`): a module of the user's (one outside the interpreter's own directories) edited,
or a run launched from another directory (where an import by the same name may find
another file), gets a fresh process instead.
"""

from __future__ import annotations

import gc
import os
import sys
import sysconfig
import threading
from typing import Any, Callable

# What a group sets in this process's environment (dist.py, userloop.py): rewritten by
# every group, never a reason not to keep it.
GROUP_VARIABLES = {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                   "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}

_baseline: dict[str, Any] = {}


def note_start() -> None:
    """What this process was like before its first run: its threads, its environment, the
    torch settings a task may change (called once torch is imported, before any task is
    built)."""
    if not _baseline:
        _baseline.update(threads={t.ident for t in threading.enumerate()}, environ=dict(os.environ),
                         torch=_torch_settings())


def release(forget: Callable[[], None]) -> str | None:
    """Once the run's resources are closed (Worker.release): None if the process is fit for
    another run, else why not. `forget` drops the run's objects (the Worker's fields) before
    the collection that frees them."""
    from .. import dist

    if not _baseline:
        return "it never imported torch"
    if dist.groups_left():
        return "a process group is left"
    if "ray.data" in sys.modules:  # its coordinator actors belong to this process, and live with it
        return "Ray Data ran here"
    from ..loop.compiling import compiled_for_a_run

    if compiled_for_a_run():
        return "it compiled for its run (torch keeps that run's compile cache for the process's life)"
    forget()
    gc.collect()
    _trim()
    why = _left_over()
    if why is None:
        _baseline["stamps"] = _module_stamps()
        _baseline["cwd"] = os.getcwd()
    return why


def renewable(cwd: str | None) -> str | None:
    """None if a run launched from `cwd` may take this process, else why not."""
    if "stamps" not in _baseline:
        return "it was not released"
    if cwd and os.path.realpath(cwd) != os.path.realpath(_baseline["cwd"]):
        return "the run starts from another directory"
    if _module_stamps(_baseline["stamps"]) != _baseline["stamps"]:
        return "code it imported has changed"
    del _baseline["stamps"]
    return None


def _trim() -> None:
    """Give the run's freed memory back to the system: a kept process waiting for a run
    holds what torch itself needs, not the last model's size (glibc keeps freed memory
    under the malloc settings a Ray raytrainer starts runs with: localray.MALLOC_SETTINGS)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _left_over() -> str | None:
    # Not Ray's own threads (its executor's, a concurrency group's), which Python sees as
    # "dummy" threads once they run Python code: they serve every run alike.
    threads = [t.name for t in threading.enumerate() if t.ident not in _baseline["threads"] and t.is_alive()
               and not isinstance(t, threading._DummyThread)]
    if threads:
        return f"threads left running: {threads}"
    if children := _children():
        return f"child processes left running: {children}"
    if _torch_settings() != _baseline["torch"]:
        return "torch's global settings changed"
    changed = {k for k in set(os.environ) | set(_baseline["environ"])
               if os.environ.get(k) != _baseline["environ"].get(k)} - GROUP_VARIABLES
    if changed:
        return f"environment variables changed: {sorted(changed)}"
    return None


def _children() -> list[int]:
    """This process's child processes, less multiprocessing's fork server and resource
    tracker (each kept for the process's life, whatever runs in it)."""
    found = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                found += [int(pid) for pid in f.read().split()]
        except OSError:
            continue
    return [pid for pid in found if not _is_multiprocessing_helper(pid)]


def _is_multiprocessing_helper(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read()
    except OSError:
        return False
    return any(f"from multiprocessing.{m} import main".encode() in command for m in ("forkserver", "resource_tracker"))


def _torch_settings() -> tuple[Any, ...]:
    import torch

    return (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(), torch.is_grad_enabled(),
            torch.is_anomaly_enabled(), torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return tuple(os.path.realpath(d) + os.sep for d in dirs | {sys.prefix, sys.base_prefix})


def _module_stamps(previous: dict[str, float] | None = None) -> dict[str, float]:
    """The modification time of each file of a module imported from outside the
    interpreter's own directories (the user's code, an editable install); with `previous`,
    those files' times now (a file gone: -1)."""
    if previous is not None:
        out = {}
        for path in previous:
            try:
                out[path] = os.stat(path).st_mtime
            except OSError:
                out[path] = -1.0
        return out
    libraries = _library_dirs()
    stamps = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path:
            continue
        path = os.path.realpath(path)
        if path.startswith(libraries):
            continue
        try:
            stamps[path] = os.stat(path).st_mtime
        except OSError:
            continue
    return stamps
