"""`raytrainer bench` in smoke mode: every contender really runs, every figure is reported,
and nothing the bench started is left running."""

import json
import os
import time
import uuid
from pathlib import Path

import pytest

from raytrainer import bench
from raytrainer.cli import main
from raytrainer.errors import ConfigError
from raytrainer.plot import plot_runs

from .test_plot import expected_shape, read_png


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
    deadline = time.monotonic() + timeout_s
    while (left := tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"left running: {left}"


def test_smoke_bench_reports_every_figure(tmp_path, tagged):
    out = tmp_path / "bench.json"
    smoke = bench.BenchSpec(**bench.SMOKE)
    bench.run_bench(smoke, out=out, keep_in=tmp_path / "work")
    report = json.loads(out.read_text())
    printed = bench.format_table(report)
    assert_nothing_left(tagged)

    assert report["settings"]["steps"] == smoke.steps and report["settings"]["repetitions"] == 1
    # One run per contender, each with one timestamp per step: every step's metrics arrived.
    stall = [r for r in report["runs"] if "checkpoint_stall_sync_s" in r]
    kills = {r["contender"]: r for r in report["runs"] if r.get("scenario") == "kill"}
    runs = {r["contender"]: r for r in report["runs"] if r.get("scenario") == "train"}
    grows = [r for r in report["runs"] if r.get("scenario") == "grow"]
    inputs = {r["contender"]: r for r in report["runs"] if r.get("scenario") == "input"}
    assert sorted(runs) == sorted(bench.CONTENDERS) and len(report["runs"]) == 9
    for name, run in runs.items():
        assert len(run["step_times"]) == smoke.steps_for(name), name
        assert run["step_times"] == sorted(run["step_times"])
        assert run["launched"] < run["phases"]["contender_main"] < run["step_times"][0]
    assert runs["raw"]["threads"] == runs["ray_train"]["threads"] == 1  # the same job everywhere

    figures = {f["key"]: f for f in report["figures"]}
    assert list(figures) == [f.key for f in bench.FIGURES]
    for key in ("start_to_first_step_s", "steps_per_s"):
        fig = figures[key]
        assert fig["status"] == "measured"
        assert set(fig["medians"]) == set(bench.CONTENDERS) and all(v > 0 for v in fig["medians"].values())
        assert fig["ratios"]["raytrainer/raw"] == pytest.approx(fig["medians"]["raytrainer"] / fig["medians"]["raw"])
        assert fig["ratios"]["raytrainer/ray_train"] > 0 and isinstance(fig["target_met"], bool)
    # A checkpoint of the model and optimizer state (3 x 4 MB) was written, sync and async.
    assert len(stall) == 1 and stall[0]["checkpoint_bytes"] > 12 * 2**20
    for key in ("checkpoint_stall_sync_s", "checkpoint_stall_async_s"):
        assert figures[key]["status"] == "measured" and figures[key]["medians"]["raytrainer"] > 0
    # One worker of Ray Train and of raytrainer was SIGKILLed from outside mid-run; both
    # went on to the end, and the figures come from what each did after the kill.
    assert sorted(kills) == ["ray_train", "raytrainer"]
    for name, run in kills.items():
        assert run["kill_armed_step"] == smoke.kill_step and run["killed_rank"] == smoke.workers - 1, name
        assert run["step_times"][-1] > run["killed_at"] and run["kill_to_first_step_s"] > 0, name
        assert run["steps_lost"] == run["step_at_kill"] - run["resumed_from"] >= 0, name
    rec = kills["raytrainer"]["recovered_event"]
    assert kills["raytrainer"]["steps_lost"] == rec["steps_lost"] and rec["replaced"] == [smoke.workers - 1]
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
    assert speedup == pytest.approx(bench._input_steps_per_s(inputs["raytrainer"])
                                    / inputs["raytrainer"]["no_loaders_steps_per_s"])
    assert isinstance(figures["input_loader_speedup"]["target_met"], bool)
    assert all(f["status"] == "measured" for f in report["figures"])
    # The printed table has a row per figure; raw DDP, which cannot recover, shows "-" in
    # the kill rows.
    assert "| worker SIGKILL to first step after recovery (s) | - |" in printed
    assert sum(line.startswith("| ") for line in printed.splitlines()) == 1 + len(bench.FIGURES)

    # raytrainer's run is a real finished run directory: plot it.
    plot = plot_runs([runs["raytrainer"]["run_dir"]], tmp_path / "run.png")
    assert plot.panels == ["loss", "learning rate", "throughput", "world size"]
    assert read_png(plot.path).shape[:2] == expected_shape(4)


def test_a_contender_past_its_timeout_is_stopped_with_everything_it_started(tmp_path, tagged):
    # 8 s: raytrainer is starting Ray (or its workers) when it is stopped.
    spec = bench.BenchSpec(**{**bench.SMOKE, "timeout_s": 8.0})
    with pytest.raises(bench.BenchError, match="raytrainer timed out after 8 s"):
        bench._launch("raytrainer", spec, 0, tmp_path)
    assert_nothing_left(tagged)


def test_bad_settings_are_clear_errors(capsys):
    with pytest.raises(ConfigError, match="--workers=0 must be >= 1"):
        bench.BenchSpec(workers=0)
    with pytest.raises(ConfigError, match="multiple of --workers=3"):
        bench.BenchSpec(workers=3)
    assert main(["bench", "--steps", "1"]) == 2
    assert "--steps must be >= 2" in capsys.readouterr().err


def test_figures_from_timestamps():
    """The arithmetic behind the two measured figures, on made-up timestamps."""
    run = {"launched": 100.0, "step_times": [103.0] + [110.0 + i * 0.5 for i in range(10)],
           "warmup_fraction": 0.1, "contender": "raytrainer"}
    assert bench._start_to_first_step(run) == 3.0
    assert bench._steady_steps_per_s(run) == pytest.approx(2.0)  # the slow first step is warm-up
    runs = [dict(run, contender=c, launched=100.0 - i) for i, c in enumerate(bench.CONTENDERS)]
    figures = {f["key"]: f for f in bench.summarize(runs)}
    start = figures["start_to_first_step_s"]
    assert start["medians"] == {"raw": 3.0, "ray_train": 4.0, "raytrainer": 5.0}
    assert start["ratios"] == {"raytrainer/raw": pytest.approx(5 / 3), "raytrainer/ray_train": 1.25}
    assert start["target_met"] is False  # 1.67x raw misses <= 1.5x
    assert figures["steps_per_s"]["target_met"] is True
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
