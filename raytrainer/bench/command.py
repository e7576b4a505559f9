"""`raytrainer bench`'s options and its printed report."""

from __future__ import annotations

import argparse
import signal
import sys

from .report import cpu_lines, format_table, recovery_lines, settings_lines
from .run import exit_on_sigterm, run_bench
from .spec import FSDP_SCENARIOS, SMOKE, BenchSpec


OPTIONS: dict[str, str | None] = {
    "workers": "workers per contender (CPU, Gloo)",
    "hidden": "MLP hidden width",
    "layers": "MLP hidden layers",
    "global_batch_size": None,
    "samples": "training set size",
    "steps": "optimizer steps of the train runs (raw DDP, raytrainer)",
    "steady_from": "share of a train run's steps after which steps/s is counted (the rest is start-up)",
    "ray_train_steps": "optimizer steps for Ray Train",
    "ray_train_poll_s": "Ray Train's controller poll (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S; Ray's default 2 s): "
                        "its report() waits for it",
    "window_steps": "steps per window: steady-state steps/s is the median of such windows' rates",
    "cpu_sample_s": "how often the CPU time of each process of a run is read (0: never; the CPU table)",
    "repetitions": None,
    "checkpoint_mb": "model size (MB) of the stall runs",
    "stall_steps": "optimizer steps of each stall run",
    "stall_checkpoint_every": "checkpoint cadence of the stall runs",
    "kill_steps": "optimizer steps of the kill runs",
    "kill_step": "the step at which one worker is SIGKILLed in the kill runs",
    "kill_checkpoint_every": "checkpoint (and Ray Train report) cadence in the kill runs",
    "kill_pace_s": "least time of each step of the kill runs (so that the kill lands in steady state)",
    "grow_steps": "optimizer steps of the grow run",
    "input_steps": "optimizer steps of the input runs with loader processes",
    "input_steps_no_loaders": "optimizer steps of raytrainer's input run with data.num_workers 0",
    "input_workers": "loader processes per rank in the input runs",
    "input_io_ms": "I/O latency per sample in the input runs",
    "faults_workers": "workers of the faults runs",
    "faults_count": "faults of the faults run, from outside at random moments (kills, kills right after a "
                    "recovery, double kills, kills of rank 0, freezes, in turn)",
    "faults_steps": "optimizer steps of the faults run and its undisturbed twin",
    "node_steps": "optimizer steps of the node run (a node lost from an elastic run)",
    "node_window_steps": "unpaced steps at 2 workers measured before the node is lost and after",
    "faults_step_timeout_s": "failure.step_timeout_s of the faults runs (how long a freeze goes unnoticed)",
    "scenarios": "comma-separated subset of train (start-up, steps/s), join (start-up of a later run, "
                 "joining the local Ray the first one kept), kill (worker SIGKILL), stall "
                 "(checkpoint stall), grow (elastic grow), input (slow dataset, loader processes), faults "
                 "(faults at random moments in one run, a node lost from an elastic run), peers (--strategy fsdp: recovery from peer snapshots and from a "
                 "checkpoint, the snapshots' cost)",
    "timeout_s": "per contender run",
    "parallel": "contender runs at a time (above 1 their figures mean nothing: for checking that the "
                "bench works; the kill and faults runs run one at a time)",
    "strategy": "ddp, or fsdp: raw FSDP2 against raytrainer with trainer.strategy: fsdp (the train and "
                "peers scenarios, the default --scenarios then)",
}
"""The BenchSpec fields the command line sets (--kebab-case of the name), with their help."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = BenchSpec()
    for key, text in OPTIONS.items():
        default = getattr(defaults, key)
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(default), default=default, help=text)
    parser.add_argument("--smoke", action="store_true",
                        help="a few steps, one repetition, a tiny model: checks the bench works")
    parser.add_argument("--out", help="also write the report as JSON to this path")


def spec_from_args(args: argparse.Namespace) -> BenchSpec:
    values = {key: getattr(args, key) for key in OPTIONS}
    if values["strategy"] != "ddp" and values["scenarios"] == BenchSpec().scenarios:
        values["scenarios"] = ",".join(FSDP_SCENARIOS)  # what a strategy other than DDP measures
    if args.smoke:
        default = BenchSpec()
        values.update({k: v for k, v in SMOKE.items() if values[k] == getattr(default, k)})
    return BenchSpec(**values)


def main(args: argparse.Namespace) -> int:
    # SIGTERM (a `kill`, a CI job's time limit) unwinds as Ctrl-C does, through run.launch's
    # `finally`: each contender running is stopped with everything it started. By default
    # it would end this process alone, and the contenders, each in a session of its own,
    # would train on with their Rays.
    previous = signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        report = run_bench(spec_from_args(args), out=args.out, log=lambda s: print(s, file=sys.stderr, flush=True))
    finally:
        signal.signal(signal.SIGTERM, previous)
    m = report["machine"]
    print(f"{m['cpu']}, {m['cores']} cores; torch {m['torch']}, ray {m['ray']}; "
          f"{report['settings']['workers']} CPU workers, Gloo; medians of "
          f"{report['settings']['repetitions']} repetition(s)")
    print(format_table(report))
    if lines := cpu_lines(report):
        print("\n".join(lines))
    if lines := settings_lines(report):
        print("\n" + "\n".join(lines))
    for note in report["notes"]:
        print(f"\n{note}")
    for run in (r for r in report["runs"] if r.get("scenario") == "faults"):
        print(f"\nFaults run {run['repetition'] + 1} (load average {run['load_before']:.2f} before it):")
        for line in recovery_lines(run):
            print(f"- {line}")
    if args.out:
        print(f"wrote {args.out}")
    return 0
