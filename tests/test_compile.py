"""trainer.compile: the config, a compiled run against an uncompiled one, and what a
recovery compiles (nothing on a survivor; from inductor's run cache on a replacement).

Every worker sends a `compiled` event after its first compiled step in a group, with
dynamo's graph count and inductor's cache hits and misses (worker/loop/compiling.py): the
tests read torch's own counters through it, not timings."""

import pytest
import torch

import raytrainer
from raytrainer.config import CompileConfig, load_config
from raytrainer.errors import ConfigError
from raytrainer.worker.loop.compiling import run_cache_dir


def raw(tmp_path, name, compile_, workers=2, steps=8, chaos=(), strategy="ddp", **failure):
    return {
        "task": {"target": "tests.tasks:CompiledTask"},
        "trainer": {"max_steps": steps, "global_batch_size": 32, "log_every_n_steps": 2, "compile": compile_,
                    "strategy": strategy},
        "scaling": {"num_workers": workers},
        "failure": {"chaos": list(chaos), "step_timeout_s": 30, **failure},
        "run": {"name": name, "storage": str(tmp_path)},
    }


def last_loss(result):
    return [r for r in result.history if "loss" in r][-1]


def compiled_events(result):
    return [e for e in result.events if e["event"] == "compiled"]


def by_process(result) -> dict[int, list[dict]]:
    """Each worker process's counts, in the order of the `compiled` events (one per group
    it trained in), with the event's step."""
    found: dict[int, list[dict]] = {}
    for event in compiled_events(result):
        for worker in event["workers"]:
            found.setdefault(worker["pid"], []).append({**worker, "step": event["step"]})
    return found


@pytest.mark.parametrize("value, expected", [
    (True, CompileConfig()), (False, None), (None, None),
    ({"mode": "max-autotune", "dynamic": True}, CompileConfig(mode="max-autotune", dynamic=True)),
])
def test_compile_is_off_true_or_torch_compiles_options(tmp_path, value, expected):
    assert load_config(raw(tmp_path, "c", value)).trainer.compile == expected


@pytest.mark.parametrize("value, message", [
    ("yes", "trainer.compile='yes' has the wrong type or value; allowed: bool | mapping | null"),
    ({"mode": "fast"}, "trainer.compile.mode='fast'"),
    ({"backend": " "}, "trainer.compile.backend must name a torch.compile backend"),
    ({"fullgraf": True}, "unknown key 'trainer.compile.fullgraf'"),
])
def test_a_wrong_compile_setting_names_the_key(tmp_path, value, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_config(raw(tmp_path, "c", value))


@pytest.fixture(scope="module")
def eager(ray_local, tmp_path_factory):
    return raytrainer.train(raw(tmp_path_factory.mktemp("eager"), "eager", None), progress=False)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])  # compiled after DDP wraps it, or after fully_shard
def test_a_compiled_run_trains_like_an_uncompiled_one(eager, tmp_path, strategy):
    # aot_eager: dynamo's capture and AOTAutograd's joint graph, the parts that decide
    # whether the compiled step is the same step, without inductor's C++ build (a minute
    # of a loaded 2-core machine); the kill test below covers inductor.
    compiled = raytrainer.train(raw(tmp_path, strategy, {"backend": "aot_eager"}, strategy=strategy), progress=False)
    assert last_loss(compiled)["step"] == last_loss(eager)["step"] == 8
    assert last_loss(compiled)["loss"] == pytest.approx(last_loss(eager)["loss"], rel=1e-4)
    a, b = (torch.load(r.run_dir / "model.pt", weights_only=True) for r in (eager, compiled))
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    (event,) = compiled_events(compiled)
    assert [w["rank"] for w in event["workers"]] == [0, 1]  # every worker compiled ...
    assert all(w["compiled_graphs"] >= 1 for w in event["workers"])  # ... a graph, not an eager fall-back
    assert not compiled_events(eager)


def test_a_survivor_does_not_recompile_after_a_kill_and_a_replacement_hits_the_run_cache(ray_local, tmp_path):
    # Rank 1 SIGKILLed after step 3: rank 0 survives and (recovery: exact) re-forms at 2
    # with a warm spare or a new process; both report their counts after the first step in
    # the new group. Inductor: the cache is inductor's.
    kill = [{"action": "kill", "step": 3, "rank": 1}]
    result = raytrainer.train(raw(tmp_path, "kill", {}, steps=8, chaos=kill, recovery="exact"), progress=False)
    assert result.metrics["step"] == 8
    assert [e for e in result.events if e["event"] == "recovered"]
    by_pid = by_process(result)
    survivors = [events for events in by_pid.values() if len(events) == 2]
    assert len(survivors) == 1, by_pid  # the survivor: before and after the re-form
    before, after = survivors[0]
    assert after["step"] > before["step"] >= 1
    assert after["compiled_graphs"] == before["compiled_graphs"] >= 1  # dynamo compiled nothing anew
    assert before["new_graphs"] >= 1 and after["new_graphs"] == 0
    assert after["fx_cache_misses"] == before["fx_cache_misses"]
    (newcomer,) = [events[0] for pid, events in by_pid.items() if len(events) == 1 and events[0]["step"] > 3]
    # The replacement compiled before it joined (warm.compile_ahead), from the run's
    # inductor cache, none built anew: its first step in the group compiled nothing.
    assert newcomer["compiled_graphs"] >= 1 and newcomer["new_graphs"] == 0
    assert newcomer["fx_cache_hits"] >= 1 and newcomer["fx_cache_misses"] == 0
    # Rank 0 built the first graphs and put them in the run directory, for other nodes;
    # the run finished, so its cache directory on this node is gone.
    first = compiled_events(result)[0]
    assert first["shared_bytes"] > 0 and list((result.run_dir / "compiled").glob("torch-*.bin"))
    assert not run_cache_dir(load_config(raw(tmp_path, "kill", {}))).exists()


# A worker on another node: its own temporary directory, so its own run cache directory.
_COMPILE_IN_A_PROCESS = """
import json, os, sys
from raytrainer.config import load_config
from raytrainer.worker.loop import compiling
from raytrainer.worker import _internals
config = load_config(json.loads(sys.argv[1]))
compiling.use_run_cache(config)
_internals.import_inductor()  # as a worker does before it loads (which makes the directory, empty)
loaded = compiling.load_run_artifacts(config)
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
compiling.compiled(model, config.trainer.compile)(torch.randn(4, 8)).sum().backward()
shared = compiling.share_run_artifacts(config.run) if sys.argv[2] == "share" else 0
print(json.dumps({"loaded": loaded, "shared": shared, "dir": str(compiling.run_cache_dir(config)),
                  **_internals.compile_counts()}))
"""


def _compile_on_a_node(cfg, node_tmp, share):
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TMPDIR": str(node_tmp)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", _COMPILE_IN_A_PROCESS, json.dumps(cfg), share], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two processes compile with inductor (its C++ build): a minute on a loaded 2-core machine
def test_a_worker_on_another_node_takes_what_the_run_compiled_from_the_run_directory(tmp_path):
    cfg = raw(tmp_path / "storage", "nodes", {})
    for node in ("node-a", "node-b"):
        (tmp_path / node).mkdir()
    first = _compile_on_a_node(cfg, tmp_path / "node-a", "share")
    assert first["loaded"] == 0 and first["fx_cache_misses"] >= 1 and first["shared"] > 0
    assert list((tmp_path / "storage" / "nodes" / "compiled").glob("torch-*.bin"))
    second = _compile_on_a_node(cfg, tmp_path / "node-b", "")
    assert second["dir"] != first["dir"]  # another node's directory, empty before
    assert second["loaded"] >= 1 and second["fx_cache_hits"] >= 1 and second["fx_cache_misses"] == 0
    # A node whose directory is there already (a peer compiled or loaded): nothing loaded.
    third = _compile_on_a_node(cfg, tmp_path / "node-b", "")
    assert third["loaded"] == 0 and third["fx_cache_hits"] >= 1
