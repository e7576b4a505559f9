"""`raytrainer.train(...)`: the one entry point behind the CLI and the Python API."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import itertools
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .. import filesystems
from ..callbacks import Callback, Callbacks, RunContext
from ..checkpoint import Checkpoints, Storage, find_checkpoint_dir
from ..config import Config, dump_config, load_config, resolve_paths
from ..config.taskargs import annotations_of, typed_args
from ..contract import Resume
from . import identity as identities, ledger, localray, stopexit
from .controller import Controller, ControllerSettings, Records
from ..errors import ConfigError, Stopped, warn
from ..task import describe
from .loggers import build_loggers
from .metrics import EventLog, JsonlWriter, MetricsHub, ProgressBar, RunInfo, SinkStates
from .raymetrics import RayMetricsSink


@dataclass
class Result:
    run_dir: Path
    metrics: dict[str, Any]
    """The latest value of every metric (last training step and last validation)."""
    history: list[dict[str, Any]] = field(repr=False)
    """Every row written to metrics.jsonl, in order."""
    events: list[dict[str, Any]] = field(repr=False)


def train(config: str | Path | dict[str, Any] | Config, overrides: Iterable[str] = (), *,
          address: str | None = None, progress: bool = True, callbacks: Iterable[Any] = ()) -> Result:
    """Train the task a config describes; return its metrics and run directory.

    The task is named by import path (task.target), or given as a Python object: a
    raytrainer.Task class or instance, `{"task": MyTask(lr=0.1), ...}`, which is shipped
    to the workers by value where they cannot import it (see task.describe); a loop
    function runs as raytrainer.train_loop's does.

    Uses the Ray this process is connected to; otherwise connects to `address`
    (or $RAY_ADDRESS), or a Ray started on this machine with `ray start`; otherwise the
    local Ray raytrainer keeps for the next runs, started now if none is up, and left up
    after the run (`raytrainer down` stops it; RAYTRAINER_KEEP_RAY=0: a local Ray for this
    run only, stopped after it). See init_ray and driver/localray.py.
    `callbacks` are driver-side Callback objects, added to those the config names.
    """
    import ray

    launched = time.time()  # the goodput ledger's start: Ray's start and the loading count as starting
    stem, source = None, config
    if not isinstance(config, Config):
        config, payload, stem = _by_value(config)
        config = load_config(config, overrides)
        config.task.payload = payload
        if payload is not None:  # the config could not read its source: the object's own annotations
            config.task.args = typed_args(config.task.args, annotations_of(_task_object(source)),
                                          config.task.annotated)
    elif overrides:
        raise ConfigError("overrides apply to a YAML path or a dict, not to a built Config")
    if config.task.by_value and config.task.payload is None:
        raise ConfigError(
            f"task.by_value: this config records a task passed as a Python object ({config.task.by_value}), "
            "which a YAML file cannot carry; run it from Python, passing the same object again, e.g. "
            "raytrainer.train({..., 'task': MyTask(...), 'run': {'name': NAME, 'storage': STORAGE}}) "
            "(run.resume: auto continues a run from its newest checkpoint)"
        )
    resolve_paths(config, os.getcwd())
    storage = Storage(config.run.storage)
    identity = None
    if config.run.name is None:
        stem = stem or config.task.path.partition(":")[0].rsplit(".", 1)[-1]  # a module's: examples.digits -> digits
        identity = identities.of(config)
        previous = _continued(config, storage, stem, identity) if config.run.resume == "auto" else None
        config.run.name = previous or _new_name(storage, stem)
    name = config.run.name
    lock, shown = lock_of(storage, name)
    with _held(lock, shown):
        run_dir = lock.parent if storage.local else _local_mirror(storage, name)
        # Its workers may wait for a new driver (failure.driver_grace_s), taken over where the run
        # continues from where it is (auto), never where it must start afresh or from a given checkpoint.
        lost = config.run.resume == "auto" and _driver_lost(run_dir)
        resume = None if lost else _find_resume(config, storage, run_dir)
        connected_here = not ray.is_initialized()
        if connected_here:
            init_ray(address)
        # A stop's way out does not wait on a GCS that died beside the run (stopexit.py).
        way_out = stopexit.StopExit(stopexit.gcs_address(), shown,
                                    str(source) if isinstance(source, (str, Path)) else None)
        try:
            takeover = None
            if lost:
                from .group import orphans

                takeover = orphans.find(config, shown)
                if takeover is None:
                    resume = _find_resume(config, storage, run_dir, from_scratch=identity is not None)
            _say_which(shown, run_dir, resume, takeover)
            if identity is not None:
                _record_identity(storage, name, run_dir, identity)
            return _run(config, storage, run_dir, resume, progress=progress, takeover=takeover, launched=launched,
                        cluster_can_grow=not localray.started_here(), callbacks=list(callbacks),
                        listeners=[way_out.event])
        finally:
            try:
                if connected_here:
                    ray.shutdown()
                    localray.release()  # a kept Ray may serve another run now
            finally:
                way_out.disarm()


def release(run_dir: str, *, address: str | None = None) -> str:
    """End at once the workers a lost driver of the run in `run_dir` left waiting for a new
    one (failure.driver_grace_s), and remove the run's placement groups; what was done."""
    import ray

    shown = run_dir.rstrip("/") if "://" in run_dir else str(Path(run_dir).resolve())
    storage, name = filesystems.split(shown)
    connected_here = not ray.is_initialized()
    if connected_here:
        init_ray(address)
    try:
        from .group import orphans

        ended = orphans.release(storage or "/", name)
    finally:
        if connected_here:
            ray.shutdown()
            localray.release()
    return f"ended {ended} worker(s) of {shown} and removed its placement groups"


def train_loop(fn: Any, config: str | Path | dict[str, Any] | None = None, overrides: Iterable[str] = (), *,
               args: dict[str, Any] | None = None, address: str | None = None, progress: bool = True,
               callbacks: Iterable[Any] = ()) -> Result:
    """Run your own training loop, `fn(ctx, **args)`, on every worker with the process group
    formed, and return what train() returns. `config` is train()'s without a task section
    (a YAML path or a dict; trainer, scaling, failure, checkpoint, run, loggers). `ctx`
    (worker.userloop.userloop.LoopContext) gives the rank, world size, local rank, device, the step
    and epoch to start from, and `ctx.report(metrics, state=..., checkpoint=...)`; after a
    failure fn runs again with `ctx.state` from a survivor's memory. The function is
    shipped to the workers by value where they cannot import it by name."""
    raw = _raw(config)
    if "task" in raw:
        raise ConfigError("train_loop(fn, config): the config has a task section too; fn is what runs on the "
                          "workers: remove the task section (or call raytrainer.train with it)")
    raw["task"] = {"loop": fn, "args": dict(args or {})}
    return train(raw, overrides, address=address, progress=progress, callbacks=callbacks)


def _raw(config: str | Path | dict[str, Any] | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config)
    import yaml

    path = Path(config)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    return yaml.safe_load(path.read_text()) or {}


def _by_value(config: str | Path | dict[str, Any]) -> tuple[Any, bytes | None, str | None]:
    """A config dict whose task is a Python object (a class, an instance, a function; or
    target/loop given as one) with its task section as a YAML config would name it, the
    object pickled where the workers cannot import it, and its class or function name
    (run.name's default). The pickle rides on the Config (task.payload), not in its dict:
    config.yaml records what it was."""
    task = config.get("task") if isinstance(config, dict) else None
    if task is None or (isinstance(task, dict) and all(isinstance(task.get(k), (str, type(None)))
                                                       for k in ("target", "loop"))):
        return config, None, None
    if isinstance(task, dict):
        unknown = sorted(set(task) - {"target", "loop", "args"})
        if unknown or ("target" in task) == ("loop" in task):
            raise ConfigError("task: give a Python object as {'target': TaskClass, 'args': {...}} or "
                              "{'loop': function, 'args': {...}}" + (f"; unknown keys {unknown}" if unknown else ""))
        obj, args = task.get("target", task.get("loop")), task.get("args") or {}
    else:
        obj, args = task, {}
    section, payload = describe(obj, args)
    if isinstance(task, dict) and ("loop" in task) != ("loop" in section):
        key = "loop" if "loop" in task else "target"
        raise ConfigError(f"task.{key}: {obj!r} is not a {'function' if key == 'loop' else 'raytrainer.Task'}")
    name = section.get("target", section.get("loop")).rpartition(":")[2].rsplit(".", 1)[-1]
    return {**config, "task": section}, payload, name.strip("<>")


def _task_object(config: dict[str, Any]) -> Any:
    """The task or loop passed as a Python object in a config dict (see _by_value)."""
    task = config["task"]
    return task.get("target", task.get("loop")) if isinstance(task, dict) else task


def init_ray(address: str | None = None, **options: Any) -> None:
    """Connect as ray.init() does: `address` or RAY_ADDRESS name a cluster; otherwise a Ray
    started on this machine with `ray start` is joined; otherwise the local Ray raytrainer
    keeps for the next runs, started now if none is up; or a local one for this run
    (RAYTRAINER_KEEP_RAY=0, or `options` configure it). See localray.py."""
    localray.connect(address, **options)


def resolve_use_gpu(scaling: Any, gpus: float, *, can_grow: bool, warn: Any = None) -> bool:
    """Whether the workers take GPUs (scaling.use_gpu, auto: where the cluster has some),
    checked against the cluster's GPUs before any worker starts: GPUs asked of a cluster
    that has none and cannot gain any, or NCCL without GPUs, are config errors."""
    use_gpu = gpus > 0 if scaling.use_gpu == "auto" else scaling.use_gpu
    if use_gpu and not gpus:
        if not can_grow:
            raise ConfigError(
                "scaling.use_gpu=true but there is no GPU in this Ray cluster (it has none, and a local Ray "
                "started for this run cannot gain any); set scaling.use_gpu: false (or auto) to train on CPUs, "
                "or connect to a cluster with GPUs (--address or RAY_ADDRESS)"
            )
        if warn is not None:
            warn(f"scaling.use_gpu=true but the cluster has no GPU now; waiting up to "
                 f"scaling.placement_timeout_s={scaling.placement_timeout_s:g} for nodes with GPUs to join")
    if scaling.backend == "nccl" and not use_gpu:
        why = "scaling.use_gpu is false" if scaling.use_gpu is False else "the cluster has no GPU (scaling.use_gpu: auto)"
        raise ConfigError(
            f"scaling.backend=nccl runs on GPUs only, but {why}; set scaling.backend: gloo (or auto, which "
            "picks NCCL on GPUs and Gloo on CPUs)"
        )
    return use_gpu


def _continued(config: Config, storage: Storage, stem: str, identity: identities.Identity) -> str | None:
    """The name of the run this one continues: the newest run of the same identity
    (identity.py) that did not finish, has a checkpoint to continue from, and that no other
    process holds; None for a new run, saying why where there was such a run."""
    previous = identities.find(storage, stem, identity)
    if previous is None:
        return None
    lock, shown = lock_of(storage, previous.name)
    if previous.ended == "finished":
        _say(f"the last run of this config, {shown}, {previous.how}: starting a new run")
        return None
    if previous.ended is not None and Checkpoints(storage, previous.name, config.checkpoint).newest() is None:
        _say(f"the last run of this config, {shown}, {previous.how}, with no checkpoint to continue from: "
             "starting a new run")
        return None
    with contextlib.suppress(ImportError, OSError):
        held = localray.try_lock(lock)
        if held is None:
            _say(f"the last run of this config, {shown}, is in use by another process ({lock.read_text().strip()}): "
                 "starting a new run")
            return None
        held.close()
    return previous.name


def lock_of(storage: Storage, name: str) -> tuple[Path, str]:
    """The file that holds run `name` for one process (_held), and the run directory as shown."""
    if storage.local:
        return Path(storage.root) / name / ".lock", str(Path(storage.root) / name)
    return _mirror_dir(storage, name).with_name(f"{name}.lock"), storage.uri_of(name)


def _say_which(shown: str, run_dir: Path, resume: Resume | None, takeover: Any) -> None:
    """The run's first line: a new run, or which one it continues, where, from what, and how
    that one's last attempt ended."""
    events = identities.events_of(run_dir / "events.jsonl")
    if not events:
        _say(f"new run {shown}")
        return
    how = identities.last_end(events)[1]
    if takeover is not None:
        _say(f"continuing {shown} at step {takeover.step} from its {len(takeover.actors)} workers' memory "
             f"(its last attempt: {how})")
    elif resume is not None:
        _say(f"continuing {shown} at step {resume[0]} from checkpoint {resume[1]} (its last attempt: {how})")
    else:
        _say(f"continuing {shown} from step 0: no checkpoint and no worker was left (its last attempt: {how})")


def _driver_lost(run_dir: Path) -> bool:
    """Whether the run's last attempt has no end recorded: its driver died, and its workers
    may be waiting for a new one (failure.driver_grace_s)."""
    events = identities.events_of(run_dir / "events.jsonl")
    return bool(events) and identities.last_end(events)[0] is None


def _record_identity(storage: Storage, name: str, run_dir: Path, identity: identities.Identity) -> None:
    """What the next run of the same identity finds this one by (identity.find)."""
    if (run_dir / identities.FILE).exists():
        return
    (run_dir / identities.FILE).write_bytes(identity.record())
    if not storage.local:  # found there by the next run, before this one's logs are uploaded
        storage.write(f"{name}/{identities.FILE}", identity.record())


def _say(line: str) -> None:
    print(f"raytrainer: {line}", file=sys.stderr, flush=True)


def _new_name(storage: Storage, stem: str) -> str:
    """The default run.name, `<stem>-<UTC time>`; on local storage one whose directory this
    run makes (mkdir: atomic), so that runs started within the same second (a sweep, a
    script) get one each: `-2`, `-3`, ... after the second."""
    base = f"{stem}-" + datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    if not storage.local:
        return base
    for n in itertools.count(1):
        name = base if n == 1 else f"{base}-{n}"
        try:
            (Path(storage.root) / name).mkdir(parents=True)
            return name
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _held(lock: Path, shown: str):
    """The run directory `shown` held by this process for the whole run: an exclusive lock
    on `lock` (the run directory's `.lock` on local storage, shared file systems included
    where they lock; beside the local mirror for remote storage). A second run of the same
    run.name would write the same checkpoints and logs: it fails, naming the holder. A run
    directory this left holding nothing but its lock (a run that failed before writing
    anything) is removed."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    try:
        file = localray.try_lock(lock)
    except (ImportError, OSError):  # not POSIX, or a file system that does not lock (some NFS mounts)
        file = False  # unguarded
    if file is None:
        holder = lock.read_text().strip() or "another process"
        raise ConfigError(
            f"run directory {shown!r} is in use by another run ({holder}); two runs would write the "
            "same checkpoints and logs: let that one end (Ctrl-C there stops it with a checkpoint), or choose "
            "another run.name (e.g. --set run.name=NEW)")
    if file:
        file.truncate(0)
        file.write(f"pid {os.getpid()} on {socket.gethostname()}, since "
                   f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}\n")
        file.flush()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if lock.name == ".lock" and os.listdir(lock.parent) == [lock.name]:
                shutil.rmtree(lock.parent)
        if file:
            file.close()


def _mirror_dir(storage: Storage, name: str) -> Path:
    digest = hashlib.sha256(storage.uri.encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / "raytrainer" / digest / name


def _local_mirror(storage: Storage, name: str) -> Path:
    """The driver writes its files (logs, TensorBoard, model.pt) locally; for remote storage
    into this mirror, refreshed from the storage and uploaded back as the run goes."""
    mirror = _mirror_dir(storage, name)
    shutil.rmtree(mirror, ignore_errors=True)
    mirror.mkdir(parents=True)
    for file in ("config.yaml", "metrics.jsonl", "events.jsonl", SinkStates.FILE):  # a resumed run appends
        if storage.exists(f"{name}/{file}"):
            (mirror / file).write_bytes(storage.read(f"{name}/{file}"))
    return mirror


def _find_resume(config: Config, storage: Storage, run_dir: Path, from_scratch: bool = False) -> Resume | None:
    """The checkpoint to start from, per run.resume. `from_scratch`: a run found by its
    identity, whose driver was lost before any checkpoint and left no worker, starts over
    in its directory (an explicit run.name with nothing to resume from is an error)."""
    mode = config.run.resume
    if mode not in ("auto", "never"):
        try:
            ref = find_checkpoint_dir(mode)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"run.resume={mode!r}: {exc}") from None
        return ref.step, mode, ref
    found = _latest(config, storage) if mode == "auto" else None
    if found is not None or from_scratch:
        return found
    if (run_dir / "metrics.jsonl").exists() or Checkpoints(storage, config.run.name, config.checkpoint).committed():
        why = ("already holds a run but no committed checkpoint to resume from" if mode == "auto"
               else "already holds a run and run.resume=never")
        raise ConfigError(
            f"run directory {str(run_dir)!r} {why}; choose another run.name "
            "(e.g. --set run.name=NEW) or remove that directory"
        )
    return None


def _latest(config: Config, storage: Storage, before: int | None = None) -> Resume | None:
    """The newest committed checkpoint of the run (before step `before`, if given), by its
    manifest: to resume from, or restart from when no worker survived. The workers read it."""
    ref = Checkpoints(storage, config.run.name, config.checkpoint).newest(before)
    return (ref.step, ref.name, ref) if ref else None


def _warn(message: str) -> None:
    warn(message, stacklevel=3)  # once: the CLI shows it as a plain line


@contextlib.contextmanager
def _stop_on_signals(controller: Controller):
    """The first SIGINT, SIGTERM or SIGHUP asks the run to stop at the next step boundary
    with a checkpoint there (the controller raises Stopped once it is committed); a second
    one aborts at once (KeyboardInterrupt: the workers are killed on the way out). Ray's own
    SIGTERM handler (sys.exit, set by ray.init) comes back after the run. Only where
    signals can be handled: the main thread.

    SIGHUP is the terminal gone (an SSH session dropped, a window closed): every write to
    it fails from then on, so the driver's output goes to /dev/null; events.jsonl records
    the stop."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if controller.stop_signal is not None:
            raise KeyboardInterrupt
        controller.request_stop(signum)
        if signum == getattr(signal, "SIGHUP", None):
            null = os.open(os.devnull, os.O_WRONLY)
            for fd in (1, 2):  # C-level writes too (Ray's logging)
                os.dup2(null, fd)
            os.close(null)
            return
        print(f"\nraytrainer: {signal.Signals(signum).name}: stopping at the next step boundary with a checkpoint "
              "there; press Ctrl-C again to abort at once", file=sys.stderr, flush=True)

    signals = [signal.SIGINT, signal.SIGTERM]
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # nohup's stays
        signals.append(signal.SIGHUP)
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class _CheckpointArtifacts(Callback):
    """Hands each committed checkpoint (on local storage) to the loggers, which upload it
    where they are set to (log_checkpoints)."""

    def __init__(self, hub: MetricsHub):
        self.hub = hub

    def on_checkpoint(self, ctx, path):
        self.hub.artifact(Path(path), "checkpoint")


class _UploadLogs(Callback):
    """Copies the driver's files to remote storage at each checkpoint and at the end."""

    def __init__(self, storage: Storage, run_dir: Path, name: str):
        self.storage, self.run_dir, self.name = storage, run_dir, name

    def on_checkpoint(self, ctx, path):
        try:
            self.upload()
        except OSError as exc:  # the storage failed right after a commit: the next one uploads again
            _warn(f"uploading the run's logs to {self.storage.uri_of(self.name)} failed ({exc}); "
                  f"they stay in {self.run_dir} and the next checkpoint uploads them again")

    def upload(self) -> None:
        for path in sorted(self.run_dir.iterdir()):
            if path.is_file() and not path.name.endswith(".tmp"):
                self.storage.write(f"{self.name}/{path.name}", path.read_bytes())

    def final_upload(self) -> None:
        """At the end, failed runs included: tried again for about a minute; the logs are
        never lost (the local mirror stays), so a failure here only warns."""
        from ..checkpoint import with_retries

        try:
            with_retries(self.upload, "the run's logs", self.storage.uri_of(self.name),
                         lambda: f"They are kept in {self.run_dir}")
        except Exception as exc:  # noqa: BLE001 - the run's own outcome stands
            _warn(str(exc).replace("the run trained to its end, but ", ""))


# The events after which the run's goodput has moved enough to publish it again.
GOODPUT_MOVES = frozenset({"group_formed", "recovered", "resized", "left_node", "slow_worker_replaced",
                           "checkpoint_committed", "validated", "finished", "failed", "stopped"})


def _goodput_series(sink: RayMetricsSink, events: EventLog, hub: MetricsHub) -> Any:
    """A listener that publishes this attempt's goodput (its ledger so far, from what the
    driver holds in memory) as Ray's raytrainer_goodput series, where Ray's metrics are on.
    It runs inside the controller's event log: whatever goes wrong in it is a warning, once,
    and the series stops, never the run."""
    def publish(record: dict[str, Any]) -> None:
        if not (sink.on and record["event"] in GOODPUT_MOVES) or failed:
            return
        try:
            sink.gauge("goodput", ledger.ledger(events.events, hub.history).goodput)
        except Exception as exc:  # noqa: BLE001 - a figure for a dashboard, not the run
            failed.append(exc)
            _warn(f"the goodput series stops: its ledger failed ({type(exc).__name__}: {exc})")
    failed: list[Exception] = []
    return publish


def _write_ledger(run_dir: Path) -> None:
    """goodput.json, failed and stopped runs included. It runs on the way out of every run:
    whatever goes wrong (a full disk, an event it cannot read) only warns, so the run's own
    outcome, its error included, stands."""
    try:
        ledger.write(run_dir)
    except Exception as exc:  # noqa: BLE001 - the run's outcome stands
        _warn(f"the goodput ledger could not be written to {run_dir} ({type(exc).__name__}: {exc})")


def _run(config: Config, storage: Storage, run_dir: Path, resume: Resume | None, *,
         progress: bool, cluster_can_grow: bool, callbacks: list[Any], takeover: Any = None,
         listeners: Iterable[Any] = (), launched: float | None = None) -> Result:
    import ray

    from .group import RayWorkerGroup

    use_gpu = resolve_use_gpu(config.scaling, ray.cluster_resources().get("GPU", 0), can_grow=cluster_can_grow,
                              warn=_warn)
    if isinstance(config.task.payload, bytes):  # into the object store once; every worker's constructor reads it
        config.task.payload = ray.put(config.task.payload)

    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "config.yaml").exists():  # a resumed run keeps the config it began with
        (run_dir / "config.yaml").write_text(dump_config(config))
    own_callbacks = Callbacks.build(config.callbacks, on_driver=True).callbacks  # config errors first,
    loggers = build_loggers(config.loggers, warn=_warn)  # then nothing started yet needs stopping
    events = EventLog(run_dir / "events.jsonl")
    bar = ProgressBar() if progress else None
    # Ray's metrics: on wherever the joined Ray exports them (raymetrics.py), else a no-op.
    raymetrics = RayMetricsSink()
    sinks = [JsonlWriter(run_dir / "metrics.jsonl")] + ([bar] if bar else []) + [raymetrics] + loggers
    hub = MetricsHub(sinks, RunInfo(run_dir, config.run.name, config.to_dict(),
                                    resumed=resume is not None or takeover is not None,
                                    states=SinkStates(run_dir)))
    events.listeners += [hub.event, *listeners, _goodput_series(raymetrics, events, hub)]
    upload = None if storage.local else _UploadLogs(storage, run_dir, config.run.name)
    try:
        # The shared-storage check applies to a local run.storage; remote storage is
        # reached by every worker through its URI.
        group = RayWorkerGroup(config, use_gpu, cluster_can_grow=cluster_can_grow,
                               run_dir=run_dir if storage.local else None)
        driver_callbacks = Callbacks(own_callbacks + callbacks + ([upload] if upload else [])
                                     + ([_CheckpointArtifacts(hub)] if storage.local else []))
        records = Records(hub=hub, events=events, progress=bar, callbacks=driver_callbacks,
                          context=RunContext(run_dir, config))
        settings = dataclasses.replace(ControllerSettings.of(config), launched=launched)
        controller = Controller(group, settings, records, resume=resume, takeover=takeover,
                                restore=lambda before=None: _latest(config, storage, before))
        try:
            with _stop_on_signals(controller):
                result = controller.run()
        except Stopped as exc:
            exc.run_dir = str(run_dir) if storage.local else storage.uri_of(config.run.name)
            raise
        # Rank 0 wrote model.pt to the run's storage: the loggers get its path (a local
        # one; on remote storage they would have to fetch the weights through this process).
        if storage.local and result.model_uri is not None:
            hub.artifact(Path(result.model_uri), "model")
    finally:
        hub.close()
        events.close()
        _write_ledger(run_dir)
        if upload:
            upload.final_upload()
    return Result(run_dir=run_dir, metrics=dict(hub.latest), history=hub.history, events=events.events)
