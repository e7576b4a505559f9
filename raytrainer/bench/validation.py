"""What async validation (trainer.validation.async) costs and saves, on the digits example:
`python -m raytrainer.bench.validation [--rounds 3] [--every 10] [--out FILE.json]`, run
from the repository root (examples/ must import).

Three runs side by side, interleaved over the rounds (the machine's load moves; compare
runs of one round): configs/digits.yaml with validation every N steps (and at epoch
ends) in the loop (sync), on validation actors (async), and with no validation set at
all (none). For each: steps/s from the first to the last training row; for sync, how
long each validation held the training thread (the step after it took that much more
than the median step); for async, how long the hand-over of the weights held it (the
`validated` events' held_s). One local Ray for all runs."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from examples.digits import DigitsTask


class DigitsWithoutValidation(DigitsTask):
    """The same task, split and training without a validation set."""

    def val_dataset(self):
        return None


def run(kind: str, every: int, storage: str, name: str) -> dict[str, Any]:
    import raytrainer
    from raytrainer.config import load_config

    overrides = [f"run.storage={storage}", f"run.name={name}", f"trainer.validation.every_n_steps={every}",
                 "loggers=[]"]
    if kind == "none":
        overrides.append("task.target=raytrainer.bench.validation:DigitsWithoutValidation")
    overrides.append(f"trainer.validation.async={'true' if kind == 'async' else 'false'}")
    cfg = load_config("configs/digits.yaml", overrides)
    started = time.monotonic()
    result = raytrainer.train(cfg, progress=False)
    wall = time.monotonic() - started
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r["time"] for r in rows if "loss" in r and "val_loss" not in r}
    val = sorted(r["step"] for r in rows if "val_loss" in r)
    steps = sorted(train)
    gaps = {s: train[s] - train[s - 1] for s in steps[1:]}
    step_s = statistics.median(gaps.values())
    out = {"kind": kind, "wall_s": round(wall, 2), "steps": steps[-1], "validations": len(val),
           "steps_per_s": round((steps[-1] - steps[0]) / (train[steps[-1]] - train[steps[0]]), 2),
           "median_step_s": round(step_s, 5), "final_val_acc": next((r.get("val_accuracy") for r in reversed(rows)
                                                                     if "val_loss" in r), None)}
    if kind == "sync":  # the step after a validation took the validation's time more
        held = [gaps[s + 1] - step_s for s in val if s + 1 in gaps]
        out["held_per_validation_s"] = round(statistics.median(held), 5) if held else None
    if kind == "async":
        events = [json.loads(line) for line in (result.run_dir / "events.jsonl").read_text().splitlines()]
        done = [e for e in events if e["event"] == "validated"]
        out["held_per_validation_s"] = round(statistics.median(e["held_s"] for e in done), 5) if done else None
        out["validation_latency_s"] = round(statistics.median(e["seconds"] for e in done), 3) if done else None
        out["arrived_steps_later"] = statistics.median(e["at_step"] - e["step"] for e in done) if done else None
    return out


def main() -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    for attempt in range(3):  # a loaded machine's raylet may miss Ray's start-up timeout
        try:
            ray.init(address="local", include_dashboard=False, log_to_driver=False, logging_level="WARNING")
            break
        except Exception:
            if attempt == 2:
                raise
            ray.shutdown()
    results: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory() as storage:
            for round_ in range(args.rounds):
                for kind in ("none", "sync", "async"):
                    out = run(kind, args.every, storage, f"{kind}-{round_}")
                    out["round"] = round_
                    print(json.dumps(out), flush=True)
                    results.append(out)
    finally:
        ray.shutdown()
    by = {kind: [r for r in results if r["kind"] == kind] for kind in ("none", "sync", "async")}
    summary = {}
    for round_ in range(args.rounds):
        none, sync, async_ = (by[k][round_] for k in ("none", "sync", "async"))
        summary.setdefault("sync_over_none", []).append(round(sync["steps_per_s"] / none["steps_per_s"], 3))
        summary.setdefault("async_over_none", []).append(round(async_["steps_per_s"] / none["steps_per_s"], 3))
        summary.setdefault("async_over_sync", []).append(round(async_["steps_per_s"] / sync["steps_per_s"], 3))
        if sync.get("held_per_validation_s") and async_.get("held_per_validation_s") is not None:
            summary.setdefault("async_hold_over_sync_hold", []).append(
                round(async_["held_per_validation_s"] / sync["held_per_validation_s"], 4))
    print(json.dumps({"summary": summary}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": results, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
