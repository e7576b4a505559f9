"""The loggers on real runs: MLflow against a real tracking server on loopback (SQLite
store), W&B in offline mode (its files read back), a user's own sink, and a tracking
server that goes away mid-run. One local Ray and one MLflow server for the module."""

import contextlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import raytrainer
from raytrainer.errors import ConfigError

from .conftest import assert_no_leaks
from .ray_procs import free_ports
from .waits import Deadline


@contextlib.contextmanager
def mlflow_server(root: Path):
    """`mlflow server` on 127.0.0.1 and a free port, with a SQLite store and artifacts under
    `root`; stopped (its whole process group) and removed on exit."""
    (port,) = free_ports(1)
    root.mkdir(parents=True, exist_ok=True)
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
         "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=root,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})  # no job runner processes
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = Deadline(180)  # imports and migrations: ~12 s on a quiet 2-core machine
        while True:
            assert proc.poll() is None, "mlflow server exited:\n" + (root / "server.log").read_text()[-3000:]
            assert not deadline.passed(), "mlflow server not up:\n" + (root / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(uri + "/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.3)
        yield uri, proc.pid, port
    finally:  # nothing in it is worth a graceful shutdown (3 s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as (uri, _, _):
        yield uri


def config(tmp_path, name, loggers, **sections):
    cfg = {
        "task": {"target": "tests.tasks:RegressionTask", "args": {}},
        "trainer": {"max_steps": 4, "global_batch_size": 32, "val_every_n_steps": 2},
        "scaling": {"num_workers": 1},
        "checkpoint": {"every_n_steps": 2},
        "run": {"name": name, "storage": str(tmp_path)},
        "loggers": loggers,
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def series(rows):
    """{metric: {(step, value), ...}} of metric rows, as a tracker keeps them (a set: MLflow
    keeps one point of two identical ones, e.g. `epoch` of a step's training and validation rows)."""
    out = {}
    for row in rows:
        for key, value in row.items():
            if key not in ("step", "time") and isinstance(value, (int, float)):
                out.setdefault(key, set()).add((row["step"], float(value)))
    return out


class RowCollector(raytrainer.Callback):
    on_driver = True

    def __init__(self):
        self.rows = []

    def on_metrics(self, ctx, row):
        self.rows.append(row)


def wandb_records(path):
    """The records of a .wandb file (LevelDB log format: 32 KiB blocks of chunks, each with a
    7-byte header: CRC32C, length, type FULL/FIRST/MIDDLE/LAST), decoded with wandb's protos."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    at, records, chunk = 7, [], b""
    while at + 7 <= len(data):
        left = 32768 - at % 32768
        if left < 7:  # the block's tail is padding
            at += left
            continue
        _, length, kind = struct.unpack("<IHB", data[at:at + 7])
        if kind == 0:  # zero padding: the rest of the block
            at += left
            continue
        chunk += data[at + 7:at + 7 + length]
        at += 7 + length
        if kind in (1, 4):  # FULL or LAST
            records.append(wandb_internal_pb2.Record.FromString(chunk))
            chunk = b""
    return records


def wandb_history(records):
    """{metric: [(step, value)]} from the history records (the 'step' field, not W&B's _step)."""
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            rows.append({k: v for k, v in items.items() if not k.startswith("_")})
    return series(rows)


def wandb_files(root):
    return sorted((root / "wandb").glob("offline-run-*/run-*.wandb"))


def test_a_run_and_its_resume_reach_mlflow_wandb_a_users_sink_and_callbacks(ray_local, mlflow_uri, tmp_path,
                                                                             monkeypatch):
    """One run (and its resume) with every kind of logger at once: each run costs seconds."""
    from mlflow.tracking import MlflowClient

    wandb_dir = tmp_path / "wandb-dir"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network: the run's files are read back
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    record = tmp_path / "sink.jsonl"
    loggers = [{"type": "mlflow", "tracking_uri": mlflow_uri, "experiment": "first", "log_checkpoints": True},
               {"type": "wandb", "project": "tests"},
               {"target": "tests.tasks:RecordingSink", "args": {"path": str(record)}}]
    collector = RowCollector()
    result = raytrainer.train(config(tmp_path, "both", loggers), progress=False, callbacks=[collector])
    run_dir = result.run_dir
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4] and any("val_loss" in r for r in rows)
    states = json.loads((run_dir / "loggers.json").read_text())

    # MLflow: one run, named after the run, the config as params, every row, the events, the files.
    client = MlflowClient(mlflow_uri)
    experiment = client.get_experiment_by_name("first")
    (run,) = client.search_runs([experiment.experiment_id])
    run_id = run.info.run_id
    assert states[f"mlflow {mlflow_uri} first"] == {"run_id": run_id}
    assert run.info.run_name == "both" and run.info.status == "FINISHED"
    assert run.data.params["trainer.max_steps"] == "4"
    assert run.data.params["task.target"] == "tests.tasks:RegressionTask"
    assert run.data.params["scaling.num_workers"] == "1"

    def history():
        return {key: {(m.step, m.value) for m in client.get_metric_history(run_id, key)}
                for key in series(read_jsonl(run_dir / "metrics.jsonl"))}

    assert history() == series(rows)  # every metric of every row, at its step
    note = run.data.tags["mlflow.note.content"]
    assert "run_started" in note and "group_formed" in note and "finished" in note
    assert {a.path for a in client.list_artifacts(run_id)} == {"model.pt", "checkpoints"}
    assert {a.path for a in client.list_artifacts(run_id, "checkpoints")} == {
        "checkpoints/step-00000002", "checkpoints/step-00000004"}

    # W&B (offline): the run's .wandb file holds the config, every row, the notes, model.pt.
    (first,) = wandb_files(wandb_dir)
    wandb_id = states["wandb /tests"]["id"]
    assert first.name == f"run-{wandb_id}.wandb"
    records = wandb_records(first)
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert runs[0].run_id == wandb_id and runs[0].project == "tests" and runs[0].display_name == "both"
    config_items = {i.key: json.loads(i.value_json) for i in runs[0].config.update}
    assert config_items["trainer"]["max_steps"] == 4 and config_items["scaling"]["num_workers"] == 1
    assert wandb_history(records) == series(rows)
    assert "group_formed" in runs[-1].notes and "finished" in runs[-1].notes
    (artifact,) = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    assert artifact.type == "model" and [c.path for c in artifact.manifest.contents] == ["model.pt"]
    (exit_record,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 0

    # The driver callback's on_metrics and the user's sink saw every row, as metrics.jsonl has them.
    assert collector.rows == rows
    calls = read_jsonl(record)
    assert calls[0] == {"call": "open", "run_dir": str(run_dir), "name": "both", "resumed": False}
    assert [c["row"] for c in calls if c["call"] == "write"] == rows
    assert [c["event"] for c in calls if c["call"] == "event"] == [e["event"] for e in result.events]
    assert {"call": "artifact", "path": str(run_dir / "model.pt"), "kind": "model"} in calls
    assert calls[-1] == {"call": "close"}

    # A resume, trained longer, continues the same MLflow run and the same W&B run.
    again = raytrainer.train(config(tmp_path, "both", loggers, trainer={"max_steps": 8}), progress=False)
    assert [e["event"] for e in again.events][:2] == ["run_started", "resumed"]
    all_rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in all_rows if "loss" in r] == list(range(1, 9))
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert history() == series(all_rows)
    assert run.data.params["trainer.max_steps"] == "4"  # the first attempt's: MLflow's params are immutable
    assert run.data.tags["mlflow.note.content"].startswith(note) and "resumed" in run.data.tags["mlflow.note.content"]
    # Offline, W&B writes a second file with the same run id (`wandb sync` appends it to the
    # run), holding the rows after the checkpoint the run resumed from.
    (second,) = set(wandb_files(wandb_dir)) - {first}
    assert second.name == first.name
    assert wandb_history(wandb_records(second)) == series(all_rows[len(rows):])
    assert_no_leaks()


def test_training_goes_on_when_the_tracking_server_stops(ray_local, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail at once: no need to wait out retries here
    with mlflow_server(tmp_path / "mlflow") as (uri, pgid, port):
        loggers = [{"type": "mlflow", "tracking_uri": uri}]
        hold = tmp_path / "hold"  # step 5 waits until the server is down (step 3's row comes with step 4)
        hold.touch()
        stop = {"target": "tests.tasks:StopServer", "args": {"pgid": pgid, "port": port, "step": 3,
                                                              "tracking_uri": uri, "release": str(hold)}}
        cfg = config(tmp_path, "down", loggers, trainer={"max_steps": 8})
        cfg["task"]["args"] = {"hold": [str(hold), 5]}
        cfg["callbacks"] = [stop]
        with pytest.warns(RuntimeWarning, match=rf"logger mlflow \({uri}\)") as warned:
            result = raytrainer.train(cfg, progress=False)
    assert [e["event"] for e in result.events][-1] == "finished" and (result.run_dir / "model.pt").is_file()
    rows = read_jsonl(result.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 9))
    # Reported once when it fails, and once at the end with what it missed.
    messages = [str(w.message) for w in warned if "logger mlflow" in str(w.message)]
    assert len(messages) == 2, messages
    assert " failed in " in messages[0] and "MlflowException" in messages[0]
    assert "missed" in messages[1] and "every row is in metrics.jsonl" in messages[1]
    assert_no_leaks()


def test_a_logger_is_imported_only_when_configured_and_missing_packages_are_config_errors(monkeypatch):
    code = ("import sys, raytrainer.driver.api, raytrainer.driver.loggers as l; from raytrainer.config import LoggerConfig; "
            "sinks = l.build_loggers([LoggerConfig(type='tensorboard')], warn=print); [s.close() for s in sinks]; "
            "print(sorted(m for m in ('mlflow', 'wandb') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

    from raytrainer.driver import loggers
    from raytrainer.config import LoggerConfig

    monkeypatch.setattr(loggers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"loggers\[0\].type='wandb' needs the wandb package.*raytrainer\[wandb\]"):
        loggers.build_loggers([LoggerConfig(type="wandb")], warn=print)
    with pytest.raises(ConfigError, match=r"loggers\[0\].args do not fit 'tests.tasks:RecordingSink'"):
        loggers.build_loggers([LoggerConfig(target="tests.tasks:RecordingSink", args={"nope": 1})], warn=print)
