"""Command line: `raytrainer train CONFIG [--set section.key=value ...]`, `raytrainer resume RUN_DIR`,
`raytrainer bench`, `raytrainer plot RUN_DIR ...`, `raytrainer up|down|status` (the kept local Ray),
`raytrainer release RUN_DIR` (the workers a killed run left for a new driver), `raytrainer runs [STORAGE]`
and `raytrainer show RUN_DIR` (what run directories hold: driver/runs.py)."""

from __future__ import annotations

import argparse
import os
import sys

from .. import filesystems
from ..errors import ConfigError, RaytrainerError, Stopped, show_warnings_plainly


def _run_options(parser: argparse.ArgumentParser, example: str) -> None:
    """The options `train` and `resume` share."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override a config value, e.g. --set {example} (repeatable)")
    parser.add_argument("--address", help="Ray cluster to join (default: $RAY_ADDRESS, else a local Ray)")
    parser.add_argument("--no-progress", action="store_true", help="do not print the progress line")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raytrainer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train the task a YAML config describes")
    train.add_argument("config", help="path to a YAML config, e.g. configs/digits.yaml")
    _run_options(train, "trainer.max_epochs=3")
    train.add_argument("--fast-dev-run", type=int, nargs="?", const=2, metavar="N",
                       help="debug: N training steps (default 2) and N validation batches, then stop")
    train.add_argument("--overfit-batches", type=int, metavar="N",
                       help="debug: train on the same first N global batches every epoch")
    resume = sub.add_parser("resume", help="continue a run from its newest committed checkpoint")
    resume.add_argument("run_dir", help="the run directory, e.g. runs/digits-20261122-042535 or "
                        "s3://bucket/runs/digits-20261122-042535")
    _run_options(resume, "scaling.num_workers=1")
    bench = sub.add_parser("bench", help="time raytrainer against raw torch DDP and Ray Train")
    from ..bench import add_arguments

    add_arguments(bench)
    release = sub.add_parser("release", help="end at once the workers a killed run left waiting for a new driver "
                             "(failure.driver_grace_s)")
    release.add_argument("run_dir", help="the run directory, e.g. runs/digits-20261122-042535")
    release.add_argument("--address", help="Ray cluster the run ran on (default: $RAY_ADDRESS, else the local Ray)")
    sub.add_parser("up", help="start the local Ray that runs keep for the next ones, now (RAYTRAINER_KEEP_RAY)")
    down = sub.add_parser("down", help="stop every local Ray that runs keep for the next ones (all of this user's); "
                          "one a run is using is left up")
    down.add_argument("--force", action="store_true",
                      help="stop those a run is using too (the run loses what it did since its last checkpoint)")
    sub.add_parser("status", help="say which local Rays runs keep for the next ones, and where")
    plot = sub.add_parser("plot", help="PNG charts of one run, or several overlaid")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                      help="run directories, e.g. runs/digits-* or s3://bucket/runs/digits-...")
    plot.add_argument("--out", help="PNG path (default RUN_DIR/plot.png for one local run, NAME.png here for one "
                      "run at a URI, plot.png for several)")
    runs = sub.add_parser("runs", help="list the runs under a storage: name, state, step, goodput, where")
    runs.add_argument("storage", nargs="?", default="runs",
                      help="a run.storage: a directory (default: runs, run.storage's default) or a URI")
    show = sub.add_parser("show", help="one run's summary: config, last metrics, goodput ledger, failures")
    show.add_argument("run_dir", help="the run directory, e.g. runs/digits-20261122-042535 or s3://bucket/runs/NAME")
    return parser


def _resume_source(run_dir: str, overrides: list[str]) -> tuple[str | dict, list[str]]:
    """The run's own config.yaml (its path, or what a URI's holds), pointed back at the run
    directory, resume on."""
    storage, name = filesystems.split(run_dir)
    if "://" in run_dir:
        source = _remote_config(run_dir, storage, name)
    else:
        source = os.path.join(run_dir.rstrip("/"), "config.yaml")
        if not name or not os.path.isfile(source):
            raise ConfigError(f"{run_dir!r} is not a run directory (it has no config.yaml)")
    return source, [f"run.storage={storage or '.'}", f"run.name={name}", "run.resume=auto", *overrides]


def _remote_config(run_dir: str, storage: str, name: str) -> dict:
    """config.yaml of the run directory `run_dir`, a URI, read through its filesystem."""
    import yaml

    from ..checkpoint import Storage

    filesystems.check("RUN_DIR", run_dir)
    try:
        parent = Storage(storage)
        found = bool(name) and parent.exists(f"{name}/config.yaml")
        text = parent.read(f"{name}/config.yaml") if found else None
    except OSError as exc:
        raise ConfigError(f"{run_dir!r}: its config.yaml could not be read ({exc})") from None
    if text is None:
        raise ConfigError(f"{run_dir!r} is not a run directory (it has no config.yaml)")
    return yaml.safe_load(text) or {}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    show_warnings_plainly()
    prefix = "raytrainer" if args.command in ("train", "resume") else f"raytrainer {args.command}"
    try:
        commands = {"train": _train, "resume": _train, "bench": _bench, "plot": _plot, "up": _up, "down": _down,
                    "status": _status, "release": _release, "runs": _runs, "show": _show}
        return commands[args.command](args)
    except ConfigError as exc:
        print(f"{prefix}: config error: {exc}", file=sys.stderr)
        return 2
    except RaytrainerError as exc:
        print(f"{prefix}: {exc}", file=sys.stderr)
        return 1
    except Stopped as exc:  # a signal: stopped at a step boundary, with a checkpoint there
        print(f"{prefix}: {exc}", file=sys.stderr)
        if (command := exc.how_to_continue(getattr(args, "config", None))) is not None:
            print(f"{prefix}: continue with: {command}", file=sys.stderr)
        return 128 + exc.signum
    except KeyboardInterrupt:  # workers and bench contenders are stopped on the way out
        print(f"{prefix}: interrupted", file=sys.stderr)
        return 130


def _train(args: argparse.Namespace) -> int:
    from . import ledger
    from .api import train

    for flag in ("fast_dev_run", "overfit_batches"):
        if getattr(args, flag, None) is not None:
            args.overrides.append(f"trainer.{flag}={getattr(args, flag)}")
    if args.command == "resume":
        args.config, args.overrides = _resume_source(args.run_dir, args.overrides)
    result = train(args.config, args.overrides, address=args.address, progress=not args.no_progress)
    m = result.metrics
    shown = {k: v for k, v in m.items() if k not in ("step", "epoch", "world_size", "time")}
    print(f"finished {result.run_dir}: step {m.get('step')}, epoch {m.get('epoch', 0) + 1}")
    print("  " + "  ".join(f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()))
    print("\n".join("  " + line.strip() for line in ledger.of_dir(result.run_dir).lines()))
    recovered = [e for e in result.events if e["event"] == "recovered"]
    if recovered:  # by cause: the cluster's losses, the run's own faults (failure.max_losses, max_failures)
        last = recovered[-1]
        print(f"  recovered {len(recovered)} time(s): {last.get('losses', 0)} lost worker(s), "
              f"{last.get('faults', 0)} fault(s) of the run's own")
    return 0


def _runs(args: argparse.Namespace) -> int:
    from .runs import list_runs

    print("\n".join(list_runs(args.storage)))
    return 0


def _show(args: argparse.Namespace) -> int:
    from .runs import show

    print("\n".join(show(args.run_dir)))
    return 0


def _release(args: argparse.Namespace) -> int:
    from .api import release

    print(release(args.run_dir, address=args.address))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from ..bench import main as bench

    return bench(args)


def _up(args: argparse.Namespace) -> int:
    from .localray import keep_minutes, up

    print(f"a local Ray is up at {up()}: runs on this machine join it; it stops after {keep_minutes():g} idle "
          "minutes, or at `raytrainer down`")
    return 0


def _down(args: argparse.Namespace) -> int:
    from .localray import down

    said, all_down = down(force=args.force)
    print(said)
    return 0 if all_down else 1


def _status(args: argparse.Namespace) -> int:
    from .localray import status

    print(status())
    return 0


def _plot(args: argparse.Namespace) -> int:
    from .plot import plot_runs

    print(f"wrote {plot_runs(args.run_dirs, args.out).path.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
