"""The figures: what each one reads from a contender's run, its target, the summary of
all runs (medians, ratios, targets met), and how the report is printed."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable

from .faults import (DOUBLE_KILL_GAP_S, FAULT_KINDS, FAULT_TITLES, FAULTS_COLLECTIVE_TIMEOUT_S, NODE_PACE_S,
                     RANDOM_DELAY_S, RECOVERY_GOAL_S)
from .cpu import OUTSIDE, ROLES, per_1000_steps, spread, window_rates
from .kill import GROW_PACE_S
from .spec import CONTENDERS, LABELS, BenchSpec, rate


@dataclass(frozen=True)
class Figure:
    key: str
    title: str
    unit: str
    better: str  # "lower" | "higher"
    contenders: tuple[str, ...]
    extract: Callable[[dict[str, Any]], float | None]
    """Value of one contender run (None: the run does not measure it)."""
    target: str | None = None
    target_check: Callable[[dict[str, float], dict[str, float]], bool] | None = None
    """(medians, ratios) -> met; not called while a value it reads is missing."""
    scenario: str = "train"
    """The measurement that produces it (BenchSpec.scenarios)."""
    met_in_run: Callable[[dict[str, Any]], bool] | None = None
    """Whether one run met the target, where the target holds for every run (not for the
    median): target_met is then whether all did, and met_runs says how many."""
    fmt: Callable[[float], str] | None = None
    """How the table shows a value, if not as a number."""


def _train_run(run: dict[str, Any], scenario: str = "train") -> bool:
    """Whether a run is a plain training run of `scenario` (train, or join: not a kill run,
    a stall run, ...)."""
    return "step_times" in run and run.get("scenario", "train") == scenario


def start_to_first_step(run: dict[str, Any], scenario: str = "train") -> float | None:
    """From launching the contender's process to its first finished step: a train run's,
    or a join run's (raytrainer joining a running Ray)."""
    return run["step_times"][0] - run["launched"] if _train_run(run, scenario) else None


def _joined_start(run: dict[str, Any]) -> float | None:
    """raytrainer's start joining a running Ray, against raw DDP's own start (it has no Ray)."""
    return start_to_first_step(run, "train" if run["contender"] == "raw" else "join")


def _steady_from(run: dict[str, Any]) -> int:
    """The index of a train run's first steady-state step time."""
    times = run["step_times"]
    return min(int(len(times) * run.get("steady_from", run["warmup_fraction"])), len(times) - 2)


def steady_windows(run: dict[str, Any]) -> list[float] | None:
    """The steps/s of consecutive window_steps-step windows from steady_from on."""
    if not _train_run(run):
        return None
    return window_rates(run["step_times"][_steady_from(run):], run.get("window_steps", 200))


def steady_steps_per_s(run: dict[str, Any]) -> float | None:
    """The median of the steady windows' rates (the first seconds are start-up): a slow
    second of the machine moves one window, not the figure."""
    windows = steady_windows(run)
    return statistics.median(windows) if windows else None


def cpu_windows(run: dict[str, Any]) -> dict[str, tuple[float, float, int]]:
    """The parts of a run whose CPU the report counts, by the key they go under, as
    (start, end, steps): "cpu", a train run's steady state, an input run's steps after the
    warm-up, the stall runs' training (sync, then async), any other run's training;
    "cpu_startup", a train run's steps before its steady state (where Ray's daemons settle
    and the warm spare starts)."""
    times = run.get("step_times") or []
    if len(times) < 2:
        return {}
    if _train_run(run):
        first = _steady_from(run)
        out = {"cpu_startup": (times[0], times[first], first)} if first > 0 else {}
        return {**out, "cpu": (times[first], times[-1], len(times) - 1 - first)}
    if run.get("scenario") == "stall" and run.get("async_step_times"):  # both runs, the async writer's too
        after = run["async_step_times"]
        return {"cpu": (times[0], after[-1], len(times) + len(after) - 2)}
    first = min(int(len(times) * run["warmup_fraction"]), len(times) - 2) if run.get("scenario") == "input" else 0
    return {"cpu": (times[first], times[-1], len(times) - 1 - first)}


def early_steps_per_s(run: dict[str, Any]) -> float | None:
    """Over the first tenth of the steps, less its own warm-up share: what start-up costs
    the first seconds of training."""
    if not _train_run(run):
        return None
    return rate(run["step_times"][:max(len(run["step_times"]) // 10, 3)], run["warmup_fraction"])


def input_steps_per_s(run: dict[str, Any]) -> float | None:
    if run.get("scenario") != "input":
        return None
    return rate(run["step_times"], run["warmup_fraction"])


def _loader_speedup(run: dict[str, Any]) -> float | None:
    if run.get("scenario") != "input" or "no_loaders_steps_per_s" not in run:
        return None
    return input_steps_per_s(run) / run["no_loaders_steps_per_s"]


def _faults(key: str) -> Callable[[dict[str, Any]], float | None]:
    """A figure of a faults run (None for any other run)."""
    return lambda run: run.get(key) if run.get("scenario") == "faults" else None


def _node(key: str) -> Callable[[dict[str, Any]], float | None]:
    """A figure of a faults run's node run."""
    return lambda run: run["node"].get(key) if run.get("scenario") == "faults" and "node" in run else None


def _weights(run: dict[str, Any]) -> float | None:
    """2: bit-identical to the undisturbed run's, 1: within float tolerance, 0: neither."""
    if run.get("scenario") != "faults" or "bit_identical" not in run:
        return None
    return 2.0 if run["bit_identical"] else 1.0 if run["within_tolerance"] else 0.0


def _goal(value: float | None, goal: float) -> bool:
    return value is not None and value <= goal


def _peers_kill(run: str, title: str, target_s: float, prefix: str = "fsdp: ") -> tuple[Figure, Figure]:
    """A peers-scenario kill run's two rows: kill to first step (target: <= target_s) and the
    steps replayed (target: <= the snapshot interval in use at the kill)."""
    return (Figure(f"{run}_kill_to_first_step_s", title, "s", "lower", ("raytrainer",),
                   lambda r: r.get(f"{run}_kill_to_first_step_s"), target=f"<= {target_s:g} s",
                   target_check=lambda m, r: m["raytrainer"] <= target_s, scenario="peers"),
            Figure(f"{run}_steps_replayed", f"{prefix}steps replayed after it", "steps", "lower", ("raytrainer",),
                   lambda r: r.get(f"{run}_steps_replayed"), target="<= the snapshot interval",
                   met_in_run=lambda r: r[f"{run}_steps_replayed"] <= r[f"{run}_snapshot_interval"],
                   scenario="peers"))


FAULT_FIGURES = (
    Figure("recovery_p50_s", "faults at random moments: fault (a freeze: its detection) to first step after, p50",
           "s", "lower", ("raytrainer",), _faults("recovery_p50_s"), scenario="faults"),
    Figure("recovery_p95_s", "the same, p95", "s", "lower", ("raytrainer",), _faults("recovery_p95_s"),
           target=f"<= {RECOVERY_GOAL_S:g} s", met_in_run=lambda run: _goal(run["recovery_p95_s"], RECOVERY_GOAL_S),
           scenario="faults"),
    Figure("recovery_max_s", "the same, max", "s", "lower", ("raytrainer",), _faults("recovery_max_s"),
           target=f"<= {RECOVERY_GOAL_S:g} s", met_in_run=lambda run: _goal(run["recovery_max_s"], RECOVERY_GOAL_S),
           scenario="faults"),
    Figure("steps_lost_total", "steps lost over all those faults", "steps", "lower", ("raytrainer",),
           _faults("steps_lost_total"), target="0", met_in_run=lambda run: run["steps_lost_total"] == 0,
           scenario="faults"),
    Figure("regrow_pause_max_s", "pause to take lost workers' replacements back in (a grow), max", "s", "lower",
           ("raytrainer",), _faults("regrow_pause_max_s"), target="<= 1 s",
           met_in_run=lambda run: run["regrow_pause_max_s"] is None or run["regrow_pause_max_s"] <= 1,
           scenario="faults"),
    Figure("faults_weights", "final weights of the faulted run against an undisturbed one", "match", "higher",
           ("raytrainer",), _weights, scenario="faults",
           fmt=lambda v: "bit-identical" if v == 2 else "within tolerance" if v >= 1 else "differ"),
    Figure("faults_loss_ratio", "its mean loss over the last tenth of the steps, over the undisturbed run's", "x",
           "lower", ("raytrainer",), _faults("loss_ratio_last_tenth"), scenario="faults"),
    Figure("node_lost_to_first_step_s", "a node lost from an elastic run: loss to first step after", "s", "lower",
           ("raytrainer",), lambda run: _node("fault")(run) and run["node"]["fault"]["recovery_s"],
           target=f"<= {RECOVERY_GOAL_S:g} s",
           met_in_run=lambda run: _goal(run["node"]["fault"]["recovery_s"], RECOVERY_GOAL_S), scenario="faults"),
    Figure("node_after_over_before", "steps/s at 2 workers after the node was lost, over before it", "x",
           "higher", ("raytrainer",), _node("after_over_before"), target=">= 0.8x",
           met_in_run=lambda run: run["node"]["after_over_before"] >= 0.8, scenario="faults"),
    Figure("node_regrow_pause_s", "pause to grow back once a node joins again", "s", "lower", ("raytrainer",),
           _node("regrow_pause_s"), target="<= 1 s", met_in_run=lambda run: _goal(run["node"]["regrow_pause_s"], 1),
           scenario="faults"),
)


FIGURES = (
    Figure("start_to_first_step_s", "process start to first finished step", "s", "lower",
           CONTENDERS, start_to_first_step, target="<= 1.5x raw DDP",
           target_check=lambda m, r: r["raytrainer/raw"] <= 1.5),
    Figure("start_joined_s", "the same, a later run (joining the local Ray the first one kept)", "s", "lower",
           ("raw", "raytrainer"), _joined_start, target="<= 1.1x raw DDP",
           target_check=lambda m, r: r["raytrainer/raw"] <= 1.1, scenario="join"),
    Figure("steps_per_s", "steady-state steps/s, metrics to the driver every step", "steps/s",
           "higher", CONTENDERS, steady_steps_per_s, target=">= 0.95x raw DDP",
           target_check=lambda m, r: r["raytrainer/raw"] >= 0.95),
    Figure("early_steps_per_s", "the same over the first tenth of the steps (start-up)", "steps/s",
           "higher", CONTENDERS, early_steps_per_s),
    # Raw DDP has no recovery: a lost worker ends its run (its column shows "-").
    Figure("kill_to_first_step_s", "worker SIGKILL to first step after recovery", "s", "lower",
           ("ray_train", "raytrainer"), lambda run: run.get("kill_to_first_step_s"),
           target="<= 5 s and <= 0.25x Ray Train",
           target_check=lambda m, r: m["raytrainer"] <= 5 and r["raytrainer/ray_train"] <= 0.25,
           scenario="kill"),
    Figure("steps_lost", "steps lost to a worker SIGKILL", "steps", "lower",
           ("ray_train", "raytrainer"), lambda run: run.get("steps_lost"), target="<= 1",
           target_check=lambda m, r: m["raytrainer"] <= 1, scenario="kill"),
    # Ray Train's resize restarts its whole group from the last checkpoint: see figure 3.
    Figure("grow_pause_s", "pause to grow the group by one worker", "s", "lower",
           ("raytrainer",), lambda run: run.get("grow_pause_s"), scenario="grow"),
    Figure("input_steps_per_s", "steps/s on a slow dataset (I/O + decode per sample), k loader processes",
           "steps/s", "higher", ("raw", "raytrainer"), input_steps_per_s, target=">= 0.95x raw DDP",
           target_check=lambda m, r: r["raytrainer/raw"] >= 0.95, scenario="input"),
    Figure("input_loader_speedup", "raytrainer steps/s on it, k loader processes over data.num_workers 0",
           "x", "higher", ("raytrainer",), _loader_speedup, target=">= 3x",
           target_check=lambda m, r: m["raytrainer"] >= 3, scenario="input"),
    Figure("checkpoint_stall_sync_s", "training stall per checkpoint, sync", "s", "lower",
           ("raytrainer",), lambda run: run.get("checkpoint_stall_sync_s"), scenario="stall"),
    Figure("checkpoint_stall_async_s", "training stall per checkpoint, async", "s", "lower",
           ("raytrainer",), lambda run: run.get("checkpoint_stall_async_s"), scenario="stall"),
    Figure("checkpoint_stall_ratio", "the same, async over sync", "x", "lower", ("raytrainer",),
           lambda run: (run["checkpoint_stall_async_s"] / run["checkpoint_stall_sync_s"]
                        if run.get("checkpoint_stall_sync_s") else None),
           target="<= 0.15x", target_check=lambda m, r: m["raytrainer"] <= 0.15, scenario="stall"),
    Figure("checkpoint_held_sync_s", "training thread held per checkpoint, sync", "s", "lower",
           ("raytrainer",), lambda run: run.get("checkpoint_held_sync_s"), scenario="stall"),
    Figure("checkpoint_held_async_s", "training thread held per checkpoint, async (the copy)", "s", "lower",
           ("raytrainer",), lambda run: run.get("checkpoint_held_async_s"), scenario="stall"),
    *FAULT_FIGURES,
    *_peers_kill("peers", "fsdp: worker SIGKILL to first step after, from peer snapshots", 5),
    *_peers_kill("fast", "fsdp, no spare: SIGKILL to first step, the survivors re-sharded", 1, "fsdp, no spare: "),
    Figure("fast_grow_pause_s", "fsdp, no spare: pause to take the replacement back in", "s", "lower",
           ("raytrainer",), lambda run: run.get("fast_grow_pause_s"), target="<= 1 s",
           target_check=lambda m, r: m["raytrainer"] <= 1, scenario="peers"),
    Figure("exact_kill_to_first_step_s", "fsdp, recovery exact: SIGKILL to first step, the replacement waited for",
           "s", "lower", ("raytrainer",), lambda run: run.get("exact_kill_to_first_step_s"), scenario="peers"),
    Figure("exact_steps_replayed", "fsdp, recovery exact: steps replayed after it", "steps", "lower",
           ("raytrainer",), lambda run: run.get("exact_steps_replayed"), scenario="peers"),
    Figure("checkpoint_kill_to_first_step_s", "fsdp: the same, from the newest checkpoint (snapshots off)", "s",
           "lower", ("raytrainer",), lambda run: run.get("checkpoint_kill_to_first_step_s"), scenario="peers"),
    Figure("checkpoint_steps_lost", "fsdp: steps lost to it from the checkpoint", "steps", "lower",
           ("raytrainer",), lambda run: run.get("checkpoint_steps_lost"), scenario="peers"),
    Figure("snapshot_overhead", "fsdp: steps/s lost to peer snapshots at the default interval", "%", "lower",
           ("raytrainer",), lambda run: 100 * run["snapshot_overhead"] if "snapshot_overhead" in run else None,
           target="<= 3%", target_check=lambda m, r: m["raytrainer"] <= 3, scenario="peers"),
)

FIGURE_BY_KEY = {fig.key: fig for fig in FIGURES}


def summarize(runs: list[dict[str, Any]], scenarios: list[str] | None = None) -> list[dict[str, Any]]:
    """One entry per figure: per-contender values and medians, ratios, target. Figures of a
    scenario not in `scenarios` (all, if None) are "not measured (not run)"."""
    out = []
    for fig in FIGURES:
        entry: dict[str, Any] = {"key": fig.key, "title": fig.title, "unit": fig.unit,
                                 "better": fig.better, "contenders": list(fig.contenders),
                                 "target": fig.target}
        if scenarios is not None and fig.scenario not in scenarios:
            entry.update(status="not measured", reason=f"not run: --scenarios {fig.scenario}", values=None,
                         medians=None, ratios=None, target_met=None)
            out.append(entry)
            continue
        values = {c: [v for r in runs if r["contender"] == c and (v := fig.extract(r)) is not None]
                  for c in fig.contenders}
        medians = {c: statistics.median(v) for c, v in values.items() if v}
        ratios = {f"raytrainer/{c}": medians["raytrainer"] / medians[c]
                  for c in fig.contenders if c != "raytrainer" and medians.get(c) and "raytrainer" in medians}
        try:
            met = fig.target_check(medians, ratios) if fig.target_check else None
        except KeyError:  # a contender is missing (or its median is 0 and has no ratio)
            met = None
        if fig.met_in_run is not None:
            flags = [fig.met_in_run(r) for r in runs if r.get("scenario") == fig.scenario
                     and r.get("contender") == "raytrainer" and fig.extract(r) is not None]
            met = all(flags) if flags else None
            entry["met_runs"] = [sum(flags), len(flags)]
        entry.update(status="measured", values=values, medians=medians, ratios=ratios, target_met=met)
        if fig.key == "steps_per_s":  # every steady window of every run, by contender
            entry["windows"] = {c: spread([w for r in runs if r["contender"] == c for w in steady_windows(r) or ()])
                                for c in fig.contenders if c in medians}
        out.append(entry)
    return out


def cpu_summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """scenario -> contender -> role -> CPU seconds per 1000 steps in the counted window
    (cpu_window), the median over the repetitions (a role missing from a run counts 0),
    with the totals, the machine's other work, and the load."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    parts = [(scenario, "cpu") for scenario in dict.fromkeys(r.get("scenario", "train") for r in runs)]
    for scenario, key in parts + [("train_startup", "cpu_startup")]:
        for contender in CONTENDERS:
            mine = [r for r in runs if r.get("scenario", "train") == scenario.split("_")[0]
                    and r["contender"] == contender and r.get(key)]
            if not mine:
                continue
            each = [per_1000_steps(r[key], r[key]["steps"]) for r in mine]
            keys = [k for k in (*ROLES, "total", "outside training workers", "others on the machine")
                    if any(k in e for e in each)]
            row = {k: statistics.median(e.get(k, 0.0) for e in each) for k in keys}
            row["load average"] = statistics.median(r["load_before"] for r in mine)
            row["window s"] = statistics.median(r[key]["seconds"] for r in mine)
            out.setdefault(scenario, {})[contender] = row
    return out


CPU_TITLES = {"train": "train runs, steady state", "train_startup": "train runs, start-up (before the steady state)",
              "input": "input runs, loader processes, after the warm-up",
              "join": "join runs", "kill": "kill runs", "stall": "stall runs", "grow": "grow run",
              "faults": "faults run", "peers": "peers runs"}


def cpu_lines(report: dict[str, Any], scenarios: tuple[str, ...] = ("train", "train_startup", "input")) -> list[str]:
    """The CPU tables (Markdown): CPU seconds per 1000 steps (= ms per step) of each role's
    processes, by contender; for the train runs with the steady windows' spread under it."""
    labels = report.get("contenders", LABELS)
    lines: list[str] = []
    for scenario in scenarios:
        table = report.get("cpu", {}).get(scenario)
        if not table:
            continue
        names = list(table)
        lines += ["", f"| CPU s per 1000 steps (ms per step), {CPU_TITLES[scenario]} | "
                  + " | ".join(labels[c] for c in names) + " |", "|" + "---|" * (len(names) + 1)]
        keys = [k for k in (*ROLES, "total", "outside training workers", "others on the machine", "window s",
                            "load average") if any(k in table[c] for c in names)]
        for key in keys:
            cells = [_fmt(table[c][key]) if key in table[c] else "-" for c in names]
            title = f"**{key}**" if key in ("total", "outside training workers") else key
            lines.append(f"| {title} | " + " | ".join(cells) + " |")
        if scenario == "train":
            steps = next((f for f in report["figures"] if f["key"] == "steps_per_s"), None)
            windows = (steps or {}).get("windows") or {}
            cells = [_spread_text(windows.get(c)) for c in names]
            size = report.get("settings", {}).get("window_steps", 200)
            lines.append(f"| steps/s, median of {size}-step windows (min, q1-q3, max) | " + " | ".join(cells) + " |")
    if lines:
        lines.append("")
        lines.append(f"Roles (bench/cpu.py): {', '.join(OUTSIDE)} are outside the training workers; 'others on the "
                     "machine' is the machine's busy CPU in the same window less the run's (other work).")
    return lines


def _spread_text(s: dict[str, float] | None) -> str:
    if not s:
        return "-"
    return f"{_fmt(s['median'])} ({_fmt(s['min'])}, {_fmt(s['q1'])}-{_fmt(s['q3'])}, {_fmt(s['max'])})"


def contender_settings(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """contender -> scenario -> the settings its runs ran with and rank 0's thread snapshot
    at steady state in each (see job.thread_snapshot): what a reader checks the comparison by."""
    out: dict[str, dict[str, Any]] = {}
    for run in runs:
        if "contender_settings" in run:
            entry = out.setdefault(run["contender"], {}).setdefault(
                run["scenario"], {"settings": run["contender_settings"], "worker_threads": []})
            if run.get("worker_threads"):
                entry["worker_threads"].append(run["worker_threads"])
    return out


def _cell(value: Any) -> str:
    if isinstance(value, dict):  # the malloc settings: glibc's defaults where none is set
        return " ".join(f"{k}={v}" for k, v in sorted(value.items())) or "glibc's defaults"
    return str(value)


def settings_lines(report: dict[str, Any]) -> list[str]:
    """The train runs' threads as a Markdown table, then each contender's settings."""
    labels = report.get("contenders", LABELS)
    keys = (("torch_intra_op", "torch intra-op threads"), ("torch_inter_op", "torch inter-op threads"),
            ("process_threads", "threads in rank 0's process"), ("nice", "nice"),
            ("omp_num_threads", "OMP_NUM_THREADS"), ("malloc", "malloc settings"))
    train = {c: s["train"] for c, s in report.get("contender_settings", {}).items() if "train" in s}
    if not train:
        return []
    lines = ["| rank 0 at steady state (train runs) | " + " | ".join(labels[c] for c in train) + " |",
             "|" + "---|" * (len(train) + 1)]
    for key, title in keys:
        cells = [", ".join(_cell(t.get(key)) for t in entry["worker_threads"]) or "-" for entry in train.values()]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    lines.append("")
    for c, entry in train.items():
        lines.append(f"{labels[c]} ran with: " + "; ".join(f"{k} {v}" for k, v in entry["settings"].items()))
    return lines


def notes(spec: BenchSpec) -> list[str]:
    """How the figures were measured, where the table alone cannot say."""
    out = []
    if "train" in spec.scenario_list and "ray_train" in spec.labels:
        out.append(
            f"Ray Train ran with RAY_TRAIN_HEALTH_CHECK_INTERVAL_S={spec.ray_train_poll_s:g} (Ray's default is 2 s): "
            "its ray.train.report() puts each result in a one-slot queue that only the controller's poll "
            "empties, so reporting every step runs at most one step per poll, and the default caps it at "
            "0.5 steps/s.")
    if spec.strategy == "fsdp":
        out.append(
            "Strategy fsdp: raw FSDP2 (torch.multiprocessing, fully_shard on each Linear and on the root, "
            "Gloo) against raytrainer with trainer.strategy: fsdp, the same job; Ray Train is not run. "
            "The raw column and the ratios to raw are raw FSDP2's.")
    if "join" in spec.scenario_list:
        out.append(
            "Join runs: raytrainer's train run in a fresh process, no RAY_ADDRESS, joining the local Ray that "
            "a first `raytrainer train` leaves up for the next runs (driver/localray: RAYTRAINER_KEEP_RAY), "
            "which the bench started (`raytrainer up`) before the runs and stops after them (`raytrainer "
            "down`); raw DDP's column is its train runs' start.")
    if "kill" in spec.scenario_list:
        out.append(
            f"Kill runs: {spec.kill_steps} steps each, each step at least {spec.kill_pace_s:g} s (a sleep, "
            "both contenders: the kill lands in steady state); the last rank is SIGKILLed from outside (os.kill "
            f"of its pid by the contender's process) as soon as it starts step {spec.kill_step}, so it dies "
            f"mid-step; both contenders checkpoint every {spec.kill_checkpoint_every} steps (Ray Train "
            f"also reports only then, its poll {spec.ray_train_poll_s:g} s, FailureConfig(max_failures=1), "
            "restarting its whole group from the last checkpoint; raytrainer with its default warm spare). "
            "Time: from the kill to the end of "
            "rank 0's first step after the restart; steps lost: the furthest step rank 0 finished before "
            "the failure minus the step training resumed from. Raw DDP has no recovery.")
    if "stall" in spec.scenario_list:
        out.append(
            f"Stall runs (one local Ray): raytrainer trains a 2-layer MLP of about {spec.checkpoint_mb} MB with Adam "
            f"(the checkpoint holds three times that), {spec.stall_steps} steps, a checkpoint every "
            f"{spec.stall_checkpoint_every}, synchronous, then with checkpoint.async. A save after step k holds "
            "rank 0 before step k+1 (the write; async: the copy of the state into shared memory), and an async "
            "save's writer process (nice 19) then writes it beside training until it commits. Stall: rank 0's "
            "time from step k to the first step that ended after the commit (the checkpoint manifest's time), "
            "less as many ordinary steps (the median step outside such windows); the median of the saves but "
            "the last. Held: the time the save itself held rank 0's training thread (the commit event's "
            "blocked_s).")
    if "peers" in spec.scenario_list:
        out.append(
            f"Peers runs (fsdp, one local Ray): the kill scenario's run ({spec.kill_steps} steps, the last rank "
            f"SIGKILLed from outside as it starts step {spec.kill_step}, a checkpoint every "
            f"{spec.kill_checkpoint_every} steps, the warm spare), with peer snapshots at the default "
            "failure.snapshot_every_n_steps; then with no warm spare, failure.recovery fast (the survivor goes "
            "on alone, re-sharded from the snapshots; its steps paced at "
            f"{GROW_PACE_S:g} s from the kill until the replacement is taken back in, whose pause the grow row "
            "gives) and exact (the replacement waited for); then with snapshots off (recovery from the newest "
            "checkpoint); then "
            f"the train run ({spec.steps} steps) with snapshots and without, one after the other: the overhead is "
            "1 - the first's steps/s over the second's. Steps replayed: the snapshot step to the furthest step "
            "finished before the kill.")
    if "input" in spec.scenario_list:
        out.append(
            f"Input runs: {spec.input_steps} steps on a dataset whose every sample costs {spec.input_io_ms:g} ms "
            f"of I/O latency (a sleep) and {spec.input_decode_rounds} 64x64 matrix products of decoding; "
            f"k={spec.input_workers} loader processes per rank: raw DDP with DataLoader(num_workers=k) (its "
            "default start method, fork) and the BatchPlan's index lists as batch_sampler, raytrainer with "
            f"data.num_workers: k (fork server). The speedup row divides that by raytrainer's steps/s with "
            f"data.num_workers: 0 ({spec.input_steps_no_loaders} steps in the same contender process).")
    if "grow" in spec.scenario_list:
        out.append(
            f"Grow run: {spec.workers} workers on {spec.workers} 1-CPU nodes of a local multi-node Ray "
            f"(ray.cluster_utils), max_workers {spec.workers + 1}; once training runs a node is added. "
            "Pause: the time from rank 0's last step at the old world size to its first at the new "
            "one, less an ordinary step (steps are paced at 20 ms until the resize); starting the new "
            "worker happens while training goes on. Ray Train "
            "resizes by restarting its whole group from the last checkpoint, as after a kill (figure 3).")
    if "faults" in spec.scenario_list:
        kinds = ", ".join(FAULT_TITLES[k] for k in FAULT_KINDS)
        out.append(
            f"Faults run: {spec.faults_workers} workers on a local Ray, raytrainer's defaults (failure.recovery "
            f"fast, one warm spare), failure.step_timeout_s {spec.faults_step_timeout_s:g}, collective_timeout_s "
            f"{FAULTS_COLLECTIVE_TIMEOUT_S:g}, no checkpoints, {spec.faults_steps} steps paced at "
            f"{spec.kill_pace_s:g} s while faults are due. {spec.faults_count} faults from outside by pid, in "
            f"turn: {kinds}; each {RANDOM_DELAY_S[0]:g} to {RANDOM_DELAY_S[1]:g} s (seeded) after training went "
            "on from the one before (but the kill right after a recovery), with enough workers that one "
            f"survives it; the double kill's second comes {DOUBLE_KILL_GAP_S:g} s after its first. Time: from "
            "the os.kill (a freeze: from the controller starting to recover) to the end of rank 0's first step "
            "after the last `recovered` event before the next fault. Steps lost: the `recovered` events'. "
            "Weights: the faulted run's model.pt against an undisturbed run of the same config (same seed and "
            "world size, unpaced), trained just before it in the same process: bit-identical, or within "
            "rtol 1e-4, atol 1e-5; and their training losses: identical up to the first recovery that left a "
            "worker behind (a resize changes the order of sums over ranks), then apart by rounding, which "
            "thousands of steps grow: the ratio of their mean losses over the last tenth of the steps.")
        out.append(
            f"Node run: a local multi-node Ray (ray.cluster_utils: a head with no CPUs, 1-CPU nodes, Ray's "
            f"default worker niceness), min_workers 2, max_workers 3, {spec.node_steps} steps paced at "
            f"{NODE_PACE_S:g} s but in two unpaced windows of {spec.node_window_steps} steps at 2 workers: one "
            "before a node joins (it grows to 3) and the node of the last rank is removed (its raylet, and the "
            "worker on it), one once Ray holds that node dead; the ratio is their steps/s. Then a node joins "
            "again, and the group grows back: its pause is the `resized` event's. The CPU seconds of the GCS, "
            "the raylets and the dashboard agents in each window are in the JSON (runs[].node.before, .after).")
    return out


def recovery_lines(run: dict[str, Any]) -> list[str]:
    """One line per fault of a faults run, with what the table leaves out."""
    lines = []
    for f in run["faults"]:
        what = FAULT_TITLES[f["fault"]].replace("a random rank", f"rank {f['ranks'][0]}").replace(
            "two ranks", "ranks " + "+".join(map(str, f["ranks"])))
        how = (f"{len(f['spares'])} spare(s), {len(f['dropped'])} left behind"
               + (f", back in after {_fmt(max(f['regrown_after_s']))} s (pause {_fmt(max(f['regrow_pauses_s']))} s)"
                  if f["regrown_after_s"] else ""))
        lines.append(
            f"{what} at step {f.get('step_seen', '-')} (world {f.get('world', '-')}): detected {_fmt(f['detect_s'])} s "
            f"after it, first step {_fmt(f['fault_to_first_step_s'])} s after it"
            + (f" ({_fmt(f['detection_to_first_step_s'])} s after detection)" if f["fault"] == "freeze" else "")
            + f", {f['steps_lost']} step(s) lost, {f['recoveries']} recovery(ies), {how}"
            + (f"; load average {f['load']:.2f}" if f.get("load") is not None else ""))
    weights = ("bit-identical to" if run["bit_identical"] else "within float tolerance of" if run["within_tolerance"]
               else "NOT within float tolerance (rtol 1e-4, atol 1e-5) of")
    lines.append(f"final weights {weights} the undisturbed run's (max abs difference {run['max_abs_diff']:g}); "
                 + ("losses identical at every step" if run["identical_until_step"] is None else
                    f"losses identical up to step {run['identical_until_step']}, then {run['first_difference_rel']:.1g} "
                    f"apart (relative), and {run['loss_ratio_last_tenth']:.4g}x the undisturbed run's over the last "
                    "tenth of the steps"))
    node = run.get("node")
    if node:
        lines.append(
            f"node run: {node['steps_per_s_before']:.1f} steps/s at 2 workers before the loss, "
            f"{node['steps_per_s_after']:.1f} after ({node['after_over_before']:.2f}x); Ray held the node dead "
            f"{node['dead_after_s']:.1f} s after; GCS CPU {node['before']['cpu_per_s']['gcs']:.2f} then "
            f"{node['after']['cpu_per_s']['gcs']:.2f} core(s), dashboard agents "
            f"{node['before']['cpu_per_s']['agents']:.2f} then {node['after']['cpu_per_s']['agents']:.2f}; grew "
            f"back with a pause of {_fmt(node['regrow_pause_s'])} s")
    if run.get("incomplete"):
        lines.append(f"INCOMPLETE: {run['incomplete']}")
    return lines


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"


def format_table(report: dict[str, Any]) -> str:
    """A Markdown table of medians and ratios (it goes into docs/benchmarks.md as is)."""
    raw = report.get("contenders", LABELS)["raw"]  # raw FSDP2 with --strategy fsdp
    head = ["figure", raw, "Ray Train", "raytrainer", "raytrainer/raw", "raytrainer/Ray Train", "target"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for fig in report["figures"]:
        name = f"{fig['title']} ({fig['unit']})"
        if fig["status"] != "measured":
            cells = [name] + [f"not measured ({fig['reason']})"] + ["-"] * 4
        else:
            med, ratio = fig["medians"], fig["ratios"]
            fmt = getattr(FIGURE_BY_KEY.get(fig["key"]), "fmt", None) or _fmt
            cells = [name] + [fmt(med[c]) if c in med else "-" for c in CONTENDERS] + [
                _fmt(ratio.get("raytrainer/raw")) + ("x" if "raytrainer/raw" in ratio else ""),
                _fmt(ratio.get("raytrainer/ray_train")) + ("x" if "raytrainer/ray_train" in ratio else ""),
            ]
        target = (fig["target"] or "").replace(LABELS["raw"], raw)
        met_runs = fig.get("met_runs")
        if met_runs and met_runs[1] > 1:
            target += f" (met in {met_runs[0]} of {met_runs[1]} runs)"
        elif fig.get("target_met") is not None:
            target += " (met)" if fig["target_met"] else " (missed)"
        lines.append("| " + " | ".join(cells + [target]) + " |")
    return "\n".join(lines)
