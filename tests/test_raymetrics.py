"""The run in Ray's metrics: the sink against a fake of Ray's metric objects (what it
records, and that it records nothing where Ray exports no metrics), then one real run on a
Ray of its own with metrics on, scraped from the Prometheus endpoint."""

import itertools
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from raytrainer.driver.metrics import MetricsHub, RunInfo
from raytrainer.driver.raymetrics import RayMetricsSink

from .ray_procs import free_ports, own_ray_env


class FakeBackend:
    """Records every set and inc as (kind, name, value, tags)."""

    def __init__(self, exporting=True):
        self._exporting = exporting
        self.calls = []
        self.made = []

    def exporting(self):
        return self._exporting

    def _make(self, kind, name, tag_keys):
        self.made.append((name, tag_keys))
        calls = self.calls

        class Metric:
            def set(self, value, tags):
                calls.append(("gauge", name, value, tags))

            def inc(self, value, tags):
                calls.append(("counter", name, value, tags))

        return Metric()

    def gauge(self, name, description, tag_keys):
        return self._make("gauge", name, tag_keys)

    def counter(self, name, description, tag_keys):
        return self._make("counter", name, tag_keys)

    def latest(self, name, **tags):
        values = [c[2] for c in self.calls if c[1] == name and all(c[3].get(k) == v for k, v in tags.items())]
        return values[-1] if values else None


def hub_with(backend, clock=None, warned=None):
    """The sink in a hub; by default a clock 10 s further at each look, so every flush records."""
    clock = clock or itertools.count(step=10.0).__next__
    warned = [] if warned is None else warned
    sink = RayMetricsSink(backend, clock=clock, warn=warned.append)
    return sink, MetricsHub([sink], RunInfo(Path("/nowhere"), "demo", {}))


def test_rows_and_events_become_the_runs_series():
    backend = FakeBackend()
    sink, hub = hub_with(backend)
    hub.write([{"step": 10, "epoch": 0, "time": 100.0, "world_size": 2, "loss": 0.5, "samples_per_s": 640.0},
               {"step": 20, "epoch": 0, "time": 102.0, "world_size": 2, "loss": 0.25, "samples_per_s": 660.0}])
    assert backend.latest("raytrainer_step") == 20
    assert backend.latest("raytrainer_loss") == 0.25  # the newest row's, not every row's
    assert backend.latest("raytrainer_samples_per_s") == 660.0
    assert backend.latest("raytrainer_world_size") == 2
    assert all(c[3]["run"] == "demo" for c in backend.calls)
    hub.write([{"step": 30, "epoch": 0, "time": 104.0, "world_size": 2, "loss": 0.2}])
    assert backend.latest("raytrainer_steps_per_s") == pytest.approx(5.0)  # 10 steps in 2 s

    hub.event({"event": "worker_failed", "time": 105.0, "step": 31, "rank": 1, "kind": "died", "cause": "SIGKILL"})
    assert backend.latest("raytrainer_worker_failures", kind="died") == 1.0
    assert backend.latest("raytrainer_steps_per_s") == 0.0  # not stepping while it recovers
    hub.event({"event": "recovered", "time": 106.0, "step": 30, "seconds": 0.4, "steps_lost": 1,
               "failures": 1, "losses": 1, "faults": 0})
    assert backend.latest("raytrainer_recoveries") == 1.0
    assert backend.latest("raytrainer_recovery_seconds") == 0.4
    assert backend.latest("raytrainer_failures_by_cause", cause="loss") == 1.0
    assert backend.latest("raytrainer_failures_by_cause", cause="fault") == 0.0
    hub.event({"event": "resized", "time": 107.0, "step": 30, "old_world_size": 2, "new_world_size": 1})
    assert backend.latest("raytrainer_world_size") == 1
    hub.event({"event": "finished", "time": 108.0, "step": 40})
    assert backend.latest("raytrainer_steps_per_s") == 0.0 and backend.latest("raytrainer_samples_per_s") == 0.0
    # Ray's tag keys are fixed per metric: the run's, and the cause's where there is one.
    assert ("raytrainer_worker_failures", ("run", "kind")) in backend.made


def test_records_at_most_every_interval_and_the_rest_at_close():
    backend, now = FakeBackend(), [0.0]
    sink, hub = hub_with(backend, clock=lambda: now[0])
    for step in range(1, 6):  # one batch each, within the same second
        hub.write([{"step": step, "time": 100.0 + step / 10, "loss": 1.0 / step}])
    assert [c[2] for c in backend.calls if c[1] == "raytrainer_step"] == [1]
    now[0] = 1.5
    hub.write([{"step": 6, "time": 100.6, "loss": 1 / 6}])
    assert backend.latest("raytrainer_step") == 6
    hub.write([{"step": 7, "time": 100.7, "loss": 1 / 7}])
    hub.close()
    assert backend.latest("raytrainer_step") == 7


def test_nothing_is_recorded_where_ray_exports_no_metrics():
    backend, warned = FakeBackend(exporting=False), []
    sink, hub = hub_with(backend, warned=warned)
    hub.write([{"step": 1, "time": 1.0, "loss": 0.5, "world_size": 2}])
    hub.event({"event": "worker_failed", "time": 2.0, "step": 1, "rank": 0, "kind": "died", "cause": "x"})
    sink.gauge("goodput", 0.9)
    hub.close()
    assert backend.made == [] and backend.calls == []
    assert not warned  # nobody asked for them


def test_the_goodput_hook_publishes_a_series_of_the_run():
    backend = FakeBackend()
    sink, hub = hub_with(backend)
    sink.gauge("goodput", 0.93)
    assert backend.latest("raytrainer_goodput", run="demo") == 0.93
    with pytest.raises(ValueError):
        sink.gauge("good-put", 1.0)


def test_a_failing_ray_turns_the_sink_off_with_one_warning():
    class Broken(FakeBackend):
        def gauge(self, name, description, tag_keys):
            raise RuntimeError("no metrics for you")

    warned = []
    sink, hub = hub_with(Broken(), warned=warned)
    hub.write([{"step": 1, "time": 1.0, "loss": 0.5}])
    hub.write([{"step": 2, "time": 2.0, "loss": 0.4}])
    assert not sink.on and len(warned) == 1 and "no metrics for you" in warned[0]


SCRAPED_RUN = textwrap.dedent("""
    import json, sys, time, urllib.request
    import ray, raytrainer

    port, storage = int(sys.argv[1]), sys.argv[2]
    ray.init(include_dashboard=False, num_cpus=2, _metrics_export_port=port, logging_level="WARNING")
    raytrainer.train({"task": {"target": "tests.tasks:RegressionTask", "args": {"num_samples": 128}},
                      "trainer": {"max_epochs": 1, "global_batch_size": 32},
                      "scaling": {"num_workers": 1}, "run": {"name": "scraped", "storage": storage}},
                     progress=False)
    deadline, lines = time.monotonic() + 30, []
    while time.monotonic() < deadline:  # the driver's last values, exported within a report interval
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        lines = [l for l in text.splitlines() if l.startswith("ray_raytrainer_")]
        if {"ray_raytrainer_step", "ray_raytrainer_loss", "ray_raytrainer_goodput"} <= {l.split("{")[0] for l in lines}:
            break
        time.sleep(0.5)
    print(json.dumps(lines))
""")


def test_a_run_is_in_rays_prometheus_endpoint(tmp_path):
    [port] = free_ports(1)
    # A Ray of its own (the suite's runs with metrics off), reporting every second, not 10.
    env = own_ray_env(RAY_enable_metrics_collection="1", RAY_metrics_report_interval_ms="1000",
                      RAYTRAINER_KEEP_RAY="0")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", SCRAPED_RUN, str(port), str(tmp_path)], env=env,
                         cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = json.loads(out.stdout.strip().splitlines()[-1])
    series = {line.split("{")[0] for line in lines if 'run="scraped"' in line}
    assert {"ray_raytrainer_step", "ray_raytrainer_loss", "ray_raytrainer_samples_per_s",
            "ray_raytrainer_world_size", "ray_raytrainer_goodput"} <= series, lines
    goodput = next(line for line in lines if line.startswith("ray_raytrainer_goodput{"))
    assert 0 < float(goodput.rsplit(" ", 1)[1]) <= 1  # the ledger's, published by the driver
    step = next(line for line in lines if line.startswith("ray_raytrainer_step{"))
    assert float(step.rsplit(" ", 1)[1]) == 4  # 128 samples / 32 a step


def test_the_grafana_dashboard_shows_every_series_and_only_those():
    from raytrainer.driver.raymetrics import COUNTERS, GAUGES

    dashboard = json.loads((Path(__file__).parents[1] / "cluster" / "grafana" / "raytrainer.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"\bray_raytrainer_\w+", target["expr"])}
    # Ray's naming: its prefix on every name, and a counter's _total; goodput is the ledger's, by the hook.
    exported = ({f"ray_raytrainer_{name}" for name in [*GAUGES, "goodput"]}
                | {f"ray_raytrainer_{name}_total" for name in COUNTERS})
    assert queried == exported
