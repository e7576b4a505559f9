"""The TensorBoard file holds every numeric metric of every row, at its step."""

import struct

import pytest

from tensorboardX.proto.event_pb2 import Event

from raytrainer.metrics import TensorBoardSink


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
