"""Command line: `raytrainer train CONFIG [--set section.key=value ...]`."""

from __future__ import annotations

import argparse
import sys

from .errors import ConfigError, RaytrainerError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raytrainer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train the task a YAML config describes")
    train.add_argument("config", help="path to a YAML config, e.g. configs/digits.yaml")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set trainer.max_epochs=3 (repeatable)")
    train.add_argument("--address", help="Ray cluster to join (default: $RAY_ADDRESS, else a local Ray)")
    train.add_argument("--no-progress", action="store_true", help="do not print the progress line")
    bench = sub.add_parser("bench", help="time raytrainer against raw torch DDP and Ray Train")
    from .bench import add_arguments

    add_arguments(bench)
    plot = sub.add_parser("plot", help="PNG charts of one run, or several overlaid")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories, e.g. runs/digits-*")
    plot.add_argument("--out", help="PNG path (default RUN_DIR/plot.png for one run, plot.png for several)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in ("bench", "plot"):
        return _run_tool(args)
    from .api import train

    try:
        result = train(args.config, args.overrides, address=args.address, progress=not args.no_progress)
    except ConfigError as exc:
        print(f"raytrainer: config error: {exc}", file=sys.stderr)
        return 2
    except RaytrainerError as exc:
        print(f"raytrainer: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("raytrainer: interrupted; workers stopped", file=sys.stderr)
        return 130
    m = result.metrics
    shown = {k: v for k, v in m.items() if k not in ("step", "epoch", "world_size", "time")}
    print(f"finished {result.run_dir}: step {m.get('step')}, epoch {m.get('epoch', 0) + 1}")
    print("  " + "  ".join(f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()))
    return 0


def _run_tool(args: argparse.Namespace) -> int:
    try:
        if args.command == "bench":
            from .bench import main as bench

            return bench(args)
        from .plot import plot_runs

        print(f"wrote {plot_runs(args.run_dirs, args.out).path}")
        return 0
    except ConfigError as exc:
        print(f"raytrainer {args.command}: {exc}", file=sys.stderr)
        return 2
    except RaytrainerError as exc:
        print(f"raytrainer {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the bench has stopped its contender on the way out
        print(f"raytrainer {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
