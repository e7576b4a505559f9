"""Storage URIs: which filesystem opens a run directory's URI, and whether one can.

pyarrow's own filesystems open the schemes they know (file, s3, gs, abfs, hdfs: one
C++ client each, used by DCP's shard reads as well); fsspec's open every other scheme
it knows (az:// through adlfs, a gs:// where pyarrow was built without GCS, ...), wrapped
as a pyarrow filesystem, so checkpoints, shards and the driver's files speak pyarrow.fs
alone. A URI may carry options in its query string (pyarrow's, e.g.
gs://bucket/runs?endpoint_override=...): a path joined to it goes before them.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

from .errors import ConfigError, RaytrainerError

# scheme -> the pyarrow.fs class FileSystem.from_uri opens it with (a pyarrow built
# without one lacks that class: the scheme then goes to fsspec).
PYARROW = {"file": "LocalFileSystem", "local": "LocalFileSystem", "s3": "S3FileSystem", "gs": "GcsFileSystem",
           "gcs": "GcsFileSystem", "abfs": "AzureFileSystem", "abfss": "AzureFileSystem",
           "hdfs": "HadoopFileSystem", "viewfs": "HadoopFileSystem"}
# scheme -> raytrainer's extra that installs fsspec's filesystem for it.
EXTRAS = {"gs": "gcs", "gcs": "gcs", "abfs": "azure", "abfss": "azure", "az": "azure", "adl": "azure"}
HADOOP_HINT = ("pyarrow's HDFS client needs a Hadoop client on every node: a JVM (JAVA_HOME), libhdfs "
               "(HADOOP_HOME, or ARROW_LIBHDFS_DIR) and CLASSPATH=$(hadoop classpath --glob)")


def scheme(uri: str) -> str | None:
    """The URI's scheme, lowercase; None for a plain local path."""
    head, sep, _ = uri.partition("://")
    return head.lower() if sep else None


def check(key: str, uri: str) -> None:
    """ConfigError (naming `key`) unless a filesystem for `uri`'s scheme is installed. Cheap:
    no filesystem is built, nothing is imported but pyarrow.fs and fsspec's registry, no
    network is reached (credentials and endpoints are checked where the URI is opened)."""
    name = scheme(uri)
    if name is None or _pyarrow_opens(name):
        return
    package = _fsspec_package(name)
    if package is None:
        raise ConfigError(
            f"{key}={uri!r}: no filesystem is known for {name}:// (pyarrow opens "
            f"{', '.join(sorted(set(PYARROW) - {'local', 'viewfs'}))}; fsspec opens the schemes its "
            "implementations register); use one of those, a local path, or install the fsspec package "
            f"that provides {name}://")
    if importlib.util.find_spec(package) is None:
        extra = f'pip install "raytrainer[{EXTRAS[name]}]"' if name in EXTRAS else f"pip install {package}"
        raise ConfigError(f"{key}={uri!r}: {name}:// is opened through fsspec's {package}, which is not "
                          f"installed: {extra}")


def open_uri(uri: str) -> tuple[Any, str]:
    """(a pyarrow filesystem, the path in it) for a local path or a URI."""
    import pyarrow.fs as pafs

    name = scheme(uri)
    if name is None:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    if _pyarrow_opens(name):
        try:
            return pafs.FileSystem.from_uri(uri)
        except OSError as exc:
            if PYARROW[name] != "HadoopFileSystem":
                raise
            # pyarrow lists every place it looked for the JVM: the first line says enough.
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RaytrainerError(f"{uri}: {HADOOP_HINT} ({first})") from None
    from fsspec.core import url_to_fs

    # No listings cache: other processes write the run directory (the workers' checkpoints,
    # the driver's files), and a cached listing would hide them (fsspec keeps one per
    # filesystem instance, and shares instances).
    fs, path = url_to_fs(uri, use_listings_cache=False)
    return pafs.PyFileSystem(_handler()(fs)), path


def join(uri: str, rel: str) -> str:
    """`rel` under `uri`, before its query string."""
    base, sep, query = uri.partition("?")
    return f"{base.rstrip('/')}/{rel}{sep}{query}" if rel else uri


def split(uri: str) -> tuple[str, str]:
    """(the parent, the last name) of a path or URI, the query string kept on the parent:
    a run directory's storage and run name."""
    base, sep, query = uri.partition("?")
    parent, _, name = base.rstrip("/").rpartition("/")
    return parent + sep + query, name


@functools.cache
def _handler() -> type:
    """pyarrow's FSSpecHandler, creating directories with fsspec's makedirs(exist_ok=True):
    its portable "create unless there", where mkdir of an existing one raises whatever each
    implementation likes (FTP's: error_perm 550), not the FileExistsError pyarrow passes over."""
    import pyarrow.fs as pafs

    class Handler(pafs.FSSpecHandler):
        def create_dir(self, path: str, recursive: bool) -> None:
            if recursive:
                self.fs.makedirs(path, exist_ok=True)
            else:
                super().create_dir(path, recursive)

    return Handler


def _pyarrow_opens(name: str) -> bool:
    import pyarrow.fs as pafs

    return name in PYARROW and hasattr(pafs, PYARROW[name])


def _fsspec_package(name: str) -> str | None:
    """The top-level package of fsspec's implementation of `name`, None if fsspec knows none."""
    from fsspec.registry import known_implementations, registry

    if name in registry:  # registered as a class: imported already
        return registry[name].__module__.partition(".")[0]
    known = known_implementations.get(name)
    return known["class"].partition(".")[0] if known else None
