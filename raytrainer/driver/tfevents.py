"""TensorBoard event files, written without tensorboardX or torch.

tensorboardX imports torch, and a driver that imported it on its first row took CPU-seconds
from the workers' first steps on the same cores (bench/cpu.py shows where the CPU goes). The format is small: a TFRecord file (each record its length,
the length's masked CRC-32C, the data, the data's masked CRC-32C) of `Event` protocol
buffers, the first naming the file version, then one per row with its scalars
(tensorflow/core/util/event.proto, summary.proto). The fields are encoded here by hand.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    table = _TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= 0xFFFFFFFFFFFFFFFF  # int64 fields encode negatives as ten bytes
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int = 0, *, scalars: dict[str, float] | None = None,
          file_version: str | None = None) -> bytes:
    """An Event: wall_time (1, double), step (2, int64), file_version (3) or a Summary (5)
    of simple values (Summary.value 1: tag 1, simple_value 2, a float)."""
    out = b"\x09" + struct.pack("<d", wall_time)
    if step:
        out += b"\x10" + _varint(step)
    if file_version is not None:
        out += _field(3, file_version.encode())
    if scalars:
        values = b"".join(_field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", value))
                          for tag, value in scalars.items())
        out += _field(5, values)
    return out


def record(data: bytes) -> bytes:
    """One TFRecord."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", _masked(crc32c(length))) + data + struct.pack("<I", _masked(crc32c(data)))


class EventFile:
    """events.out.tfevents.<time>.<host> in `logdir`, flushed every `flush_s` seconds and
    at close (a reader sees the rows up to the last flush)."""

    def __init__(self, logdir: str | os.PathLike, flush_s: float = 10.0):
        Path(logdir).mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.path = Path(logdir) / f"events.out.tfevents.{int(now)}.{socket.gethostname()}"
        self._file = open(self.path, "ab")
        self.flush_s, self._flushed = flush_s, time.monotonic()
        self._file.write(record(event(now, file_version="brain.Event:2")))
        self._file.flush()

    def add(self, step: int, scalars: dict[str, float], wall_time: float | None = None) -> None:
        self._file.write(record(event(time.time() if wall_time is None else wall_time, step, scalars=scalars)))
        if time.monotonic() - self._flushed >= self.flush_s:
            self._file.flush()
            self._flushed = time.monotonic()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
