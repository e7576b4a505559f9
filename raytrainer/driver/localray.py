"""The local Ray that raytrainer starts: its settings, and keeping it up for the next run.

A run given no Ray (no address, no RAY_ADDRESS, no Ray that `ray start` left on this
machine) starts one here. Starting it is most of a run's start-up (several times the
time to connect to a running one: docs/benchmarks.md), so by default the first run leaves it up
and the next runs join it: a keeper process (`python -m raytrainer.driver.localray`, a
session of its own) starts it and holds it, and stops it once no run has used it for
RAYTRAINER_KEEP_RAY minutes (10), or at `raytrainer down`. RAYTRAINER_KEEP_RAY=0 starts
a Ray for each run and stops it at the run's end, as a run joined to nothing did before
(what CI and the test suite use).

Only raytrainer finds the kept Ray: it lives in its own temp dir (state_dir: one per user,
Python and Ray installation, since its workers run the keeper's interpreter), and nothing
records it where Ray looks (`ray start` writes /tmp/ray/ray_current_cluster, which a
plain ray.init() joins; ray.init(address="local") always starts a new one). Nor does it
stand in the way of a Ray the user starts: it takes none of the fixed ports `ray start
--head` takes by default (its dashboard agent runs minimal, with no HTTP server:
_internals.minimal_dashboard_agent), and its keeper works in its own temp
dir, not in the directory of the run that started it (a run's workers work in their run's:
worker/process/actor.py).

A run uses the kept Ray alone: it holds users.lock (flock) for as long as it is connected,
and a run that finds it held starts a Ray of its own, as before, rather than share the
cores with another run. The keeper checks the same lock to tell whether it is idle. The
kept Ray's workers inherit the keeper's environment, so a run passes the variables it
sets differently (PYTHONPATH, CUDA_VISIBLE_DEVICES, ...) as the job's runtime_env
env_vars; a variable the keeper has and the run unset stays set.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ._internals import (answers, bootstrap_address, enable_token_auth, own_process_groups, patient_node_start,
                         quiet_token_auth_notice, started_local_ray)

MALLOC_SETTINGS = {
    # glibc's malloc gives a block over 32 MB back to the kernel as it is freed (mmap), and
    # a thread other than the main one (the one that trains: Ray's) allocates from an arena
    # that cannot hold such a block at all: a large model's gradients and its optimizer's
    # temporaries were fresh memory at every step, page faults that took a fifth of a step of
    # a 2 GB state on CPU (docs/benchmarks.md, "The malloc settings"). One arena, and blocks
    # under 4 GiB from it; and no trim of the heap's free top (glibc's default: over 128 KB
    # goes back to the kernel as it is freed), where a step's temporaries end up when they
    # were the last thing allocated: without it, a 2 GB step still took 92,000-344,000 fresh
    # pages a step (0.96-1.53 s against 0.74-0.75 s with it). Freed memory is kept for the
    # next step.
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": str(4 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(4 << 30),
}
"""The part of RAY_SETTINGS that is glibc's malloc's (the bench sets it apart)."""


RAY_SETTINGS = {
    # Its workers at nice 0, not Ray's 15: the Ray exists for the run's workers, and at
    # nice 15 every other process on a busy machine (the driver, Ray's own daemons,
    # anything else) takes their cores first, while a step waits for its slowest rank.
    "RAY_worker_niceness": "0",
    # No task events (`ray list tasks`, the timeline: nothing raytrainer reads, and no
    # dashboard runs): every control call to a worker made some, kept by the GCS.
    "RAY_task_events_report_interval_ms": "0",
    # No metrics recorded and exported every 10 s by each process, gathered by the
    # dashboard agent every 5 s (nothing scrapes them: no dashboard, no Prometheus). Set it to 1
    # to have the run in Ray's Prometheus (raymetrics.py, docs/tracking.md).
    "RAY_enable_metrics_collection": "0",
    # No timing of every handler of every event loop (Ray's debug stats).
    "RAY_event_stats": "0",
    **MALLOC_SETTINGS,
}
"""What a Ray that raytrainer starts runs with (read from the environment by the processes
it starts); a variable already set in the environment wins. A cluster started with `ray
start` runs with what it was started with: CLUSTER_SETTINGS, set for `ray start`."""

CLUSTER_SETTINGS = {k: v for k, v in RAY_SETTINGS.items() if k != "RAY_enable_metrics_collection"}
"""What the cluster files in cluster/ start every node with: a cluster's Ray keeps its
metrics, as its dashboard and Prometheus are watched there (the run's own series too)."""

KEEPER_SETTINGS = {
    # No idle workers started for the first driver: the keeper is that driver, and it never
    # makes an actor. Ray starts one per CPU as the keeper connects and kills them idle as
    # the first run's workers start, each having imported Ray on the cores that run needs.
    # (A Ray per run keeps them: its first workers are those processes.)
    "RAY_prestart_worker_first_driver": "0",
}
"""What a kept local Ray runs with besides RAY_SETTINGS."""

KEEP_ENV = "RAYTRAINER_KEEP_RAY"
DIR_ENV = "RAYTRAINER_RAY_DIR"
DEFAULT_KEEP_MINUTES = 10.0
START_TIMEOUT_S = 120.0
_NOISE = ("PWD", "OLDPWD", "SHLVL", "_")
"""Variables that differ from shell to shell and mean nothing to a worker."""


def keep_minutes() -> float:
    """RAYTRAINER_KEEP_RAY: the idle minutes after which a kept Ray stops; 0: keep none
    (and none is kept off Linux: the keeper is found through /proc)."""
    text = os.environ.get(KEEP_ENV, "").strip()
    if not sys.platform.startswith("linux"):
        return 0.0
    if not text:
        return DEFAULT_KEEP_MINUTES
    try:
        value = float(text)
    except ValueError:
        from ..errors import ConfigError

        raise ConfigError(f"{KEEP_ENV}={text!r} must be a number of minutes (0: stop the local Ray at the end "
                          "of each run)") from None
    return max(0.0, value)


def state_dir() -> Path:
    """Where the kept Ray lives (RAYTRAINER_RAY_DIR, else one directory under the system temp
    dir per user and installation; short: Ray's sockets go under it)."""
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    import ray

    # The interpreter by its real path (bin/python and bin/python3 of one venv are one), and
    # the environment it runs in (sys.prefix: two venvs of one interpreter are two).
    key = (os.path.realpath(sys.executable), os.path.realpath(sys.prefix), ray.__version__, Path(__file__).resolve())
    digest = hashlib.sha256("\0".join(map(str, key)).encode())
    return Path(tempfile.gettempdir()) / f"{_PREFIX}{os.getuid()}-{digest.hexdigest()[:8]}"


_PREFIX = "raytrainer-"


def kept_dirs() -> list[Path]:
    """The state dirs of every local Ray kept for this user whose keeper is alive: this
    installation's (state_dir) and any other's (another venv, Python or Ray version) under
    the same temp dir."""
    found = {state_dir()} | set(Path(tempfile.gettempdir()).glob(f"{_PREFIX}{os.getuid()}-*"))
    return sorted(folder for folder in found if _keeper(folder) is not None)


@contextlib.contextmanager
def settings() -> Iterator[None]:
    """RAY_SETTINGS in this process's environment (for the processes ray.init starts), and
    the environment as it was after."""
    added = {k: v for k, v in RAY_SETTINGS.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


# ---------------------------------------------------------------------------- the driver's side

@dataclass
class _Hold:
    address: str
    lock: Any  # users.lock, open and flock'ed: released with it
    started: bool  # this run started the keeper
    auth_mode: str | None  # RAY_AUTH_MODE of the kept Ray


_held: _Hold | None = None
_started_here = False  # this process is connected to a Ray that raytrainer started on this machine
connected: str | None = None
"""How this process last connected (connect): "kept, started", "kept, joined", or None."""


def connect(address: str | None = None, **options: Any) -> None:
    """Connect as ray.init() does: `address` or RAY_ADDRESS name a cluster; otherwise a Ray
    that `ray start` left on this machine is joined; otherwise the kept local Ray (started
    now if none is up), unless RAYTRAINER_KEEP_RAY=0, another run is using it, or `options`
    configure a Ray of its own (num_cpus, ...): then a local Ray for this run. A Ray started
    here runs with RAY_SETTINGS."""
    import ray

    global _started_here, connected
    connected = None
    given = "--address" if address else "RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else None
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        _wait_for(address, given)
    joins = None if address else bootstrap_address()  # a live `ray start` head, which ray.init joins
    if address is None and joins is None and not options and keep_minutes() > 0:
        held = _hold_kept()
        if held is not None:
            if held.auth_mode == "token":
                enable_token_auth()
            env = _env_diff(state_dir())
            try:
                ray.init(address=held.address, logging_level="WARNING",
                         runtime_env={"env_vars": env} if env else None)
            except Exception as exc:  # noqa: BLE001 - its Ray is broken: this run starts its own
                release()
                print(f"raytrainer: warning: could not join the local Ray kept at {held.address} "
                      f"({type(exc).__name__}: {exc}); `raytrainer down` stops it. Starting a Ray for this run.",
                      file=sys.stderr)
                return _start_for_this_run("local", options)
            _started_here = True
            connected = "kept, started" if held.started else "kept, joined"
            if held.started:
                print(f"raytrainer: started a local Ray, kept for the next runs: it stops after "
                      f"{keep_minutes():g} idle minutes, or at `raytrainer down` ({KEEP_ENV}=0: a Ray per run)",
                      file=sys.stderr)
            return
    # "local": what None means with no live head, but never a dead head's recorded address.
    _start_for_this_run(address if address or joins else "local", options)


ANSWER_TIMEOUT_S = 30.0
"""How long a Ray named by --address or RAY_ADDRESS gets to answer (a head still starting)."""


def _wait_for(address: str, given: str | None) -> None:
    """A Ray's GCS named by `given` (host:port) answers, or a RaytrainerError that says so:
    ray.init would wait on it for good ("Failed to get cluster ID from GCS", every 30 s).
    Ray Client (ray://), a dashboard's http(s):// and "auto"/"local" are Ray's to resolve."""
    if "://" in address or ":" not in address:
        return
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    while not answers(address):
        if time.monotonic() > deadline:
            from ..errors import RaytrainerError

            fix = ("unset RAY_ADDRESS to train on a local Ray" if given == "RAY_ADDRESS"
                   else "leave --address out to train on a local Ray")
            raise RaytrainerError(
                f"no Ray answers at {address} (from {given}) after {ANSWER_TIMEOUT_S:g} s: start it (`ray start "
                f"--head` on that machine), fix the address (the head's GCS, host:port), or {fix}")
        time.sleep(0.5)


def _start_for_this_run(address: str | None, options: dict[str, Any]) -> None:
    import ray

    # Its processes outside this process's group: a signal to the run's group is the run's
    # to stop on, with a checkpoint, not its Ray's (_internals.py's own_process_groups).
    with settings(), quiet_token_auth_notice(), patient_node_start(), \
            own_process_groups():
        ray.init(address=address, include_dashboard=False, logging_level="WARNING", **options)


def started_here() -> bool:
    """Whether this process is connected to a Ray started on this machine for it (by
    ray.init, here or in the caller's code) or kept by raytrainer: one node, no autoscaler
    to add any."""
    return _started_here or started_local_ray()


def release() -> None:
    """Let the kept Ray go (at the end of a run, once disconnected): it may stop when idle,
    and another run may use it."""
    global _held, _started_here
    if _held is not None:
        _held.lock.close()
        _held = None
    _started_here = False


def _hold_kept() -> _Hold | None:
    """Hold the kept Ray for this run, starting it if none is up; None if another run holds
    it, or it could not be started (then this run starts its own)."""
    global _held
    if _held is not None:
        return _held
    folder = state_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = try_lock(folder / "users.lock", tries=10)
    if lock is None:
        return None
    info = _keeper(folder)
    if info is not None and not answers(info["address"]):
        # Its Ray is gone (`ray stop` ends every Ray process on the machine; its keeper, a
        # driver of it, lives on until Ray ends it a minute later): never joined, which would
        # wait on the dead address for good. A new one is started in its place.
        print(f"raytrainer: the local Ray kept at {info['address']} no longer answers (`ray stop`?); "
              "starting a new one", file=sys.stderr)
        _stop_keeper(folder, info, timeout_s=5.0)
        info = None
    started = info is None
    if started:
        info = _start_keeper(folder, keep_minutes())
        if info is None:
            lock.close()
            return None
    _held = _Hold(info["address"], lock, started, info.get("auth_mode"))
    return _held


def try_lock(path: Path, tries: int = 1) -> Any:
    """The file at `path`, open and exclusively flock'ed, or None if another process holds
    it (`tries` attempts 20 ms apart: the keeper holds it for a moment when it looks). Any
    other OSError (a file system that does not lock) is raised, the file closed."""
    import fcntl

    f = open(path, "a")
    for attempt in range(tries):
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return f
        except BlockingIOError:
            if attempt + 1 < tries:
                time.sleep(0.02)
        except OSError:
            f.close()
            raise
    f.close()
    return None


def _keeper(folder: Path) -> dict[str, Any] | None:
    """keeper.json, if its keeper is alive."""
    try:
        info = json.loads((folder / "keeper.json").read_text())
    except (OSError, ValueError):
        return None
    return info if _is_keeper(info.get("pid"), folder) else None


def _is_keeper(pid: Any, folder: Path) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, TypeError):
        return False
    return b"raytrainer.driver.localray" in cmdline and str(folder).encode() in cmdline


def _start_keeper(folder: Path, minutes: float) -> dict[str, Any] | None:
    import subprocess

    (folder / "keeper.json").unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({k: v for k, v in {**RAY_SETTINGS, **KEEPER_SETTINGS}.items() if k not in env})
    # It works in its folder, not in the user's directory (which it would hold for as long as
    # it lives, and which is no later run's): raytrainer is imported from where this process
    # imports it, which may be that directory (a source checkout, not installed).
    package_parent = str(Path(__file__).resolve().parents[2])
    with open(folder / "keeper.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[3]); "
                                 "from raytrainer.driver.localray import keep; keep(sys.argv[1], float(sys.argv[2]))",
                                 str(folder), str(minutes * 60), package_parent],
                                cwd=folder, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # not stopped with this run's process group
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        info = _keeper(folder)
        if info is not None:
            return info
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    tail = (folder / "keeper.log").read_text(errors="replace")[-4000:]
    print(f"raytrainer: warning: could not start the kept local Ray (see {folder / 'keeper.log'}); starting "
          f"one for this run:\n{tail}", file=sys.stderr)
    return None


def _fingerprint(env: dict[str, str]) -> dict[str, str]:
    return {k: hashlib.sha256(v.encode()).hexdigest()[:16] for k, v in env.items()}


def _env_diff(folder: Path) -> dict[str, str]:
    """The variables of this process's environment that the keeper's (its workers') lacks or
    has otherwise (compared by digest: the keeper records no values)."""
    info = _keeper(folder) or {}
    theirs = info.get("env", {})
    mine = _fingerprint(os.environ)
    return {k: os.environ[k] for k, digest in mine.items()
            if theirs.get(k) != digest and k not in _NOISE and k != "RAY_ADDRESS"}


def up(folder: Path | None = None, minutes: float | None = None) -> str:
    """Start the kept local Ray now, if none is up (`raytrainer up`: the first run then
    joins it too); its address. `folder`: its state_dir; `minutes`: its idle minutes
    (RAYTRAINER_KEEP_RAY)."""
    minutes = keep_minutes() if minutes is None else minutes
    if minutes <= 0:
        from ..errors import ConfigError

        raise ConfigError(f"{KEEP_ENV}=0 (or not Linux): each run starts a Ray of its own and none is kept; "
                          "unset it (or set the idle minutes after which the kept Ray stops)")
    folder = folder or state_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = _keeper(folder) or _start_keeper(folder, minutes)
    if info is None:
        from ..errors import RaytrainerError

        raise RaytrainerError(f"could not start a local Ray (see {folder / 'keeper.log'})")
    return info["address"]


def down(folder: Path | None = None, timeout_s: float = 30.0, force: bool = False) -> tuple[str, bool]:
    """Stop the local Ray kept in `folder`, or every one kept for this user (kept_dirs): its
    keeper, and with it every process of that Ray. One a run is using is left up unless
    `force` (its workers would die, the run losing what it did since its last checkpoint).
    Returns what was done, and whether every one asked for is down."""
    folders = [folder] if folder is not None else kept_dirs()
    done = [_stop(f, timeout_s, force) for f in folders]
    said = "\n".join(line for line, _ in done if line) or "no local Ray kept by raytrainer is running"
    return said, all(stopped for _, stopped in done)


def _stop(folder: Path, timeout_s: float, force: bool) -> tuple[str | None, bool]:
    info = _keeper(folder)
    if info is None:
        return None, True
    # Held while it stops: a run starting meanwhile finds it in use and starts its own Ray.
    users = try_lock(folder / "users.lock", tries=10)
    if users is None and not force:
        return (f"left up the local Ray at {info['address']} ({folder}): a run is using it. Stop that run first "
                "(Ctrl-C: it stops with a checkpoint), or `raytrainer down --force` (the run loses what it did "
                "since its last checkpoint)"), False
    try:
        _stop_keeper(folder, info, timeout_s)
    finally:
        if users is not None:
            users.close()
    return f"stopped the local Ray raytrainer kept ({info['address']}, {folder})", True


def _stop_keeper(folder: Path, info: dict[str, Any], timeout_s: float) -> None:
    pid = info["pid"]
    for sig, grace in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while _is_keeper(pid, folder) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _is_keeper(pid, folder):
            break
    (folder / "keeper.json").unlink(missing_ok=True)


def status() -> str:
    """What is kept for this user, and where (`raytrainer status`): each kept local Ray's
    address, state dir, keeper pid and interpreter, and whether a run uses it or for how long
    it has been idle."""
    lines = []
    for folder in kept_dirs():
        info = _keeper(folder)
        if info is None:  # stopped since kept_dirs looked
            continue
        idle_s, since = info.get("idle_s", 0.0), info.get("idle_since")
        free = try_lock(folder / "users.lock")
        if free is None:
            use = "in use by a run"
        else:
            free.close()
            idle = time.time() - since if since else 0.0
            use = f"idle for {idle / 60:.1f} min, stops after {idle_s / 60:g}"
        lines.append(f"a local Ray kept at {info['address']} ({use})\n  dir {folder}\n  keeper pid {info['pid']}, "
                     f"python {info.get('python', '?')}, up since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(info['started']))}")
    return "\n".join(lines) or f"no local Ray kept by raytrainer is running ({KEEP_ENV}={keep_minutes():g} minutes)"


def node_errors(temp_dir: Path, most: int = 10) -> str:
    """Why a Ray node under `temp_dir` did not start, from its newest session's logs: the
    raylet's and the GCS's error and fatal lines (a failed check among them), and the
    raylet's last line (where it was, if it was only slow). Ray's own exception says only
    that the node timed out during startup."""
    logs = temp_dir / "session_latest" / "logs"
    found, last = [], ""
    for name in ("raylet.out", "raylet.err", "gcs_server.out", "gcs_server.err"):
        try:
            lines = (logs / name).read_text(errors="replace").splitlines()
        except OSError:
            continue
        found += [f"{name}: {line}" for line in lines if _GLOG_ERROR.match(line) or "Check failed" in line]
        if name == "raylet.out" and lines:
            last = f"raylet.out, its last line: {lines[-1]}"
    return "\n".join(found[-most:] + [last]).strip() or f"(no raylet or GCS log in {logs})"


_GLOG_ERROR = re.compile(r"\[\S+ \S+ [EF] \d+ \d+\]")
"""Ray's C++ log lines of severity ERROR or FATAL: `[date time,ms E pid tid] ...`."""


# ---------------------------------------------------------------------------- the keeper

def keep(folder: str | Path, idle_s: float, check_s: float = 2.0) -> None:
    """The keeper process: start a local Ray under `folder`, record its address, and stop it
    once no run has held users.lock for `idle_s` seconds, or on SIGTERM."""
    import threading

    import ray

    folder = Path(folder)
    mine = try_lock(folder / "keeper.lock")
    if mine is None:
        return  # another keeper of this folder is starting or up
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with settings(), quiet_token_auth_notice(), patient_node_start():
            ray.init(address="local", _temp_dir=str(folder / "ray"), include_dashboard=False,
                     logging_level="WARNING", log_to_driver=False)
    except Exception:  # into keeper.log, which the run prints: why, where Ray says "timed out"
        print(node_errors(folder / "ray"), file=sys.stderr, flush=True)
        raise
    try:
        # Ray turns token authentication on for a local Ray where a token exists (setting
        # RAY_AUTH_MODE here): a run connecting must then present it too.
        info = {"pid": os.getpid(), "address": ray.get_runtime_context().gcs_address, "started": time.time(),
                "auth_mode": os.environ.get("RAY_AUTH_MODE"), "env": _fingerprint(os.environ),
                "python": sys.executable, "idle_s": idle_s, "idle_since": time.time()}

        def record(**changes: Any) -> None:  # keeper.json, whole or not at all
            info.update(changes)
            tmp = folder / "keeper.json.tmp"
            tmp.write_text(json.dumps(info))
            os.replace(tmp, folder / "keeper.json")

        record()
        idle_since = time.monotonic()  # until the run that started it connects
        while not stop.wait(check_s):
            free = try_lock(folder / "users.lock")
            if free is None:
                if idle_since is not None:
                    idle_since = None
                    record(idle_since=None)
                continue
            free.close()
            if idle_since is None:
                idle_since = time.monotonic()
                record(idle_since=time.time())
            if time.monotonic() - idle_since >= idle_s:
                break
    finally:
        (folder / "keeper.json").unlink(missing_ok=True)
        ray.shutdown()


