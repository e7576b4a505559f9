"""The TensorBoard file holds every numeric metric of every row, at its step; a logger on
its own thread never holds the driver up, and says once what went wrong; the console says
each recovery."""

import io
import json
import struct
import threading

import pytest

from tensorboardX.proto.event_pb2 import Event

from raytrainer.driver.metrics import BackgroundSink, MetricsHub, ProgressBar, RunInfo, SinkStates, TensorBoardSink


def read_events(path):
    """The Event records of a TFRecord file: length, its CRC, the data, the data's CRC."""
    data, events, at = path.read_bytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at:at + 8])
        events.append(Event.FromString(data[at + 12:at + 12 + length]))
        at += 12 + length + 4
    return events


def test_tensorboard_gets_every_scalar_of_every_row(tmp_path):
    sink = TensorBoardSink(tmp_path)
    sink.write({"step": 1, "time": 100.0, "epoch": 0, "loss": 0.5, "lr": 0.1, "note": "text"})
    sink.write({"step": 2, "time": 101.0, "epoch": 0, "loss": 0.25, "val_loss": 0.75})
    sink.close()
    (path,) = tmp_path.glob("events.out.tfevents.*")
    events = [e for e in read_events(path) if e.summary.value]
    assert [(e.step, e.wall_time) for e in events] == [(1, 100.0), (2, 101.0)]  # one per row
    scalars = {(e.step, v.tag): v.simple_value for e in events for v in e.summary.value}
    assert scalars == pytest.approx({  # simple_value is a float32
        (1, "run/epoch"): 0.0, (1, "train/loss"): 0.5, (1, "run/lr"): 0.1,
        (2, "run/epoch"): 0.0, (2, "train/loss"): 0.25, (2, "val/loss"): 0.75,
    })


class Sink:
    """A logger for the BackgroundSink tests: records its calls; `fail` names the rows whose
    write raises; `hold` (an Event) keeps open() waiting until it is set."""

    def __init__(self, fail=(), fail_open=False, hold=None):
        self.calls, self.fail, self.fail_open, self.hold = [], set(fail), fail_open, hold
        self.opened = threading.Event()

    def open(self, run):
        self.opened.set()
        if self.hold is not None:
            self.hold.wait()
        if self.fail_open:
            raise ConnectionError("tracking server down")
        self.calls.append("open")

    def write(self, row):
        if row["step"] in self.fail:
            raise ConnectionError(f"lost row {row['step']}")
        self.calls.append(row["step"])

    def close(self):
        self.calls.append("close")


def rows(steps):
    return [{"step": s, "epoch": 0, "loss": 1.0 / s} for s in steps]


def test_a_failing_logger_is_reported_once_and_keeps_getting_rows(tmp_path):
    sink, warned = Sink(fail={2, 3}), []
    hub = MetricsHub([BackgroundSink(sink, "flaky", warn=warned.append)], RunInfo(tmp_path, "run", {}))
    for step in range(1, 6):
        hub.write(rows([step]))
    hub.close()
    assert sink.calls == ["open", 1, 4, 5, "close"]
    assert len(warned) == 2, warned  # when it first fails, and what it missed at the end
    assert warned[0].startswith("logger flaky failed in write (ConnectionError: lost row 2)")
    assert "2 calls failed" in warned[1] and "missed 2 metric rows" in warned[1]


def test_a_logger_that_cannot_start_is_off_and_says_so_once(tmp_path):
    sink, warned = Sink(fail_open=True), []
    hub = MetricsHub([BackgroundSink(sink, "down", warn=warned.append)], RunInfo(tmp_path, "run", {}))
    hub.write(rows(range(1, 4)))
    hub.close()
    assert sink.calls == ["close"]  # no row reached it
    assert len(warned) == 1 and "logger down could not start (ConnectionError: tracking server down)" in warned[0]


def test_a_stuck_logger_never_holds_the_driver_up(tmp_path):
    """A logger that hangs (a server that never answers): the driver's writes only queue,
    rows beyond the bound are dropped and counted, and close gives up after its timeout."""
    release, warned = threading.Event(), []
    sink = Sink(hold=release)
    logger = BackgroundSink(sink, "stuck", warn=warned.append, max_rows=3, close_timeout_s=0.2)
    hub = MetricsHub([logger], RunInfo(tmp_path, "run", {}))
    sink.opened.wait()  # its thread is inside open() now, and stays there
    hub.write(rows(range(1, 11)))  # returns: were it to wait for the logger, the test would hang here
    assert (logger.rows_dropped, logger.rows_missed) == (7, 7)
    hub.close()
    release.set()
    assert logger.rows_missed == 10
    assert warned[0] == "logger stuck is 3 rows behind; dropping rows until it catches up; every row is in metrics.jsonl"
    assert "7 rows were dropped" in warned[1] and "did not finish within 0.2 s (close_timeout_s)" in warned[1]
    assert "missed 10 metric rows" in warned[1] and len(warned) == 2


def test_a_users_logger_needs_only_the_methods_it_uses(tmp_path):
    class WriteOnly:
        def __init__(self):
            self.rows = []

        def write(self, row):
            self.rows.append(row)

    sink, warned = WriteOnly(), []
    hub = MetricsHub([BackgroundSink(sink, "mine", warn=warned.append)], RunInfo(tmp_path, "run", {}))
    hub.write(rows([1, 2]))
    hub.event({"event": "finished", "step": 2, "time": 0.0})
    hub.artifact(tmp_path / "model.pt", "model")
    hub.close()
    assert sink.rows == rows([1, 2]) and warned == []


def test_sink_states_keep_what_a_resumed_run_continues_from(tmp_path):
    SinkStates(tmp_path).put("mlflow http://x", {"run_id": "abc"})
    info = RunInfo(tmp_path, "run", {}, resumed=True, states=SinkStates(tmp_path))
    assert info.saved("mlflow http://x") == {"run_id": "abc"} and info.saved("wandb /p") == {}
    info.remember("wandb /p", {"id": "w1"})
    assert json.loads((tmp_path / "loggers.json").read_text()) == {
        "mlflow http://x": {"run_id": "abc"}, "wandb /p": {"id": "w1"}}


def test_the_console_gone_is_no_error_of_the_run():
    """A terminal hung up (EIO), a pipe closed (`raytrainer train ... | head`): the bar stops
    drawing and the run goes on."""
    class Gone(io.StringIO):
        def write(self, text):
            raise OSError(5, "Input/output error")

    bar = ProgressBar(10, stream=Gone(), interval_s=0.0)
    bar.write({"step": 1, "epoch": 0, "loss": 0.5, "world_size": 2})
    bar.event({"event": "recovered", "step": 1, "seconds": 0.04, "steps_lost": 0, "failures": 1,
               "source_rank": 0, "state_from": "memory"})
    bar.write({"step": 2, "epoch": 0, "loss": 0.4, "world_size": 2})
    bar.close()
    assert bar.stream is None


def test_the_console_says_each_recovery_with_the_failures_it_recovered_from():
    stream = io.StringIO()
    bar = ProgressBar(10, stream=stream, interval_s=0.0)
    bar.write({"step": 3, "epoch": 0, "loss": 0.5, "world_size": 2})
    died = {"event": "worker_failed", "step": 3, "rank": 1, "node": "10.0.0.2", "kind": "died",
            "cause": "the worker process died (ActorDiedError): The actor died unexpectedly"}
    bar.event(died)
    assert "died" not in stream.getvalue()  # not yet: a failure the run ends on is its error
    bar.event({"event": "recovered", "step": 3, "seconds": 0.04, "steps_lost": 0, "failures": 1,
               "source_rank": 0, "state_from": "memory"})
    bar.event({"event": "resized", "step": 3, "old_world_size": 2, "new_world_size": 1, "seconds": 0.04,
               "cause": "failure: rank 1 died"})
    bar.event({"event": "checkpoint_committed", "step": 3, "path": "x"})
    assert stream.getvalue().splitlines()[1:] == [
        "raytrainer: rank 1 (10.0.0.2) died at step 3: the worker process died (ActorDiedError): The actor died "
        "unexpectedly",
        "raytrainer: recovered at step 3 in 0.04 s from rank 0's state in memory, 0 step(s) lost "
        "(1 failure(s) so far)",
        "raytrainer: 2 -> 1 workers at step 3 (paused 0.04 s): failure: rank 1 died"]
    # A user's error: its first line, and where its traceback is; then a recovery from storage.
    stream.seek(0)
    stream.truncate()
    bar.event({"event": "worker_failed", "step": 7, "rank": 0, "node": "10.0.0.1", "kind": "error",
               "cause": "ValueError: bad batch\nmore", "traceback": "Traceback ...\nValueError: bad batch"})
    bar.event({"event": "recovered", "step": 5, "seconds": 1.5, "steps_lost": 2, "failures": 2, "losses": 1,
               "faults": 1, "state_from": "checkpoint", "from_checkpoint": "step-00000005"})
    assert stream.getvalue().splitlines() == [
        "raytrainer: rank 0 (10.0.0.1) failed at step 7: ValueError: bad batch (its traceback: events.jsonl)",
        "raytrainer: recovered at step 5 in 1.50 s from checkpoint step-00000005, 2 step(s) lost "
        "(so far 1 lost worker(s), 1 fault(s))"]
    # The failure the run ends on: nothing here, the run raises it.
    stream.seek(0)
    stream.truncate()
    bar.event(died)
    bar.event({"event": "failed", "step": 3, "error": "x"})
    bar.event({"event": "left_node", "step": 4, "ranks": [1], "node": "10.0.0.2", "reason": "preempted"})
    assert stream.getvalue().splitlines() == ["raytrainer: ranks [1] left node 10.0.0.2 at step 4: preempted"]
