"""A later run in the same Python process: with the workers' processes the run before kept
(driver/group/kept.py), and with new ones.

    python -m raytrainer.bench.again [--runs 6] [--workers 2] [--steps 16]

One process, one local Ray of its own (or the one it is connected to). Each round runs the
bench job three times: once with RAYTRAINER_KEEP_WORKERS=0 and nothing kept (new processes,
the "new" figure), then twice with keeping on, the second run taking the first's processes
(the "kept" figure). Figures: the run's wall time (`raytrainer.train` called to returned)
and its `group_formed` seconds (workers started or taken, the group formed), the median
over the rounds with the range, and kept over new.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

from .spec import BenchSpec


def measure(runs: int = 6, workers: int = 2, steps: int = 16) -> dict[str, Any]:
    import ray

    import raytrainer
    from ..driver.group import kept
    from .rt import config

    spec = asdict(BenchSpec(workers=workers))
    out: dict[str, list[tuple[float, float]]] = {"new": [], "kept": []}
    with _a_ray(ray), tempfile.TemporaryDirectory(prefix="raytrainer-again-") as work:
        count = [0]

        def run(keep_s: str) -> tuple[float, float]:
            count[0] += 1
            os.environ["RAYTRAINER_KEEP_WORKERS"] = keep_s
            t0 = time.monotonic()
            result = raytrainer.train(config(spec, Path(work), f"run-{count[0]}", steps), progress=False)
            seconds = time.monotonic() - t0
            formed = next(e for e in result.events if e["event"] == "group_formed")
            return seconds, formed["seconds"]

        before = os.environ.get("RAYTRAINER_KEEP_WORKERS")
        try:
            for _ in range(runs):
                kept.end_all()
                out["new"].append(run("0"))
                run("60")
                out["kept"].append(run("60"))
        finally:
            kept.end_all()
            if before is None:
                os.environ.pop("RAYTRAINER_KEEP_WORKERS", None)
            else:
                os.environ["RAYTRAINER_KEEP_WORKERS"] = before
    figures: dict[str, Any] = {"runs": runs, "workers": workers, "steps": steps}
    for name, pairs in out.items():
        for i, what in enumerate(("run_s", "formed_s")):
            values = sorted(p[i] for p in pairs)
            figures[f"{name}_{what}"] = {"median": statistics.median(values), "min": values[0], "max": values[-1]}
    figures["kept_over_new"] = figures["kept_run_s"]["median"] / figures["new_run_s"]["median"]
    return figures


@contextmanager
def _a_ray(ray: Any) -> Iterator[None]:
    if ray.is_initialized():
        yield
        return
    from ..driver.localray import settings

    with settings():
        ray.init(address="local", include_dashboard=False, logging_level="ERROR")
    try:
        yield
    finally:
        ray.shutdown()


def format_figures(figures: dict[str, Any]) -> str:
    def cell(key: str) -> str:
        f = figures[key]
        return f"{f['median']:.2f} ({f['min']:.2f}-{f['max']:.2f})"

    return "\n".join([
        f"A run of {figures['steps']} steps, {figures['workers']} workers; medians of {figures['runs']} rounds "
        "(min-max):",
        "| | new processes | kept processes |",
        "|---|---|---|",
        f"| the run, `raytrainer.train` called to returned (s) | {cell('new_run_s')} | {cell('kept_run_s')} |",
        f"| the group formed, `group_formed` seconds | {cell('new_formed_s')} | {cell('kept_formed_s')} |",
        f"kept over new (the run): {figures['kept_over_new']:.3f}x",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raytrainer.bench.again", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.workers < 1 or args.steps < 1:
        parser.error("--runs, --workers and --steps must be >= 1")
    figures = measure(args.runs, args.workers, args.steps)
    print(format_figures(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
