"""The figures: what each one reads from a contender's run, its target, the summary of
all runs (medians, ratios, targets met), and how the report is printed."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any, Callable

from .faults import DOUBLE_KILL_GAP_S, FAULT_TITLES, FAULTS, FAULTS_COLLECTIVE_TIMEOUT_S, fault_plan
from .cpu import OUTSIDE, ROLES, per_1000_steps, spread, window_rates
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


def _recovery_of(run: dict[str, Any], fault: int) -> dict[str, Any] | None:
    """The recovery that followed fault `fault` of a faults run (None: none did, or not a faults run)."""
    return next((r for r in run.get("recoveries", ()) if r["fault_index"] == fault), None)


def _fault_figures(i: int, kind: str, ranks: tuple[int, ...]) -> tuple[Figure, Figure]:
    who = " and ".join("the last rank" if r == -1 else f"rank {r}" for r in ranks)
    name = f"fault {i + 1} ({FAULT_TITLES[kind].format(who)})"

    def value(key: str) -> Callable[[dict[str, Any]], float | None]:
        return lambda run: (rec := _recovery_of(run, i)) and rec[key]

    return (
        Figure(f"fault_{i + 1}_to_first_step_s", f"{name}: fault to first step after recovery", "s", "lower",
               ("raytrainer",), value("fault_to_first_step_s"),
               target="<= step_timeout_s + 3 s" if kind == "freeze" else "<= 3 s",
               met_in_run=lambda run: (r := _recovery_of(run, i))["fault_to_first_step_s"] <= r["goal_s"],
               scenario="faults"),
        Figure(f"fault_{i + 1}_steps_lost", f"{name}: steps lost", "steps", "lower", ("raytrainer",),
               value("steps_lost"), target="<= 1 step", met_in_run=lambda run: _recovery_of(run, i)["steps_lost"] <= 1,
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
    *(fig for i, (kind, ranks) in enumerate(FAULTS) for fig in _fault_figures(i, kind, ranks)),
    Figure("peers_kill_to_first_step_s", "fsdp: worker SIGKILL to first step after, from peer snapshots", "s",
           "lower", ("raytrainer",), lambda run: run.get("peers_kill_to_first_step_s"), target="<= 5 s",
           target_check=lambda m, r: m["raytrainer"] <= 5, scenario="peers"),
    Figure("peers_steps_replayed", "fsdp: steps replayed after it", "steps", "lower", ("raytrainer",),
           lambda run: run.get("peers_steps_replayed"), target="<= snapshot_every_n_steps",
           met_in_run=lambda run: run["peers_steps_replayed"] <= run["snapshot_every_n_steps"], scenario="peers"),
    Figure("checkpoint_kill_to_first_step_s", "fsdp: the same, from the newest checkpoint (snapshots off)", "s",
           "lower", ("raytrainer",), lambda run: run.get("checkpoint_kill_to_first_step_s"), scenario="peers"),
    Figure("checkpoint_steps_lost", "fsdp: steps lost to it from the checkpoint", "steps", "lower",
           ("raytrainer",), lambda run: run.get("checkpoint_steps_lost"), scenario="peers"),
    Figure("snapshot_overhead", "fsdp: steps/s lost to peer snapshots at the default interval", "%", "lower",
           ("raytrainer",), lambda run: 100 * run["snapshot_overhead"] if "snapshot_overhead" in run else None,
           target="<= 3%", target_check=lambda m, r: m["raytrainer"] <= 3, scenario="peers"),
    Figure("faults_bit_identical", "final weights of the faulted run against an undisturbed one",
           "bit-identical", "higher", ("raytrainer",),
           lambda run: float(run["bit_identical"]) if "bit_identical" in run else None,
           target="bit-identical", met_in_run=lambda run: run["bit_identical"], scenario="faults",
           fmt=lambda v: "yes" if v == 1 else "no"),
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


def settings_lines(report: dict[str, Any]) -> list[str]:
    """The train runs' threads as a Markdown table, then each contender's settings."""
    labels = report.get("contenders", LABELS)
    keys = (("torch_intra_op", "torch intra-op threads"), ("torch_inter_op", "torch inter-op threads"),
            ("process_threads", "threads in rank 0's process"), ("nice", "nice"),
            ("omp_num_threads", "OMP_NUM_THREADS"))
    train = {c: s["train"] for c, s in report.get("contender_settings", {}).items() if "train" in s}
    if not train:
        return []
    lines = ["| rank 0 at steady state (train runs) | " + " | ".join(labels[c] for c in train) + " |",
             "|" + "---|" * (len(train) + 1)]
    for key, title in keys:
        cells = [", ".join(str(t.get(key)) for t in entry["worker_threads"]) or "-" for entry in train.values()]
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
            f"{spec.kill_checkpoint_every} steps, the warm spare), once with peer snapshots at the default "
            "failure.snapshot_every_n_steps and once with them off (recovery from the newest checkpoint); then "
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
        plan = fault_plan(asdict(spec))
        where = ", ".join(f"{f['fault'].replace('_', ' ')} of rank {'+'.join(map(str, f['ranks']))} at step "
                          f"{f['step']}" for f in plan)
        out.append(
            f"Faults run: {spec.faults_workers} workers, {(len(FAULTS) + 1) * spec.faults_every} steps, "
            f"failure.step_timeout_s {spec.faults_step_timeout_s:g}, collective_timeout_s "
            f"{FAULTS_COLLECTIVE_TIMEOUT_S:g}, default warm spare, no checkpoints; "
            f"{where}. Single kills and the freeze are failure.chaos faults with at: random (a timer "
            "thread in the worker SIGKILLs or SIGSTOPs it at a seeded random moment of the step); the "
            f"double kill is two os.kill(SIGKILL) by pid from the contender's process, "
            f"{DOUBLE_KILL_GAP_S:g} s apart, once metrics.jsonl shows the step. Time: from the fault to the "
            "end of rank 0's first step after the `recovered` event; a chaos fault's moment is taken as "
            "rank 0's last step before the failure (no event records it), so its times may be up to one "
            "step too long. Steps lost: the `recovered` event's. Bit-identical: the faulted run's model.pt "
            "against an undisturbed run of the same config (same seed and world size), trained just "
            "before it in the same process.")
    return out


def recovery_lines(run: dict[str, Any]) -> list[str]:
    """One line per recovery of a faults run, with what the table leaves out."""
    lines = []
    for r in run["recoveries"]:
        ranks = "+".join(str(f["rank"]) for f in r["failed"])
        lines.append(
            f"{r['fault'].replace('_', ' ')} of rank {ranks} at step {r['fault_step']}: detected "
            f"{_fmt(r['detect_s'])} s after it, `recovered` after {_fmt(r['seconds'])} s "
            f"({r['attempts']} attempt(s), state from "
            f"{'rank ' + str(r['source_rank']) if r['source_rank'] is not None else r['state_from']}), "
            f"first step {_fmt(r['fault_to_first_step_s'])} s after the fault, {r['steps_lost']} step(s) lost"
            + (f"; load average {r['load']:.2f}" if r.get("load") is not None else ""))
    lines.append(f"final weights {'bit-identical' if run['bit_identical'] else 'NOT bit-identical'} to the "
                 f"undisturbed run's (max abs difference {run['max_abs_diff']:g})")
    return lines


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"


def format_table(report: dict[str, Any]) -> str:
    """A Markdown table of medians and ratios (it goes into the README as is)."""
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
