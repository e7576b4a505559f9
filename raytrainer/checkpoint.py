"""Checkpoints: any storage pyarrow.fs or fsspec reaches, atomic commit by marker, retention.

Layout under the run directory, for a replicated strategy (DDP: rank 0 writes):

    checkpoints/step-00000120/state.pt    model, optimizer, scheduler, scaler, EMA,
                                          loop counters, the input's position
    checkpoints/step-00000120/COMMITTED   JSON manifest: step, size and sha256 of
                                          state.pt, metrics at that step

and for a sharded one (FSDP: every rank writes its shards in parallel, through
torch.distributed.checkpoint; see sharded.py):

    checkpoints/step-00000120/__0_0.distcp, __1_0.distcp, ..., .metadata
    checkpoints/step-00000120/COMMITTED   manifest with "format": "dcp" and the size of
                                          every file, written by rank 0 after all ranks

A checkpoint exists only once its COMMITTED marker does, and the marker is
written last, so a crash or kill mid-write leaves the previous checkpoint as
the latest (rename is not atomic on object stores; a marker is). A write that fails
(a full disk, storage that cannot be reached) removes what it left of its directory, so
a full disk is not kept full by a half-written checkpoint, and never touches a committed
one: retention runs only after a commit. The manifest's
checksum catches a truncated or corrupted state.pt at load time, and the next
older checkpoint is used instead, with a warning. Everything loads with
torch.load(weights_only=True): a checkpoint never unpickles code.

The driver only finds checkpoints (their manifests: a CheckpointRef); the workers read
and verify them (read_checkpoint): model bytes never pass through the driver.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from . import filesystems
from .config import CheckpointConfig
from .errors import StorageError

log = logging.getLogger(__name__)

MARKER = "COMMITTED"
VALIDATION_PENDING = "validation_pending"
"""A manifest metric: the checkpoint's validation runs asynchronously and has not arrived;
retention keeps it until it does (Checkpoints.rescore)."""
STATE = "state.pt"


# The final save's waits between tries (s): a storage blip of up to about a minute (an
# endpoint restarting, a disk being cleaned) does not fail a run that trained to its end.
FINAL_BACKOFF_S = (2.0, 8.0, 30.0)


def with_retries(write: Callable[[], Any], what: str, where: str, kept: Callable[[], str],
                 backoff: tuple[float, ...] | None = None) -> Any:
    """`write()`, tried again after each wait of `backoff` (FINAL_BACKOFF_S) while it
    raises; then a StorageError naming `what`, `where`, the last cause and what is `kept`."""
    backoff = FINAL_BACKOFF_S if backoff is None else backoff
    for attempt in range(len(backoff) + 1):
        try:
            return write()
        except Exception as exc:  # noqa: BLE001 - the cause goes into the error
            cause = cause_of(exc)
            if attempt < len(backoff):
                log.warning("writing %s to %s failed (%s); trying again in %.0f s", what, where, cause,
                            backoff[attempt])
                time.sleep(backoff[attempt])
    raise StorageError(f"the run trained to its end, but {what} could not be written to {where} "
                       f"({len(backoff) + 1} tries over {sum(backoff):.0f} s): {cause}. {kept()}")


def cause_of(exc: BaseException) -> str:
    """An error's type and first line, short enough for an event and a warning."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


class Storage:
    """A directory on a local disk or behind any URI filesystems.open_uri opens: file://,
    s3:// (endpoint and credentials from the environment, as AWS tools read them:
    AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...), gs://, abfs://, hdfs://, or a scheme of fsspec's."""

    def __init__(self, uri: str):
        import pyarrow.fs as pafs

        base, sep, query = uri.partition("?")
        self.uri = base.rstrip("/") + sep + query
        self.fs, self.root = filesystems.open_uri(self.uri)
        self.root = self.root.rstrip("/") or self.root
        self.local = isinstance(self.fs, pafs.LocalFileSystem)

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def write(self, rel: str, data: bytes | memoryview) -> None:
        path = self.path(rel)
        self.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with self.fs.open_output_stream(path) as f:
            f.write(data)

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Write `rel` whole or not at all: on a local filesystem through a temporary file
        renamed over it; an object store's PUT is atomic already."""
        if not self.local:
            return self.write(rel, data)
        self.write(f"{rel}.tmp", data)
        self.fs.move(self.path(f"{rel}.tmp"), self.path(rel))

    def read(self, rel: str) -> bytes:
        with self.fs.open_input_stream(self.path(rel)) as f:
            return f.read()

    def exists(self, rel: str) -> bool:
        import pyarrow.fs as pafs

        return self.fs.get_file_info(self.path(rel)).type != pafs.FileType.NotFound

    def list_dirs(self, rel: str) -> list[str]:
        import pyarrow.fs as pafs

        selector = pafs.FileSelector(self.path(rel), allow_not_found=True)
        return sorted(i.base_name for i in self.fs.get_file_info(selector) if i.type == pafs.FileType.Directory)

    def delete_dir(self, rel: str) -> None:
        self.fs.delete_dir(self.path(rel))

    def list_files(self, rel: str) -> dict[str, int]:
        """The files directly in `rel`, with their sizes."""
        import pyarrow.fs as pafs

        selector = pafs.FileSelector(self.path(rel), allow_not_found=True)
        return {i.base_name: i.size for i in self.fs.get_file_info(selector) if i.type == pafs.FileType.File}

    def uri_of(self, rel: str) -> str:
        """A URI for `rel` that Storage() opens on any node (absolute for a local path)."""
        if not rel:
            return self.root if self.local else self.uri
        return self.path(rel) if self.local else filesystems.join(self.uri, rel)


@dataclass
class Committed:
    step: int
    name: str
    manifest: dict[str, Any]


@dataclass(frozen=True)
class CheckpointRef:
    """A committed checkpoint as the driver knows it: where it is and its manifest, never
    its state (the workers read it: read_checkpoint)."""

    storage: str
    """The storage URI it is under."""
    rel: str
    """Its directory, relative to `storage` ("" where `storage` is the directory itself)."""
    name: str
    step: int
    manifest: dict[str, Any]


def read_checkpoint(ref: CheckpointRef) -> bytes | str:
    """What a worker starts from (see read_verified); ValueError or OSError if corrupt."""
    return read_verified(Storage(ref.storage), ref.rel, ref.manifest)


def find_checkpoint_dir(uri: str) -> CheckpointRef:
    """A checkpoint named by its own directory (run.resume: PATH): its manifest."""
    storage = Storage(uri)
    try:
        manifest = json.loads(storage.read(MARKER))
    except (OSError, FileNotFoundError):
        raise FileNotFoundError(f"{uri} holds no committed checkpoint (no {MARKER} marker)") from None
    return CheckpointRef(uri, "", filesystems.split(uri)[1], manifest["step"], manifest)


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def read_verified(storage: Storage, rel: str, manifest: dict[str, Any]) -> bytes | str:
    """What a worker starts from: state.pt's bytes checked against the manifest, or for a
    sharded checkpoint, its directory's URI once every file has its recorded size (each
    rank reads its own shards; DCP checks what it reads)."""
    if manifest.get("format") == "dcp":
        found = storage.list_files(rel)
        if any(found.get(name) != f["size"] for name, f in manifest["files"].items()):
            raise ValueError("is corrupt: its files differ from its manifest (missing or truncated)")
        return storage.uri_of(rel)
    data = storage.read(f"{rel}/{STATE}" if rel else STATE)
    expected = manifest["files"][STATE]
    if len(data) != expected["size"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise ValueError("is corrupt: its state.pt differs in size or checksum from its manifest")
    return data


class Checkpoints:
    """Lists, validates, loads, writes and prunes the checkpoints of one run."""

    def __init__(self, storage: Storage, run_name: str, cfg: CheckpointConfig):
        self.storage, self.cfg = storage, cfg
        self.prefix = f"{run_name}/checkpoints"

    # ------------------------------------------------------------------ reading

    def committed(self) -> list[Committed]:
        """Checkpoints whose marker exists, oldest first (partial writes are invisible)."""
        return self._scan()[0]

    def _scan(self) -> tuple[list[Committed], list[str]]:
        """(the committed checkpoints, oldest first; the names of the step directories with
        no marker: a write in flight, or what a failed write or deletion left)."""
        found, partial = [], []
        for name in self.storage.list_dirs(self.prefix):
            marker = f"{self.prefix}/{name}/{MARKER}"
            if not name.startswith("step-"):
                continue
            if not self.storage.exists(marker):
                partial.append(name)
                continue
            try:
                manifest = json.loads(self.storage.read(marker))
            except ValueError:  # a marker cut short by a full disk (written before markers were atomic)
                continue
            found.append(Committed(manifest["step"], name, manifest))
        return sorted(found, key=lambda c: c.step), partial

    def newest(self, before: int | None = None) -> CheckpointRef | None:
        """The newest committed checkpoint (older than step `before`, if given), by its
        manifest alone: what the driver resumes from; the workers read and verify it."""
        found = [c for c in self.committed() if before is None or c.step < before]
        if not found:
            return None
        ckpt = found[-1]
        return CheckpointRef(self.storage.uri, f"{self.prefix}/{ckpt.name}", ckpt.name, ckpt.step, ckpt.manifest)

    def load_latest(self, warn: Callable[[str], None] = log.warning) -> tuple[Committed, bytes | str] | None:
        """The newest checkpoint whose state matches its manifest (see read_verified); a
        corrupt one is reported through `warn` and the next older one is tried."""
        for ckpt in reversed(self.committed()):
            try:
                return ckpt, read_verified(self.storage, f"{self.prefix}/{ckpt.name}", ckpt.manifest)
            except (OSError, ValueError) as exc:
                warn(f"checkpoint {ckpt.name} {exc}; falling back to an older one")
        return None

    # ------------------------------------------------------------------ writing

    def write(self, step: int, state: dict[str, Any], metrics: dict[str, float]) -> Committed:
        """Serialise, write, then commit with the marker; then apply retention."""
        name = checkpoint_name(step)
        with self._discarded_on_failure(name):
            return self._commit(step, name, {STATE: self._write_state(name, state)}, metrics)

    @contextlib.contextmanager
    def _discarded_on_failure(self, name: str):
        """Remove what a failed write of checkpoint `name` left (uncommitted only), then raise."""
        try:
            yield
        except BaseException:
            self.discard(name)
            raise

    def discard(self, name: str) -> None:
        """Delete checkpoint `name`'s directory unless it is committed: what a failed write
        left there would keep a full disk full. Best effort: the storage may be failing."""
        rel = f"{self.prefix}/{name}"
        try:
            if self.storage.exists(rel) and not self.storage.exists(f"{rel}/{MARKER}"):
                self.storage.delete_dir(rel)
        except OSError as exc:
            log.debug("could not remove the partial checkpoint %s: %s", rel, exc)

    def _write_state(self, name: str, state: dict[str, Any]) -> dict[str, Any]:
        """Write state.pt of checkpoint `name`; its manifest entry."""
        import torch

        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getbuffer()  # not getvalue(): a copy of it all
        self.storage.write(f"{self.prefix}/{name}/{STATE}", data)
        return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def write_dir(self, step: int, state: dict[str, Any], directory: str, metrics: dict[str, float]) -> Committed:
        """Commit the files a loop of its own saved in the local `directory` (its own
        checkpoint format: a Hugging Face Trainer's checkpoint-N, say), with `state` beside
        them as state.pt; then apply retention."""
        import pyarrow.fs as pafs

        from .errors import TaskError

        root = Path(directory)
        files = {p.relative_to(root).as_posix(): {"size": p.stat().st_size}
                 for p in sorted(root.rglob("*")) if p.is_file()}
        clash = sorted({STATE, MARKER} & set(files))
        if clash:
            raise TaskError(f"the checkpoint directory {directory!r} holds {', '.join(clash)}, names raytrainer "
                            "keeps for its own files there; rename them")
        name = checkpoint_name(step)
        with self._discarded_on_failure(name):
            self.storage.fs.create_dir(self.storage.path(f"{self.prefix}/{name}"), recursive=True)
            pafs.copy_files(str(root), self.storage.path(f"{self.prefix}/{name}"),
                            source_filesystem=pafs.LocalFileSystem(), destination_filesystem=self.storage.fs)
            files[STATE] = self._write_state(name, state)
            return self._commit(step, name, files, metrics)

    def rel(self, step: int) -> str:
        """The directory of the checkpoint of `step`, relative to the storage."""
        return f"{self.prefix}/{checkpoint_name(step)}"

    def commit_sharded(self, step: int, files: dict[str, Any], metrics: dict[str, float]) -> Committed:
        """Rank 0, once every rank has written its shards of step `step` (`files`: name ->
        {size}): the marker makes the checkpoint exist."""
        return self._commit(step, checkpoint_name(step), files, metrics, format="dcp")

    def _commit(self, step: int, name: str, files: dict[str, Any], metrics: dict[str, float],
                **extra: Any) -> Committed:
        manifest = {"step": step, "time": time.time(), **extra, "files": files, "metrics": metrics}
        # Atomic: a marker cut short by a full disk must not exist, let alone look committed.
        self.storage.write_atomic(f"{self.prefix}/{name}/{MARKER}", json.dumps(manifest).encode())
        try:
            self.prune()
        except OSError as exc:  # committed all the same; the next commit prunes again
            log.warning("retention could not delete old checkpoints of %s: %s", self.prefix, exc)
        return Committed(step, name, manifest)

    def rescore(self, step: int, metrics: dict[str, float]) -> bool:
        """The validation of checkpoint `step` arrived after its commit: its manifest's
        metrics take it (and lose VALIDATION_PENDING), then retention ranks it. False if
        the checkpoint is not (or no longer) there, or was not waiting for it."""
        rel = f"{self.prefix}/{checkpoint_name(step)}/{MARKER}"
        if not self.storage.exists(rel):
            return False
        manifest = json.loads(self.storage.read(rel))
        if not manifest.get("metrics", {}).get(VALIDATION_PENDING):
            return False  # ranked already (by its own validation, or a sync one)
        kept = {k: v for k, v in manifest.get("metrics", {}).items() if k != VALIDATION_PENDING}
        manifest["metrics"] = {**kept, **metrics}
        self.storage.write_atomic(rel, json.dumps(manifest).encode())
        self.prune()
        return True

    def prune(self) -> list[str]:
        """Keep the newest keep_last and the best keep_best.k; never the newest one. Also
        remove what a failed write or an interrupted deletion left (a directory with no
        marker, older than the newest committed checkpoint: saves commit in step order, so
        no write of it is in flight)."""
        ckpts, partial = self._scan()
        keep = {c.name for c in ckpts[-self.cfg.keep_last:]}
        best = self.cfg.keep_best
        if best is not None:
            scored = [c for c in ckpts if best.metric in c.manifest.get("metrics", {})]
            scored.sort(key=lambda c: c.manifest["metrics"][best.metric], reverse=best.mode == "max")
            keep |= {c.name for c in scored[: best.k]}
            # Its validation is on its way (trainer.validation.async): ranked when it arrives.
            keep |= {c.name for c in ckpts if c.manifest.get("metrics", {}).get(VALIDATION_PENDING)}
        deleted = [c.name for c in ckpts if c.name not in keep]
        for name in deleted:
            # The marker goes first: a half-deleted checkpoint must not look committed.
            self.storage.fs.delete_file(self.storage.path(f"{self.prefix}/{name}/{MARKER}"))
            self.storage.delete_dir(f"{self.prefix}/{name}")
        for name in partial:
            if ckpts and name < ckpts[-1].name:  # zero-padded: names sort as their steps
                self.discard(name)
        return deleted


def to_cpu(obj: Any) -> Any:
    """A deep copy of a state tree with every tensor copied to CPU (the snapshot an
    asynchronous save writes while training goes on); of a DTensor, this rank's shard."""
    import torch

    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj
