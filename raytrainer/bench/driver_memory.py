"""The driver's memory with a large model: its peak resident set through training, a
checkpoint, a recovery and the end, against the size of the training state.

    python -m raytrainer.bench.driver_memory [--state-gb 2.0] [--out driver_memory.json]

A driver process (python -m raytrainer.bench.driver_memory _driver ...) trains a model of
one square linear layer with SGD and momentum (training state: weights and momentum,
`--state-gb` in total) on 2 CPU workers of a local Ray it starts, with a checkpoint every
4 steps; once the first checkpoint is committed this process SIGKILLs rank 1, so the run
recovers from rank 0's state in memory; the run ends with model.pt. The driver reads its
own peak RSS (VmHWM) at the end. The figure does not depend on load; the run needs about
4x the state in RAM on the machine (two workers' weights, gradients and momentum, a
checkpoint's serialised copy, the state handed to the replacement).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..task import Task

TASK = "raytrainer.bench.driver_memory:BigStateTask"


class BigStateTask(Task):
    """y = W x for a random target W: one `width` x `width` layer, no bias."""

    def __init__(self, width: int, samples: int = 64):
        self.width, self.samples = width, samples

    def build_model(self):
        import torch

        return torch.nn.Linear(self.width, self.width, bias=False)

    def build_optimizer(self, model):
        import torch

        return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def train_dataset(self):
        import torch

        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.samples, self.width, generator=g)
        return torch.utils.data.TensorDataset(x, x.roll(1, dims=1))

    def train_step(self, model, batch):
        import torch

        x, y = batch
        return {"loss": torch.nn.functional.mse_loss(model(x), y)}


def width_for(state_gb: float) -> int:
    """The layer width whose weights and momentum (fp32) make `state_gb` GB (1e9 bytes)."""
    return int((state_gb * 1e9 / 8) ** 0.5) + 1


def config(storage: str, width: int, steps: int) -> dict[str, Any]:
    return {
        "task": {"target": TASK, "args": {"width": width}},
        "trainer": {"max_steps": steps, "global_batch_size": 8},
        "scaling": {"num_workers": 2},
        "checkpoint": {"every_n_steps": 4, "keep_last": 1},
        # No warm spare: its memory is not the driver's, and the machine needs the room.
        "failure": {"max_failures": 1, "warm_spares": 0},
        "run": {"name": "big", "storage": storage},
    }


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def driver_main(config_json: str, result_json: str) -> int:
    """The driver process: train, then report its peak RSS."""
    import raytrainer

    before = _peak_rss_bytes()
    result = raytrainer.train(json.loads(config_json), progress=False)
    Path(result_json).write_text(json.dumps({
        "driver_peak_rss_bytes": _peak_rss_bytes(), "driver_peak_rss_before_train_bytes": before,
        "events": [e["event"] for e in result.events],
        "recovered": [e for e in result.events if e["event"] == "recovered"],
    }))
    return 0


def measure(state_gb: float, steps: int = 12, timeout_s: float = 1800.0) -> dict[str, Any]:
    width = width_for(state_gb)
    with tempfile.TemporaryDirectory(prefix="rt-drvmem-") as work:
        cfg = config(work, width, steps)
        result = Path(work) / "result.json"
        env = dict(os.environ, RAY_ADDRESS="local")  # its own Ray, never one found on the machine
        driver = subprocess.Popen([sys.executable, "-m", "raytrainer.bench.driver_memory", "_driver",
                                   json.dumps(cfg), str(result)], env=env)
        events = Path(work) / "big" / "events.jsonl"
        killed_pid, deadline = None, time.monotonic() + timeout_s
        try:
            while driver.poll() is None:
                assert time.monotonic() < deadline, f"the run did not end within {timeout_s:g} s"
                rows = [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []
                if killed_pid is None and any(r["event"] == "checkpoint_committed" for r in rows):
                    killed_pid = next(r["pids"] for r in reversed(rows) if "pids" in r)[1]
                    os.kill(killed_pid, signal.SIGKILL)
                time.sleep(0.2)
        finally:
            if driver.poll() is None:
                driver.kill()
        if driver.returncode != 0:
            raise RuntimeError(f"the driver exited {driver.returncode}")
        out = json.loads(result.read_text())
        model_bytes = (Path(work) / "big" / "model.pt").stat().st_size
    out.update(state_gb=round(2 * width * width * 4 / 1e9, 3), width=width, model_pt_bytes=model_bytes,
               killed_pid=killed_pid, steps=steps,
               driver_peak_rss_gb=round(out["driver_peak_rss_bytes"] / 1e9, 3))
    return out


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if len(argv) == 3 and argv[0] == "_driver":
        return driver_main(argv[1], argv[2])
    parser = argparse.ArgumentParser(prog="python -m raytrainer.bench.driver_memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-gb", type=float, default=2.0, help="training state (weights and momentum), GB")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here too")
    args = parser.parse_args(argv)
    out = measure(args.state_gb, args.steps)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
