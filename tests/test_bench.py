"""`raytrainer bench` in smoke mode: every contender really runs, every figure is reported,
and nothing the bench started is left running."""

import argparse
import contextlib
import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import pytest

from raytrainer import bench
from raytrainer.bench import rt
from raytrainer.bench.faults import recoveries, summary
from raytrainer.bench.raw import run_raw
from raytrainer.bench.report import (early_steps_per_s, input_steps_per_s, settings_lines, start_to_first_step,
                                     steady_steps_per_s)
from raytrainer.bench.rt import save_stalls, stall_hidden
from raytrainer.bench.run import _in_parallel, launch
from raytrainer.driver.cli import main
from raytrainer.errors import ConfigError
from raytrainer.driver.plot import plot_runs

from .test_plot import expected_shape, read_png
from .waits import Deadline, patience, wait_until


@pytest.fixture
def tagged(monkeypatch):
    """Tag the environment: every process the bench starts (contenders, their workers,
    the Ray they start) inherits it, so leftovers can be found even with other Rays
    running on the machine."""
    tag = uuid.uuid4().hex
    monkeypatch.setenv("RAYTRAINER_BENCH_TEST_TAG", tag)
    return tag


def tagged_processes(tag):
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # exited meanwhile, or not ours
        if f"RAYTRAINER_BENCH_TEST_TAG={tag}".encode() in environ:
            found.append(f"{pid}: {cmdline[:120]}")
    return found


def assert_nothing_left(tag, timeout_s=20.0):
    deadline = Deadline(timeout_s)
    while (left := tagged_processes(tag)) and not deadline.passed():
        time.sleep(0.5)
    assert not left, f"left running: {left}"


@pytest.mark.slow
@pytest.mark.hangs
def test_smoke_bench_reports_every_figure(tmp_path, tagged):
    out = tmp_path / "bench.json"
    smoke = bench.BenchSpec(**bench.SMOKE)
    clusters_before = set(glob.glob("/tmp/rtb-*"))  # the multi-node runs' Ray folders (bench/rt.py)
    bench.run_bench(smoke, out=out, keep_in=tmp_path / "work")
    report = json.loads(out.read_text())
    printed = bench.format_table(report)
    assert_nothing_left(tagged)
    assert set(glob.glob("/tmp/rtb-*")) <= clusters_before, "a multi-node run left its Ray's folder"

    assert report["settings"]["steps"] == smoke.steps and report["settings"]["repetitions"] == 1
    # One run per contender, each with one timestamp per step: every step's metrics arrived.
    stall = [r for r in report["runs"] if "checkpoint_stall_sync_s" in r]
    kills = {r["contender"]: r for r in report["runs"] if r.get("scenario") == "kill"}
    runs = {r["contender"]: r for r in report["runs"] if r.get("scenario") == "train"}
    grows = [r for r in report["runs"] if r.get("scenario") == "grow"]
    inputs = {r["contender"]: r for r in report["runs"] if r.get("scenario") == "input"}
    faults = [r for r in report["runs"] if r.get("scenario") == "faults"]
    assert sorted(runs) == sorted(bench.CONTENDERS) and len(report["runs"]) == 11
    assert runs["raytrainer"]["ray_address"] == "local"  # it started its own Ray
    # The join run joined the local Ray the bench had started as a first run leaves it
    # (kept for the next runs), and its start is set against raw DDP's own.
    (joined,) = [r for r in report["runs"] if r.get("scenario") == "join"]
    assert joined["ray"] == "kept, joined" and len(joined["step_times"]) == smoke.steps
    assert joined["launched"] < joined["phases"]["contender_main"] < joined["step_times"][0]
    for name, run in runs.items():
        assert len(run["step_times"]) == smoke.steps_for(name), name
        assert run["step_times"] == sorted(run["step_times"])
        assert run["launched"] < run["phases"]["contender_main"] < run["step_times"][0]
    assert runs["raw"]["threads"] == runs["ray_train"]["threads"] == runs["raytrainer"]["threads"] == 1
    # Every contender's rank 0 took a thread snapshot mid-run, and the report says what each ran with.
    for name, run in runs.items():
        snapshot = run["worker_threads"]
        assert snapshot["torch_intra_op"] == 1 and snapshot["process_threads"] >= 1, name
        assert report["contender_settings"][name]["train"] == {"settings": run["contender_settings"],
                                                               "worker_threads": [snapshot]}
    assert runs["ray_train"]["contender_settings"]["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == smoke.ray_train_poll_s
    assert runs["raytrainer"]["contender_settings"]["trainer"]["log_every_n_steps"] == 1
    settings = settings_lines(report)
    assert settings[0] == "| rank 0 at steady state (train runs) | raw DDP | Ray Train | raytrainer |"
    assert "| torch intra-op threads | 1 | 1 | 1 |" in settings
    # raytrainer's workers run in a Ray it started, with its malloc settings; raw DDP's as the shell set them.
    from raytrainer.bench.job import malloc_settings
    from raytrainer.driver.localray import MALLOC_SETTINGS

    shell = malloc_settings(os.environ)
    assert runs["raytrainer"]["worker_threads"]["malloc"] == {**MALLOC_SETTINGS, **shell}
    assert runs["raw"]["worker_threads"]["malloc"] == shell
    assert any(line.startswith("| malloc settings | ") and "MALLOC_ARENA_MAX=" in line for line in settings)
    assert any(line.startswith("Ray Train ran with: RAY_TRAIN_HEALTH_CHECK_INTERVAL_S ") for line in settings)

    figures = {f["key"]: f for f in report["figures"]}
    assert list(figures) == [f.key for f in bench.FIGURES]
    for key in ("start_to_first_step_s", "steps_per_s"):
        fig = figures[key]
        assert fig["status"] == "measured"
        assert set(fig["medians"]) == set(bench.CONTENDERS) and all(v > 0 for v in fig["medians"].values())
        assert fig["ratios"]["raytrainer/raw"] == pytest.approx(fig["medians"]["raytrainer"] / fig["medians"]["raw"])
        assert fig["ratios"]["raytrainer/ray_train"] > 0 and isinstance(fig["target_met"], bool)
    fig = figures["start_joined_s"]
    assert fig["medians"] == {"raw": start_to_first_step(runs["raw"]), "raytrainer": start_to_first_step(joined, "join")}
    assert fig["ratios"]["raytrainer/raw"] == pytest.approx(fig["medians"]["raytrainer"] / fig["medians"]["raw"])
    # Two training runs of a 4 MB model with Adam (checkpoints of 3 x 4 MB) saved every 10
    # steps, sync then async; each stall figure comes from rank 0's steps around the saves.
    (stall,) = stall
    assert stall["contender"] == "raytrainer" and stall["checkpoint_bytes"] > 11 * 2**20
    every = smoke.stall_checkpoint_every
    for mode in ("sync", "async"):
        times = stall[f"{mode}_step_times"]
        saves = [s for s in stall["saves"] if s["mode"] == mode]
        # Saves at 10, 20 and 30 (not 40, the last step); on a busy machine the last async
        # saves may commit only after the last step, and count for nothing.
        steps = [s["step"] for s in saves]
        assert len(times) == smoke.stall_steps and steps == list(range(every, smoke.stall_steps, every))[:len(steps)]
        for save in saves:
            k, w = save["step"], save["window_steps"]
            assert w >= 1 and save["stall_s"] == pytest.approx(
                times[k + w - 1] - times[k - 1] - w * stall[f"ordinary_step_{mode}_s"])
        assert figures[f"checkpoint_stall_{mode}_s"]["status"] == "measured"
        assert figures[f"checkpoint_stall_{mode}_s"]["medians"]["raytrainer"] == stall[f"checkpoint_stall_{mode}_s"]
        assert stall[f"checkpoint_stall_{mode}_s"] == statistics.median(s["stall_s"] for s in saves)
    assert stall["contender_settings"]["checkpoint"]["async"] is True
    # One worker of Ray Train and of raytrainer was SIGKILLed from outside mid-run; both
    # went on to the end, and the figures come from what each did after the kill.
    assert sorted(kills) == ["ray_train", "raytrainer"]
    for name, run in kills.items():
        assert run["kill_armed_step"] == smoke.kill_step and run["killed_rank"] == smoke.workers - 1, name
        assert run["step_times"][-1] > run["killed_at"] and run["kill_to_first_step_s"] > 0, name
        assert run["steps_lost"] == run["step_at_kill"] - run["resumed_from"] >= 0, name
    assert kills["ray_train"]["contender_settings"]["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == smoke.ray_train_poll_s
    assert kills["raytrainer"]["contender_settings"]["checkpoint"]["every_n_steps"] == smoke.kill_checkpoint_every
    assert sorted(report["contender_settings"]["ray_train"]) == ["kill", "train"]
    rec = kills["raytrainer"]["recovered_event"]
    assert kills["raytrainer"]["steps_lost"] == rec["steps_lost"]
    # The killed rank was taken by the warm spare, or (none up yet, on a busy machine) left
    # behind while its replacement started (failure.recovery: fast).
    killed = [smoke.workers - 1]
    assert (rec["spares"], rec["dropped"]) in ((killed, []), ([], killed)), rec
    for key in ("kill_to_first_step_s", "steps_lost"):
        fig = figures[key]
        assert fig["status"] == "measured" and set(fig["medians"]) == {"ray_train", "raytrainer"}
        assert isinstance(fig["target_met"], bool)
    # A node joined a run on a local multi-node Ray; it grew by one worker at a step boundary.
    (grow,) = grows
    event = grow["resized_event"]
    assert (event["old_world_size"], event["new_world_size"], event["added"]) == (smoke.workers, smoke.workers + 1, 1)
    assert len(grow["step_times"]) == smoke.grow_steps and grow["grow_pause_s"] > 0
    assert figures["grow_pause_s"]["medians"] == {"raytrainer": grow["grow_pause_s"]}
    # The slow dataset was read by loader processes in raw DDP and raytrainer, and by
    # raytrainer without them too; every step of each run arrived.
    assert sorted(inputs) == ["raw", "raytrainer"]
    assert all(len(r["step_times"]) == smoke.input_steps for r in inputs.values())
    assert len(inputs["raytrainer"]["no_loaders_step_times"]) == smoke.input_steps_no_loaders
    assert set(figures["input_steps_per_s"]["medians"]) == {"raw", "raytrainer"}
    speedup = figures["input_loader_speedup"]["medians"]["raytrainer"]
    assert speedup == pytest.approx(input_steps_per_s(inputs["raytrainer"])
                                    / inputs["raytrainer"]["no_loaders_steps_per_s"])
    assert isinstance(figures["input_loader_speedup"]["target_met"], bool)
    # Faults from outside at random moments in one run of 3 workers, each kind in turn, and a
    # node lost from an elastic run: each recovered, timed, its steps lost counted; the run
    # trains as an undisturbed one: the same losses up to the first recovery that left a
    # worker behind (the first kill with no spare up: a resize), then apart by rounding.
    (run,) = faults
    assert not run.get("incomplete"), run.get("incomplete")
    assert [f["fault"] for f in run["faults"]] == [*bench.fault_plan(asdict(smoke)), "node_lost"]
    for f in run["faults"]:
        assert f["recoveries"] >= 1 and f["recovery_s"] > 0 and f["steps_lost"] >= 0, f
        assert f["fault_to_first_step_s"] >= f["recovery_s"] if f["fault"] != "freeze" else True
    (freeze,) = [f for f in run["faults"] if f["fault"] == "freeze"]
    assert freeze["detect_s"] >= smoke.faults_step_timeout_s and [x["kind"] for x in freeze["failed"]][0] == "hung"
    double = next(f for f in run["faults"] if f["fault"] == "double_kill")
    assert len(double["ranks"]) == 2 and double["times"][1] - double["times"][0] >= 0.3
    first_left = min(f["step_seen"] for f in run["faults"] if f["dropped"] and f["fault"] != "node_lost")
    assert run["identical_until_step"] is None or run["identical_until_step"] >= first_left
    assert 0.5 < run["loss_ratio_last_tenth"] < 2
    node = run["node"]
    assert node["before"]["world"] == node["after"]["world"] == 2 and node["after_over_before"] > 0
    assert node["regrow_pause_s"] > 0 and node["before"]["cpu_per_s"]["gcs"] >= 0
    for key in ("recovery_p50_s", "recovery_p95_s", "recovery_max_s", "steps_lost_total", "faults_weights",
                "faults_loss_ratio",
                "node_lost_to_first_step_s", "node_after_over_before", "node_regrow_pause_s"):
        assert figures[key]["status"] == "measured" and figures[key].get("met_runs") in (None, [0, 1], [1, 1]), key
    assert figures["recovery_max_s"]["medians"] == {"raytrainer": max(f["recovery_s"] for f in run["faults"])}
    # Every figure but those of peer snapshots, which need --strategy fsdp.
    peers = {f.key for f in bench.FIGURES if f.scenario == "peers"}
    assert all(f["status"] == "measured" for f in report["figures"] if f["key"] not in peers)
    assert all(figures[k]["reason"] == "not run: --scenarios peers" for k in peers)
    # The printed table has a row per figure; raw DDP, which cannot recover, shows "-" in
    # the kill rows.
    assert "| worker SIGKILL to first step after recovery (s) | - |" in printed
    assert sum(line.startswith("| ") for line in printed.splitlines()) == 1 + len(bench.FIGURES)

    # raytrainer's run is a real finished run directory: plot it.
    plot = plot_runs([runs["raytrainer"]["run_dir"]], tmp_path / "run.png")
    assert plot.panels == ["loss", "learning rate", "throughput", "world size", "where the time went"]
    assert read_png(plot.path).shape[:2] == expected_shape(5)


@pytest.mark.slow
def test_a_bench_sigtermed_stops_its_contender_with_everything_it_started(tmp_path, tagged):
    """`kill` of the bench (or a CI job's time limit) while a contender trains: the bench
    exits 143 once it has stopped the contender, its Ray and its workers (each contender runs
    in a session of its own, which a SIGTERM of the bench alone did not reach)."""
    bench_proc = subprocess.Popen([sys.executable, "-m", "raytrainer", "bench", "--smoke", "--scenarios", "stall",
                                   "--out", str(tmp_path / "bench.json")], cwd=tmp_path,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # A process of the contender's own Ray (an agent, a worker): the contender runs, its Ray up.
        wait_until(lambda: any(" ray::" in p for p in tagged_processes(tagged)), "the contender's Ray",
                   timeout_s=120.0, alive=lambda: bench_proc.poll() is None)
        bench_proc.send_signal(signal.SIGTERM)
        # The contender gets 15 s to stop its Ray, then what is left is SIGKILLed (run.stop).
        assert bench_proc.wait(timeout=patience(60)) == 128 + signal.SIGTERM, bench_proc.stderr.read()
        assert_nothing_left(tagged, timeout_s=60.0)
    finally:
        if bench_proc.poll() is None:
            bench_proc.kill()
        for line in tagged_processes(tagged):  # what a failing bench left: not for the tests after this one
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
    assert not (tmp_path / "bench.json").exists()


@pytest.mark.slow
def test_a_contender_past_its_timeout_is_stopped_with_everything_it_started(tmp_path, tagged):
    # 8 s: raytrainer is starting Ray, its workers, or training when it is stopped; never done
    # (the smoke's 6 steps, after a Ray start that takes 6-9 s here, were done in 8 s now and then).
    spec = bench.BenchSpec(**{**bench.SMOKE, "timeout_s": 8.0, "steps": 1_000_000})
    with pytest.raises(bench.BenchError, match="raytrainer timed out after 8 s"):
        launch("raytrainer", spec, 0, tmp_path)
    # A Ray worker process still importing when its raylet was stopped exits only once it
    # gets to look (seen: over 20 s on a loaded 2-core machine).
    assert_nothing_left(tagged, timeout_s=60.0)


def test_bad_settings_are_clear_errors(capsys):
    with pytest.raises(ConfigError, match="--workers=0 must be >= 1"):
        bench.BenchSpec(workers=0)
    with pytest.raises(ConfigError, match="multiple of --workers=3"):
        bench.BenchSpec(workers=3)
    with pytest.raises(ConfigError, match="--faults-workers=2 must be >= 3"):
        bench.BenchSpec(faults_workers=2)
    with pytest.raises(ConfigError, match="--stall-checkpoint-every=40 must be below --stall-steps=40"):
        bench.BenchSpec(stall_checkpoint_every=40)
    with pytest.raises(ConfigError, match="--ray-train-poll-s must be > 0"):
        bench.BenchSpec(ray_train_poll_s=0)
    assert main(["bench", "--steps", "1"]) == 2
    assert "--steps must be >= 2" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--strategy='zero': choose from ddp, fsdp"):
        bench.BenchSpec(strategy="zero")
    with pytest.raises(ConfigError, match="--strategy fsdp measures the train and peers scenarios only"):
        bench.BenchSpec(strategy="fsdp")
    with pytest.raises(ConfigError, match="peers measures peer snapshots of sharded state: pass --strategy fsdp"):
        bench.BenchSpec(scenarios="peers")
    # On the command line, --strategy fsdp alone measures the train and peers scenarios.
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    spec = bench.spec_from_args(parser.parse_args(["--strategy", "fsdp", "--smoke"]))
    assert (spec.strategy, spec.scenarios, spec.labels) == ("fsdp", "train,peers", {"raw": "raw FSDP2",
                                                                              "raytrainer": "raytrainer"})
    # raytrainer's config names the strategy only when it is not DDP.
    trainer = {s: rt.config(asdict(bench.BenchSpec(**{**bench.SMOKE, "strategy": s, "scenarios": "train"})),
                            Path("work"), "bench", 6)["trainer"] for s in ("ddp", "fsdp")}
    assert "strategy" not in trainer["ddp"] and trainer["fsdp"]["strategy"] == "fsdp"


def test_runs_in_parallel_keep_their_order_and_the_first_error_stops_the_rest():
    import threading

    cancel = threading.Event()
    assert _in_parallel(lambda s, n: {"run": (s, n)}, [("a", "x"), ("b", "y")], 2, cancel) == [
        {"run": ("a", "x")}, {"run": ("b", "y")}]
    started = []

    def one(scenario, name):
        started.append(name)
        if name == "bad":
            raise bench.BenchError("bad failed")
        assert cancel.wait(10), "the failure did not cancel the run going beside it"
        return {}

    with pytest.raises(bench.BenchError, match="bad failed"):
        _in_parallel(one, [("s", "slow"), ("s", "bad"), ("s", "queued")], 2, cancel)
    assert "queued" not in started


@pytest.mark.slow
def test_raw_fsdp2_trains_the_same_job_as_raw_ddp(tmp_path):
    """The raw FSDP2 contender (fully_shard on each Linear and the root, Gloo): the same
    data, batches and SGD as raw DDP, so the same loss after its steps, to float tolerance."""
    spec = {**asdict(bench.BenchSpec(**bench.SMOKE)), "scenario": "train"}
    ddp = run_raw(spec, tmp_path)
    fsdp = run_raw({**spec, "strategy": "fsdp"}, tmp_path)
    assert len(fsdp["step_times"]) == spec["steps"] and fsdp["threads"] == 1
    assert fsdp["last_loss"] == pytest.approx(ddp["last_loss"], rel=1e-4)


@pytest.mark.slow
def test_fsdp_bench_against_raw_fsdp2_and_its_recovery_from_peers(tmp_path, tagged):
    """`raytrainer bench --strategy fsdp`: raw FSDP2 against raytrainer's FSDP2, and a kill
    recovered from peer snapshots against one recovered from a checkpoint."""
    spec = bench.BenchSpec(**{**bench.SMOKE, "strategy": "fsdp", "scenarios": "train,peers"})
    report = bench.run_bench(spec, keep_in=tmp_path / "work")
    assert_nothing_left(tagged)
    runs = {r["contender"]: r for r in report["runs"] if r["scenario"] == "train"}
    assert sorted(runs) == ["raw", "raytrainer"] and report["contenders"]["raw"] == "raw FSDP2"
    assert all(len(r["step_times"]) == spec.steps for r in runs.values())
    (peers,) = [r for r in report["runs"] if r["scenario"] == "peers"]
    assert peers["peers_run"]["recovered_event"]["state_from"] == "peers"
    assert peers["checkpoint_run"]["recovered_event"]["from_checkpoint"].startswith("step-")
    # The kill as step 15 starts (on a busy machine it may land a step or two later): back
    # to the newest snapshot every rank holds (failure.snapshot_every_n_steps auto: the
    # interval in use then, from the run's snapshot_interval events; two intervals where the
    # newest was still being exchanged), and to the checkpoint of step 10.
    assert 0 <= peers["peers_steps_replayed"] <= 2 * peers["peers_snapshot_interval"]
    assert spec.kill_step - 11 <= peers["checkpoint_steps_lost"] <= 10
    # With no spare: recovery fast went on at one worker, re-sharded from the snapshots, and
    # took the replacement back in by a grow; recovery exact waited for it, leaving none behind.
    fast, exact = peers["fast_run"], peers["exact_run"]
    assert fast["recovered_event"]["dropped"] == [spec.workers - 1] and fast["recovered_event"]["spares"] == []
    assert (fast["grow_event"]["added"], fast["grow_event"]["new_world_size"]) == (1, spec.workers)
    assert peers["fast_grow_pause_s"] == fast["grow_event"]["seconds"] > 0
    assert exact["recovered_event"]["dropped"] == exact["recovered_event"]["spares"] == [] and not exact["grow_event"]
    for run in ("fast", "exact"):
        assert 0 <= peers[f"{run}_steps_replayed"] <= 2 * peers[f"{run}_snapshot_interval"], run
    figures = {f["key"]: f for f in report["figures"]}
    assert all(figures[k]["status"] == "measured" for k in (
        "peers_kill_to_first_step_s", "snapshot_overhead", "fast_kill_to_first_step_s", "fast_grow_pause_s",
        "exact_kill_to_first_step_s"))
    # Not compared with raw's loss: raytrainer seeds its model's init its own way (its DDP
    # run's loss differs from raw DDP's too; its fsdp run's equals its DDP run's, checked once).
    steps = {f["key"]: f for f in report["figures"]}["steps_per_s"]
    assert steps["status"] == "measured" and steps["ratios"]["raytrainer/raw"] > 0
    assert "| figure | raw FSDP2 | Ray Train |" in bench.format_table(report)


def test_figures_from_timestamps():
    """The arithmetic behind the two measured figures, on made-up timestamps."""
    run = {"launched": 100.0, "step_times": [103.0] + [110.0 + i * 0.5 for i in range(10)],
           "warmup_fraction": 0.1, "contender": "raytrainer"}
    assert start_to_first_step(run) == 3.0
    assert steady_steps_per_s(run) == pytest.approx(2.0)  # the slow first step is warm-up
    runs = [dict(run, contender=c, launched=100.0 - i) for i, c in enumerate(bench.CONTENDERS)]
    figures = {f["key"]: f for f in bench.summarize(runs)}
    start = figures["start_to_first_step_s"]
    assert start["medians"] == {"raw": 3.0, "ray_train": 4.0, "raytrainer": 5.0}
    assert start["ratios"] == {"raytrainer/raw": pytest.approx(5 / 3), "raytrainer/ray_train": 1.25}
    assert start["target_met"] is False  # 1.67x raw misses <= 1.5x
    assert figures["steps_per_s"]["target_met"] is True
    # Steady state counts from steady_from on; the early figure reads the first tenth.
    slow_start = {"launched": 99.0, "warmup_fraction": 0.1, "steady_from": 0.5, "contender": "raytrainer",
                  "step_times": [100.0 + i for i in range(5)] + [105.0 + 0.25 * i for i in range(1, 6)]}
    assert steady_steps_per_s(slow_start) == pytest.approx(4.0)  # the last 5 steps, 0.25 s apart
    assert early_steps_per_s(slow_start) == pytest.approx(1.0)  # the first 3, 1 s apart
    # Joining a running Ray: raytrainer's join run against raw DDP's train run; a join run
    # counts for no other figure.
    joined = dict(run, scenario="join", launched=101.0)
    figures = {f["key"]: f for f in bench.summarize(runs + [joined])}
    assert figures["start_joined_s"]["medians"] == {"raw": 3.0, "raytrainer": 2.0}
    assert figures["start_joined_s"]["target_met"] is True  # 0.67x raw
    assert figures["start_to_first_step_s"]["medians"] == start["medians"]
    # Kill runs count only for the kill figures, and the kill targets read the medians.
    kills = [{"contender": "ray_train", "scenario": "kill", "kill_to_first_step_s": 20.0, "steps_lost": 25},
             {"contender": "raytrainer", "scenario": "kill", "kill_to_first_step_s": 3.0, "steps_lost": 0}]
    figures = {f["key"]: f for f in bench.summarize(runs + kills)}
    assert figures["start_to_first_step_s"]["medians"] == start["medians"]
    assert figures["kill_to_first_step_s"]["ratios"] == {"raytrainer/ray_train": 0.15}
    assert figures["kill_to_first_step_s"]["target_met"] is True and figures["steps_lost"]["target_met"] is True
    assert figures["kill_to_first_step_s"]["medians"].get("raw") is None
    # A scenario left out is said to be, not measured as nothing.
    figures = {f["key"]: f for f in bench.summarize(runs, ["train"])}
    assert figures["steps_lost"]["status"] == "not measured" and figures["steps_lost"]["reason"].startswith("not run")


def test_cpu_seconds_by_role_from_made_up_samples():
    """bench.cpu on samples made up as /proc would give them: each process named by its
    command line and parentage, its CPU over a window, a reaped child counted once."""
    from raytrainer.bench.cpu import Sampler, per_1000_steps, spread, window_rates

    def proc(ppid, title, samples, start=0.0):
        return {"ppid": ppid, "start": start, "titles": [title] if isinstance(title, str) else title,
                "samples": samples}

    ramp = lambda rate, reaped=lambda t: 0.0: [(t, rate * t, reaped(t)) for t in range(0, 11)]  # noqa: E731
    s = Sampler(session=1)
    s.procs = {
        1: proc(0, "python -m raytrainer.bench _contender raytrainer {}", ramp(0.1)),
        2: proc(1, "/x/ray/core/src/ray/raylet/raylet --flags", ramp(0.01)),
        3: proc(1, "/x/ray/core/src/ray/gcs/gcs_server --log_dir=x", ramp(0.02)),
        # a Ray worker read first between fork and exec (its parent's command line), then retitled
        10: proc(2, ["/x/ray/core/src/ray/raylet/raylet --flags", "ray::IDLE", "ray::Worker"], ramp(0.9)),
        11: proc(2, ["ray::IDLE", "ray::Worker.run"], ramp(0.8)),
        12: proc(2, ["ray::IDLE", "ray::Worker"], ramp(0.3)),  # not in the run's pids: the spare
        # rank 10's fork server, whose loader process was reaped (not seen) at t=5: 2 CPU-s
        20: proc(10, "python -c from multiprocessing.forkserver import main", ramp(0.0, lambda t: 2.0 * (t >= 5))),
        21: proc(20, "python -c from multiprocessing.forkserver import main", ramp(0.5)),
        30: proc(2, ["ray::IDLE", "ray::DashboardAgent"], ramp(0.05)),
    }
    s.machine = [(t, 4.0 * t) for t in range(0, 11)]
    cpu = s.window(2.0, 8.0, training_pids={10, 11})
    assert cpu["by_role"] == pytest.approx({"driver": 0.6, "raylet": 0.06, "gcs_server": 0.12, "training workers": 10.2,
                                            "warm spare": 1.8, "loader processes": 5.0, "dashboard agent": 0.3})
    assert cpu["total_s"] == pytest.approx(18.08) and cpu["outside_training_s"] == pytest.approx(7.88)
    assert cpu["others_on_machine_s"] == pytest.approx(24.0 - 18.08)
    # A window ending before the reaping leaves it out: it counts when the child is reaped.
    assert s.window(2.0, 4.5, {10, 11})["by_role"]["loader processes"] == pytest.approx(1.25)
    # Without the run's pids every raytrainer worker counts as training.
    assert s.window(2.0, 8.0)["by_role"]["training workers"] == pytest.approx(12.0)
    assert per_1000_steps(cpu, 2000)["total"] == pytest.approx(9.04)
    assert window_rates([0.0, 1.0, 2.0, 4.0, 5.0], size=2) == [1.0, 2 / 3]
    assert window_rates([0.0, 2.0], size=200) == [0.5]  # fewer steps than a window: one of them all
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "q1": 1.5, "q3": 2.5, "max": 3.0, "windows": 3}


def test_fault_figures_from_events():
    """Each fault's figures come from the events between it and the next: timed from the
    fault (a freeze from its detection) to rank 0's first step after its last recovery;
    p50, p95 and max over the faults; a target that must hold in every run says in how
    many it did."""
    assert bench.fault_plan({"faults_count": 7}) == [*bench.FAULT_KINDS, "kill", "kill_after_recovery"]
    injected = [{"fault": "kill", "ranks": [1], "pids": [11], "at": 20.0, "times": [20.0]},
                {"fault": "double_kill", "ranks": [1, 2], "pids": [12, 13], "at": 40.0, "times": [40.0, 40.3]},
                {"fault": "freeze", "ranks": [0], "pids": [14], "at": 60.0, "times": [60.0]}]
    paused = [(20.0, 20.3), (40.0, 40.6), (60.0, 64.0)]
    times = [t / 10 for t in range(100, 700) if not any(a <= t / 10 <= b for a, b in paused)]
    rows = list(enumerate(times, 1))
    events = [{"event": "worker_failed", "time": 20.1, "rank": 1, "kind": "died", "step": 99},
              {"event": "recovered", "time": 20.3, "seconds": 0.2, "steps_lost": 0, "attempts": 1, "dropped": [1],
               "spares": []},
              {"event": "resized", "time": 20.3, "seconds": 0.2, "cause": "failure: rank 1 died"},
              {"event": "resized", "time": 25.0, "seconds": 0.15, "cause": "lost workers replaced"},
              {"event": "worker_failed", "time": 40.1, "rank": 1, "kind": "died", "step": 300},
              {"event": "recovered", "time": 40.2, "seconds": 0.1, "steps_lost": 0, "attempts": 1, "spares": [1]},
              {"event": "worker_failed", "time": 40.4, "rank": 2, "kind": "died", "step": 301},
              {"event": "recovered", "time": 40.6, "seconds": 0.15, "steps_lost": 1, "attempts": 1, "dropped": [2]},
              {"event": "worker_failed", "time": 63.6, "rank": 0, "kind": "hung", "step": 500},
              {"event": "recovered", "time": 64.0, "seconds": 0.5, "steps_lost": 0, "attempts": 1, "spares": [0]}]
    kill, double, freeze = recoveries(injected, events, rows)
    assert kill["fault_to_first_step_s"] == pytest.approx(0.4) and kill["goal_met"]
    assert kill["regrow_pauses_s"] == [0.15] and kill["regrown_after_s"] == [5.0] and kill["dropped"] == [1]
    assert double["recoveries"] == 2 and double["fault_to_first_step_s"] == pytest.approx(0.7)
    assert double["steps_lost"] == 1 and not double["goal_met"] and double["spares"] == [1]
    assert freeze["fault_to_first_step_s"] == pytest.approx(4.1) and freeze["detect_s"] == pytest.approx(3.5)
    assert freeze["recovery_s"] == freeze["detection_to_first_step_s"] == pytest.approx(0.6) and freeze["goal_met"]
    figures = summary([kill, double, freeze])
    assert figures["recovery_p50_s"] == pytest.approx(0.6) and figures["recovery_p95_s"] == pytest.approx(0.7)
    assert (figures["steps_lost_total"], figures["regrow_pause_max_s"], figures["goals_met"]) == (1, 0.15, 2)

    def faults_run(p95, identical):
        return {"contender": "raytrainer", "scenario": "faults", **figures, "recovery_p95_s": p95,
                "bit_identical": identical, "within_tolerance": True,
                "node": {"fault": {"recovery_s": 1.0}, "after_over_before": 0.95, "regrow_pause_s": 0.3}}

    report = {"figures": bench.summarize([faults_run(1.5, True), faults_run(2.5, False)], ["faults"])}
    by_key = {f["key"]: f for f in report["figures"]}
    assert by_key["recovery_p95_s"]["medians"] == {"raytrainer": 2.0}
    assert by_key["recovery_p95_s"]["met_runs"] == [1, 2] and by_key["recovery_p95_s"]["target_met"] is False
    assert by_key["steps_lost_total"]["met_runs"] == [0, 2] and by_key["node_after_over_before"]["target_met"]
    printed = bench.format_table(report)
    assert "| - | - | 2 | - | - | <= 2 s (met in 1 of 2 runs) |" in printed
    assert "| - | - | within tolerance | - | - |  |" in printed


def test_checkpoint_stall_from_the_steps_around_each_save():
    """A save's stall is the time of the steps from it to the first step that ended after
    it committed, less as many ordinary steps; the run's last save, with no step after its
    commit, counts for nothing, and the windows count for no ordinary step."""
    rows = [(s, float(s)) for s in range(1, 6)]  # 1 s a step
    rows += [(6, 6.5)] + [(s, s + 0.5) for s in range(7, 11)]  # the sync save after step 5 held step 6
    rows += [(11, 11.7), (12, 12.9)] + [(s, s + 0.9) for s in range(13, 16)]  # an async writer slowed 11 and 12
    commits = [(5, 5.45), (10, 12.2), (15, 15.95)]
    ordinary, saves = save_stalls(rows, commits, warmup_fraction=0.0)
    assert ordinary == 1.0
    assert [(s["step"], s["window_steps"]) for s in saves] == [(5, 1), (10, 2)]
    assert [s["stall_s"] for s in saves] == pytest.approx([0.5, 0.4])
    assert saves[1]["committed_after_s"] == pytest.approx(1.7)
    # The stall runs' model: about checkpoint_mb MB of fp32 parameters in a 2-layer MLP.
    h = stall_hidden(64, 32)
    assert 0.99 * 64 * 2**20 <= 4 * (h * h + 35 * h + 1) <= 64 * 2**20


@pytest.mark.slow
def test_step_cpu_alternates_raw_ddp_and_the_loop_and_reports_their_ratio(capsys):
    """The per-step CPU figure (bench/step_cpu.py): both loops train in the same processes,
    and their chunks alternate; every round is a measured pair, and the ratio is theirs."""
    from raytrainer.bench import step_cpu

    figures = step_cpu.measure(workers=2, chunk=3, rounds=4, hidden=16)
    assert figures["rounds"] == 4 and figures["raw_ms"] > 0 and figures["raytrainer_ms"] > 0
    assert figures["ratio_min"] <= figures["ratio_q1"] <= figures["ratio"] <= figures["ratio_q3"] <= figures["ratio_max"]
    table = step_cpu.format_figures(figures)
    assert f"| {figures['raw_ms']:.3f} | {figures['raytrainer_ms']:.3f} | {figures['ratio']:.3f} (" in table


def test_the_malloc_bench_runs_the_step_with_glibcs_defaults_and_with_raytrainers_settings():
    from raytrainer.bench.state_size import measure_malloc
    from raytrainer.driver.localray import MALLOC_SETTINGS, RAY_SETTINGS

    out = measure_malloc(0.05, repeat=1, steps=3, width=64)
    ours = {k: v for k, v in RAY_SETTINGS.items() if k.startswith("MALLOC_")}  # what a Ray raytrainer starts sets
    assert ours == MALLOC_SETTINGS and out["glibc_defaults"]["malloc"] == {} and out["raytrainer"]["malloc"] == ours
    for way in ("glibc_defaults", "raytrainer"):
        assert len(out[way]["first_step_s"]) == len(out[way]["step_median_s"]) == len(out[way]["faults_per_step"]) == 1
        assert out[way]["step_median_s"][0] > 0 and out[way]["faults_per_step"][0] >= 0
    assert out["defaults_over_raytrainer"] > 0
