"""One training process: builds the task itself, joins the process group, runs the loop.

A plain class; driver/group/actors.py makes it a Ray actor with two concurrency groups: the default
one (one thread: setup, run, regroup, get_state, one at a time) and "control" (status,
drain, stacks, pause, abort), which answers the driver while `run` trains or is
blocked in a collective.

When a peer fails, `run` returns "interrupted" instead of raising: the process,
its model and its optimizer stay, at the last step this worker completed, ready
for the driver to re-form the group (`regroup`) and copy state (`get_state`).
Asked to make room for more workers (`request_pause`), `run` returns "paused" at a
step boundary that every rank agrees on, ready for the same.

What a group's forming shares between setup and regroup is in forming.py, what setup builds
on it in building.py, and what the control calls answer in control.py.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import sys
import threading
import traceback
from typing import Any

from ... import filesystems
from ...checkpoint import CheckpointRef, read_checkpoint
from ...config import load_config
from ...contract import (CopiedState, Holdings, Node, Orphan, RunEnd, Reshard, Snapshot, Status,
                        placement_group_prefix, run_key)
from ...errors import PeerFailure, RaytrainerError, WorkerError
from ...task import build_task
from . import building, control, keeping, orphan
from ..loop.compiling import remove_run_cache, use_run_cache
from ..state.copies import LoneCopy
from .forming import Forming, load, resolve
from .warm import adopt

# torch is imported inside the methods: the driver imports this module to create
# the actors and should not pay for importing torch before its first step.


class Worker:
    def __init__(self, config: dict[str, Any], payload: bytes | None = None, spare: bool = False,
                 warm: bool = False, cwd: str | None = None):
        # Work where the user ran the run from (`cwd`: the driver's), so that a relative path
        # in the task's code (a dataset file) means what it means in the user's shell; this
        # process otherwise works where its Ray was started (a kept local Ray's keeper, `ray
        # start`), or on another node that lacks the directory, in its Ray's.
        if cwd and os.path.isdir(cwd):
            os.chdir(cwd)
        # Import torch now, on every actor in parallel, not on the first call; and
        # torch._dynamo, which every optimizer imports as it is built (torch wraps
        # Optimizer.add_param_group in torch._disable_dynamo): about a second, paid
        # here while a warm spare or a newcomer waits idle, not in the pause of a recovery
        # or a grow. A worker that will join a running group (`warm`: a replacement, a
        # newcomer; a spare) also builds the task's model and optimizer (warm.py). A
        # warm spare does both on a thread of the lowest priority (see _WarmUp): it starts
        # while training runs, on the workers' cores.
        self.config = load_config(config)
        self.config.task.payload = payload  # a task or loop passed by value: unpickled at each setup
        # A new driver of the run takes this worker over where its driver dies (orphan.py).
        # Started before the imports take the process's baseline (keeping.note_start): it
        # serves every run this process trains in.
        self._driver = orphan.watch_driver(self, self.config.failure.driver_grace_s)
        use_run_cache(self.config)  # trainer.compile: compiled graphs shared with the run's workers here
        self._warm_up = _WarmUp(self.config if warm or spare else None, spare=spare,
                                compiles=self.config if self.config.trainer.compile is not None else None)
        self.rank: int | None = None
        self.loop = None
        # Kept across the groups this process trains in: a survivor goes back to its own
        # snapshot after the group it was taken in is gone (snapshot.py; sharded state).
        self._snapshots: Any = None
        self._copy = LoneCopy(lambda: self.rank)  # in shared memory, while this worker is the state's only holder
        self._backend = "gloo"
        self._run_thread: int | None = None  # the thread that trains, for status()
        self._forming = Forming()
        self._outbox = control.Outbox()

    @property
    def snapshots(self):
        if self._snapshots is None:
            self._warm_up.wait()
            from ..state.snapshot import PeerSnapshots

            self._snapshots = PeerSnapshots(self.config.failure.snapshot_every_n_steps)
        return self._snapshots

    def node(self) -> Node:
        """Where this worker runs; answered once it has imported what training needs (a warm
        spare answers when it is ready to take a lost worker's place)."""
        import os

        import ray

        self._warm_up.wait()
        return Node(ip=ray.util.get_node_ip_address(), hostname=socket.gethostname(),
                    node_id=ray.get_runtime_context().get_node_id(), pid=os.getpid(),
                    gpu_ids=tuple(str(g) for g in ray.get_gpu_ids()))

    def warm_node(self) -> Node:
        """node(), answered once this worker has also built its training state ahead and
        warmed its node's object store (warm.py): a newcomer is taken into the group then,
        so that the grow's pause holds none of it."""
        self._warm_up.wait(self._warm_up.warmed)
        return self.node()

    def built(self) -> bool:
        """Whether this worker has built its training state ahead (warm.py), or has none to
        build: a warm spare that has takes a lost worker's place with no build left in the
        recovery. Answered at once (a control call), building or not."""
        return self._warm_up.built.is_set()

    def sees_file(self, path: str) -> bool:
        """Whether this worker's node sees `path` (the shared-storage check at start)."""
        import os

        return os.path.exists(path)

    def rendezvous(self) -> tuple[str, int]:
        """Host the next process group's store; its address. Asked of rank 0 only, before
        any rank is asked to join."""
        self._warm_up.wait()
        from ..dist import host_store

        ip = self.node().ip
        return ip, host_store(ip, self.config.failure.collective_timeout_s)

    def read_checkpoint(self, ref: CheckpointRef) -> tuple[str | None, bytes | str | None]:
        """A checkpoint's state, checked against its manifest here, where it is read (see
        the contract): (None, state) or (why it is corrupt, None)."""
        try:
            return None, read_checkpoint(ref)
        except (OSError, ValueError) as exc:
            return str(exc), None

    def setup(self, rank: int, world_size: int, addr: str, port: int, use_gpu: bool,
              resume: bytes | str | Snapshot | Reshard | CopiedState | None = None) -> tuple[int | None, int, bool]:
        """Join the group, build the task, and load `resume` if given: a torch.save'd state
        (a state.pt checkpoint), a survivor's state (packed, or its copy on this node), the URI of a sharded checkpoint's
        directory, a peer snapshot (without data: this worker's own), or every rank's
        snapshots of another world size to re-shard from (reshard.py). A worker that
        trained in an earlier group starts over in this one. Returns (total steps, steps
        per epoch, whether the state is replicated)."""
        self._forming.note_working()
        self._warm_up.wait()
        from ..dist import choose_backend, choose_device, use_worker_cpus

        self.rank = rank
        cfg = self.config
        if self.loop is not None:  # its process group is gone; its loader processes go too
            self.loop.close_inputs()
            self.loop = None
        with _as_worker_error(self), self._forming.marked():
            resume = resolve(resume, self._own_snapshot)
            if not use_gpu:  # a spare taking over was made with none
                use_worker_cpus(cfg.scaling.resources_per_worker)
            device = choose_device(use_gpu)
            self._backend = choose_backend(cfg.scaling.backend, use_gpu)
            prebuilt = adopt(self._warm_up.take(), resume, device)  # the model and optimizer, built ahead
            task = prebuilt.task if prebuilt is not None else build_task(cfg.task, cfg.task.payload)
            self._forming.join(rank, world_size, addr, port, self._backend, cfg.failure.collective_timeout_s)
            outlets = building.outlets(cfg, report=self._outbox.push, notify=self._notify,
                                       chaos_claim=self._chaos_claim, snapshots=self.snapshots)
            self.loop = building.build_loop(cfg, self.node().node_id, task, outlets, rank, world_size, device,
                                            load(resume, building.copied_on_load(cfg)), prebuilt)
            return self.loop.total_steps, self.loop.steps_per_epoch, self.loop.replicated

    def run(self) -> RunEnd:
        """Train to the end ("finished"; rank 0 writes the final weights to model.pt and
        returns its path), or stop at the last completed step when a peer failed ("interrupted") or
        when asked to ("paused"); raise WorkerError when this worker's own code did."""
        import time

        from ..dist import leave_group
        from ..loop.handover import save_model

        self._run_thread = threading.get_ident()
        self._forming.note_working()
        try:
            weights = self.loop.fit()
        except Exception as exc:
            leave_group(failed=True)  # abort: destroying blocks while a peer still waits in a collective
            interrupted = _peer_failure(exc)
            error = None if interrupted else _worker_error(self, exc)
            self.loop.abandon_step()
            if error is not None:
                raise error from None
            return RunEnd("interrupted", self.loop.step, self.loop.after_pending,
                          cause=f"{type(exc).__name__}: {exc}")
        finally:
            self._run_thread = None
            self.snapshots.close()  # kept as they are until the next group
        leave_group()
        if self.loop.paused:
            return RunEnd("paused", self.loop.step, time=time.time())
        remove_run_cache(self.config)  # nothing continues a finished run
        return RunEnd("finished", self.loop.step, stop_reason=self.loop.stop_reason,
                      model_uri=save_model(self.loop, self.config.run, weights) if weights is not None else None)

    def release(self) -> str | None:
        """After a run that finished: let go of what it made here; None where this process
        may serve the driver's next run (keeping.py), else why not (it is killed then)."""
        try:
            if self.loop is not None:
                self.loop.close_inputs()
                self.loop.saver.close()
            if self._snapshots is not None:
                self._snapshots.close()
            self._copy.remove()
        except Exception as exc:  # noqa: BLE001 (anything: the process is not kept)
            return f"the run's resources did not close: {type(exc).__name__}: {exc}"
        return keeping.release(self.__dict__.clear)

    def renew(self, config: dict[str, Any], payload: bytes | None = None, spare: bool = False,
              warm: bool = False, cwd: str | None = None) -> str | None:
        """A released process taken by a new run: a fresh Worker of that run here (as if
        made with these arguments); None, or why it cannot be (it is killed then)."""
        why = keeping.renewable(cwd)
        if why is None:
            self.__init__(config, payload, spare=spare, warm=warm, cwd=cwd)
        return why

    # ------------------------------------------------------------------ control (answered while run() trains)

    def status(self) -> Status:
        """Progress for the driver's hang check. The phase is "collective" where the loop
        waits for its peers, or where the training thread is anywhere inside
        torch.distributed (a collective in DDP's forward, or in the task's own code)."""
        return control.status(self.loop, self._forming, self._run_thread)

    def request_pause(self) -> None:
        """Pause `run` at the next step boundary all ranks agree on."""
        if self.loop is not None:
            self.loop.pause_requested = True

    def orphan(self) -> Orphan:
        """What this worker holds, for a new driver that may take it over (orphan.py)."""
        import ray

        if "config" not in self.__dict__:  # released for the next run: nothing of one here
            return Orphan(run="", rank=None, world_size=None, step=0, paused=False, orphaned=False)
        loop, run = self.loop, self.config.run
        idle = self._run_thread is None
        return Orphan(run=run_key(run.storage, run.name) if run.name else "", rank=self.rank,
                      world_size=loop.world_size if loop else None, step=loop.step if loop else 0,
                      paused=bool(loop is not None and idle and loop.paused),
                      orphaned=self._driver is not None and self._driver.orphaned,
                      replicated=loop.replicated if loop else True,
                      total_steps=loop.total_steps if loop else None,
                      steps_per_epoch=loop.steps_per_epoch if loop else None,
                      node=self.node() if loop else None,
                      placement_group=ray.get_runtime_context().get_placement_group_id(),
                      where=filesystems.join(run.storage, run.name))

    def adopt(self, job_id: str) -> bool:
        """Taken over by the driver of Ray job `job_id` (orphan.py)."""
        return self._driver is not None and self._driver.adopt(job_id)

    def holds_state(self) -> bool:
        """Whether this worker holds a training state, for a new driver to take over (orphan.py)."""
        return self.__dict__.get("loop") is not None

    def placement_group_prefix(self) -> str | None:
        """Its run's placement groups are named with this (orphan.py); None where this process
        holds nothing of a run (released for the next)."""
        if "config" not in self.__dict__ or not self.config.run.name:
            return None
        return placement_group_prefix(self.config.run.storage, self.config.run.name)

    def dump_stacks(self) -> str:
        """Every thread's Python stack, for a worker about to be killed as hung."""
        return control.stacks()

    def flight_record(self) -> bytes | None:
        """torch's flight recorder of this process's collectives (JSON), if it kept one."""
        from ..dist import flight_record

        return flight_record()

    def abort(self) -> bool:
        """Abort this worker's NCCL communicators: a collective blocked on a lost peer then
        raises now instead of at the collective timeout. (Gloo needs nothing: a collective
        fails as soon as a peer's sockets close.)"""
        from ..dist import abort_group

        return abort_group()

    def kill_process(self, pid: int) -> bool:
        """SIGKILL a process on this node: a frozen peer, which Ray itself kills only after
        a grace period (see driver.group.RayWorkerGroup.kill). Whether it was still running."""
        return control.kill(pid)

    # ------------------------------------------------------------------ recovery (while run() is not running)

    def get_state(self) -> tuple[int, Any]:
        """This worker's training state, for workers that lost or lack theirs, and its size
        (see the contract: the driver waits for the size, never for the state). Packed
        (transfer.py): Ray copies each tensor's bytes once into its object store."""
        from ..state.transfer import pack

        packed = pack(self.loop.state_dict())
        return packed.nbytes, packed

    def keep_copy(self, prefix: str | None, secured: int | None = None) -> None:
        """Keep a copy of the state in this node's shared memory, named `prefix`, at every
        step boundary from now on (this worker is the state's only holder: copies.py);
        None: stop, and remove it. `secured`: the step whose state the driver holds in the
        object store already, not copied again."""
        self._copy.keep(self.loop, prefix, secured)

    def copy_now(self, prefix: str) -> int | None:
        """keep_copy(prefix), with a copy of the step this worker is at in the files now:
        the re-form that leaves it the state's only holder waits for it (the state's second
        copy), and workers on this node may take the state from it. Returns that step; None
        where it cannot be written (warned of: the driver secures the state in the object
        store instead)."""
        return self._copy.now(self.loop, prefix)

    def snapshots_held(self) -> Holdings:
        """The peer snapshots this worker holds (sharded state), for a recovery."""
        return self.snapshots.holdings()

    def peer_snapshot(self, step: int) -> tuple[int, Snapshot]:
        """Its copy of rank - 1's snapshot of `step`, for that rank's replacement, after the
        step alone (two return values: the driver checks the small one and leaves the copy
        in the object store)."""
        copy = self.snapshots.peer_snapshot(step)
        return copy.step, copy

    def own_snapshot(self, step: int) -> tuple[int, Snapshot]:
        """Its own snapshot of `step`, for the workers that re-shard from every rank's
        (two return values, as peer_snapshot)."""
        own = self.snapshots.own_snapshot(step)
        return own.step, own

    def regroup(self, rank: int, world_size: int, addr: str, port: int,
                state: Any = None) -> int:
        """Join a re-formed process group as `rank`, first taking `state` if given;
        return the step it will continue after."""
        self._forming.note_working()
        with _as_worker_error(self), self._forming.marked():
            if state is not None:  # first: should the group fail to form, this state is kept
                self.loop.load_state_dict(load(resolve(state, self._own_snapshot), building.copied_on_load(self.config)))
            self._copy.pause(self.loop)  # a second holder is back (the driver says so again later)
            self._forming.join(rank, world_size, addr, port, self._backend, self.config.failure.collective_timeout_s)
            self.rank = rank
            self.loop.regroup(rank, world_size)
            return self.loop.step

    def save_paused(self) -> int:
        """After run() returned "paused" for a stop (a signal to the driver): commit a
        checkpoint of the step it paused at, and wait for it to be written; return that
        step. Replicated state: rank 0 writes, with no collective (the group is left).
        Sharded state was saved as it paused (a no-op here)."""
        self.loop.save_checkpoint(wait=True)
        return self.loop.step

    # ------------------------------------------------------------------ helpers

    def _chaos_claim(self, fault: int, step: int) -> bool:
        """Once per run across processes: the first claim of (fault, step) in Ray's KV store."""
        from .. import _internals

        run = self.config.run
        return _internals.kv_put_if_absent(f"raytrainer-chaos/{run.storage}/{run.name}/{fault}/{step}", b"1")

    def drain(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Metric rows and lifecycle events since the last drain (rank 0 holds the
        reduced rows and writes the checkpoints)."""
        return self._outbox.drain()

    def _own_snapshot(self, step: int) -> Snapshot:
        """This worker's own peer snapshot of `step` (forming.resolve asks for it by step)."""
        return self.snapshots.own_snapshot(step)

    def _notify(self, event: dict[str, Any]) -> None:
        self._outbox.notify({**event, "rank": self.rank})


class _WarmUp:
    """torch, torch._dynamo and the loop's modules imported in this process, and for a
    worker that will join a running group (`config` given) the task's training state built
    ahead and its node's object store warmed (warm.py). A worker imports at once; a warm
    spare imports on a background thread at nice 19, whose CPU goes to training first (a
    spare's import, CPU-seconds at nice 0, took the cores from the
    workers' first seconds of training). The build runs on that thread (a spare's) or on
    one of its own, never in the constructor: the actor answers its calls meanwhile, and a
    task that is slow to build is slow in setup, where the driver expects it. Calls that
    need the modules wait for the imports (`wait`: a spare is ready then), setup for the
    build (`take`), a newcomer's readiness to join for all of it (`wait(warmed)`). A nice
    value is the thread's own (Linux): the process, and every thread that trains later,
    keeps the worker's."""

    def __init__(self, config: Any, spare: bool, compiles: Any = None):
        # trainer.compile (the run's config): torch's compiler imported too, and the
        # run's compiled artifacts loaded where this is its first worker on the node
        self._compiles = compiles
        self._thread = None
        self._prebuilt = None
        self._taken = False  # setup has taken the state: a hand-over no longer to warm the store for
        self.imported, self.built, self.warmed = threading.Event(), threading.Event(), threading.Event()
        if spare:
            self._start(self._run, config, 19)
            return
        self._imports()
        if config is not None:
            self._start(self._build, config, None)
        else:
            self.built.set()
            self.warmed.set()

    def _start(self, target: Any, config: Any, nice: int | None) -> None:
        self._thread = threading.Thread(target=target, args=(config, nice), name="raytrainer-warm-up", daemon=True)
        self._thread.start()

    def _run(self, config: Any, nice: int | None) -> None:
        _lower_priority(nice)
        self._imports()
        self._build(config, None)

    def _imports(self) -> None:
        from .. import _internals

        _internals.import_dynamo()
        if self._compiles is not None:
            from ..loop.compiling import load_run_artifacts

            _internals.import_inductor()
            load_run_artifacts(self._compiles)

        from ..loop import loop  # noqa: F401
        from ..state import snapshot  # noqa: F401

        keeping.note_start()  # torch's imports set variables of their own

        # torch, dynamo and Ray leave ~330,000 objects to Python's cyclic GC, which walks
        # them all at each full collection: 0.43 s in the middle of a survivor's re-forming
        # (docs/results/2026-11-27-fsdp-recovery-timings.md), whenever the count of new objects happens to
        # call for one. They live as long as the process: frozen, a collection walks only
        # what was made after them (the task's, ~10,000 in that run).
        gc.freeze()
        self.imported.set()

    def _build(self, config: Any, nice: int | None) -> None:
        _lower_priority(nice)
        try:
            if config is not None:
                from .warm import compile_ahead, prebuild, touch_object_store

                prebuilt = prebuild(config)
                compile_ahead(prebuilt, config)  # trainer.compile: not in the first step's time
                self._prebuilt = prebuilt
                self.built.set()
                # Not waited for by setup, which may take the state meanwhile. A spare taken
                # while it built has had its hand-over: a put now would only take cores and
                # memory from its first step.
                if prebuilt is not None and not self._taken:
                    touch_object_store(prebuilt)
        finally:
            self.built.set()
            self.warmed.set()

    def wait(self, done: threading.Event | None = None) -> None:
        done = done or self.imported
        if self._thread is not None:
            while not done.wait(0.1) and self._thread.is_alive():
                pass
            if not self.imported.is_set():  # the imports raised on the thread: raise it here
                self._imports()

    def take(self) -> Any:
        """The training state built ahead (warm.Prebuilt), once; None if none was."""
        self._taken = True
        self.wait(self.built)
        prebuilt, self._prebuilt = self._prebuilt, None
        return prebuilt


def _lower_priority(nice: int | None) -> None:
    """This thread's nice value (Linux: a thread's own)."""
    if nice is not None and sys.platform.startswith("linux"):
        import os

        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


@contextlib.contextmanager
def _as_worker_error(worker: Worker):
    """Forming a group: a peer lost meanwhile is a PeerFailure (this worker is fine), any
    other exception this worker's own error."""
    try:
        yield
    except Exception as exc:
        if _peer_failure(exc):
            raise PeerFailure(f"{type(exc).__name__}: {exc}") from None
        raise _worker_error(worker, exc) from None


def _worker_error(worker: Worker, exc: Exception) -> Exception:
    """Our own errors pass through (their messages name the fix); anything else
    becomes a WorkerError carrying the rank, the step and the worker's traceback."""
    if isinstance(exc, RaytrainerError):
        return exc
    loop = worker.loop
    return WorkerError(
        worker.rank if worker.rank is not None else -1,
        f"{type(exc).__name__}: {exc}",
        "".join(traceback.format_exception(exc)),
        step=loop.step + 1 if loop else None,
    )


def _peer_failure(exc: Exception) -> bool:
    """Whether `exc` is a collective or a rendezvous failing because a peer died or left:
    torch's typed errors (DistBackendError from NCCL, DistNetworkError and DistStoreError
    from the store), and the bare RuntimeError of Gloo's transport (see _internals)."""
    import torch.distributed as dist

    from .. import _internals

    return isinstance(exc, dist.DistError) or _internals.is_gloo_transport_error(exc)
