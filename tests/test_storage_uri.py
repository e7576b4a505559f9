"""run.storage at any URI pyarrow or fsspec opens: gs:// through pyarrow's GCS client on a
GCS emulator, ftp:// through fsspec (a scheme pyarrow lacks) on an FTP server, s3:// on
moto's; a run trains there, is resumed with `raytrainer resume URI` and plotted with
`raytrainer plot URI` (storage_servers.py: the servers)."""

import json
import os
import shutil
import signal

import pytest

import raytrainer
from raytrainer import filesystems
from raytrainer.checkpoint import Checkpoints, Storage
from raytrainer.config import CheckpointConfig
from raytrainer.driver.cli import main
from raytrainer.errors import RaytrainerError, Stopped

from .conftest import assert_no_leaks
from .storage_servers import ftp_server, gcs_server, s3_server

SERVERS = {"gs": gcs_server, "ftp": ftp_server, "s3": s3_server}


@pytest.fixture(params=sorted(SERVERS))
def storage_uri(request, tmp_path):
    server = SERVERS[request.param]
    with server(tmp_path) if request.param == "ftp" else server() as uri:
        yield uri


def test_the_uri_picks_pyarrows_client_where_it_has_one_else_fsspecs(tmp_path):
    import pyarrow.fs as pafs

    with gcs_server() as gs, ftp_server(tmp_path) as ftp:
        assert type(Storage(gs).fs).__name__ == "GcsFileSystem"
        fsspec_fs = Storage(ftp).fs
        assert isinstance(fsspec_fs, pafs.PyFileSystem)
        assert type(fsspec_fs.handler.fs).__name__ == "FTPFileSystem"
    # A path joined to a URI goes before its query string (the client's options).
    assert filesystems.join("gs://b/runs?scheme=http", "x/y") == "gs://b/runs/x/y?scheme=http"
    assert filesystems.split("gs://b/runs/x/?scheme=http") == ("gs://b/runs?scheme=http", "x")


def test_checkpoints_commit_list_prune_and_load_through_the_uri(storage_uri):
    ckpts = Checkpoints(Storage(storage_uri), "direct", CheckpointConfig(keep_last=2))
    for step in (1, 2, 3):
        ckpts.write(step, {"step": step}, {"loss": 1.0 / step})
    assert [c.step for c in ckpts.committed()] == [2, 3]
    ref = ckpts.newest()
    assert ref.storage == Storage(storage_uri).uri and ref.step == 3
    committed, data = ckpts.load_latest()
    assert committed.step == 3 and len(data) == ref.manifest["files"]["state.pt"]["size"]


def config(storage, name, max_steps):
    return {"task": {"target": "tests.tasks:RegressionTask"},
            "trainer": {"max_steps": max_steps, "global_batch_size": 32, "log_every_n_steps": 1},
            "scaling": {"num_workers": 1}, "checkpoint": {"every_n_steps": 2},
            "run": {"name": name, "storage": storage}, "loggers": []}


def test_a_run_at_the_uri_checkpoints_then_raytrainer_resume_and_plot_take_its_uri(
        ray_local, storage_uri, tmp_path, monkeypatch, capsys):
    result = raytrainer.train(config(storage_uri, "remote", 4), progress=False)
    storage = Storage(storage_uri)
    assert [c.step for c in Checkpoints(storage, "remote", CheckpointConfig()).committed()] == [2, 4]
    for name in ("config.yaml", "metrics.jsonl", "events.jsonl", "model.pt"):
        assert storage.exists(f"remote/{name}"), name
    assert result.metrics["step"] == 4

    run_dir = filesystems.join(storage_uri, "remote")
    assert main(["resume", run_dir, "--set", "trainer.max_steps=6", "--no-progress"]) == 0
    events = [json.loads(line) for line in storage.read("remote/events.jsonl").decode().splitlines()]
    assert [e["step"] for e in events if e["event"] == "resumed"] == [4]
    assert [c.step for c in Checkpoints(storage, "remote", CheckpointConfig()).committed()][-1] == 6
    assert "finished" in capsys.readouterr().out

    monkeypatch.chdir(tmp_path)  # the plot of a run at a URI is written here, not there
    assert main(["plot", run_dir]) == 0
    said = capsys.readouterr().out
    assert str(tmp_path / "remote.png") in said and (tmp_path / "remote.png").stat().st_size > 0
    assert main(["plot", run_dir, "--out", str(tmp_path / "chosen.png")]) == 0
    assert (tmp_path / "chosen.png").stat().st_size > 0
    assert_no_leaks()


def test_resume_and_plot_of_a_uri_with_no_run_say_so(tmp_path, capsys):
    with ftp_server(tmp_path) as uri:
        missing = filesystems.join(uri, "nothing-here")
        assert main(["resume", missing]) == 2
        assert "is not a run directory (it has no config.yaml)" in capsys.readouterr().err
        assert main(["plot", missing]) == 2
        assert "holds no metrics.jsonl or events.jsonl" in capsys.readouterr().err
    assert main(["plot", "nosuch://bucket/runs/x"]) == 2
    assert "no filesystem is known for nosuch://" in capsys.readouterr().err


def test_hdfs_without_a_hadoop_client_says_what_it_needs():
    if shutil.which("hadoop") or os.environ.get("ARROW_LIBHDFS_DIR"):
        pytest.skip("a Hadoop client is installed here: hdfs:// would try to reach its namenode")
    with pytest.raises(RaytrainerError) as info:
        Storage("hdfs://namenode:8020/runs")
    assert "JAVA_HOME" in str(info.value) and "hadoop classpath" in str(info.value)
    assert len(str(info.value)) < 400  # not pyarrow's list of every place it looked for a JVM


def test_a_stopped_run_at_a_uri_is_continued_by_raytrainer_resume_of_its_uri():
    stopped = Stopped(signal.SIGTERM, step=3, run_dir="gs://bucket/runs/x?scheme=http")
    assert stopped.how_to_continue("cfg.yaml") == "raytrainer resume gs://bucket/runs/x?scheme=http"
