"""The private torch and Ray names raytrainer uses (worker/_internals.py, driver/_internals.py)
still exist, and torch still reports a lost Gloo peer as those modules expect: an upgrade
that breaks one fails here, naming what it broke, not in the middle of a recovery."""

import datetime
import inspect
import multiprocessing as mp
import os
import queue
import signal
import subprocess
import sys
import time

import pytest
import ray
import torch
import torch.distributed as dist

from raytrainer.driver import _internals as driver_internals
from raytrainer.worker import _internals
from raytrainer.worker.process.actor import _peer_failure

from .ray_procs import free_ports
from .waits import wait_until

TORCH, RAY = f"torch {torch.__version__}", f"Ray {ray.__version__}"


def _has(obj, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def _module(name):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        return None


# (whose, module, attribute path, what raytrainer uses it for)
NAMES = [
    (TORCH, "torch.distributed.distributed_c10d", "_world.group_count",
     "naming a process group after a failed rendezvous as a new process does (_internals.reset_group_count)"),
    (TORCH, "torch.distributed.distributed_c10d", "_abort_process_group",
     "tearing down a group whose collective is pending after a failure (_internals.abort_process_group)"),
    (TORCH, "torch._C._distributed_c10d", "Reducer._rebuild_buckets",
     "keeping DDP's gradient buckets so recovered runs stay bit-identical (_internals.keep_initial_buckets)"),
    (TORCH, "torch.amp", "GradScaler",  # its _device is an instance attribute: checked below
     "making a fresh GradScaler after an interrupted step (_internals.grad_scaler_device)"),
    (TORCH, "torch.nn.modules.batchnorm", "_BatchNorm._check_input_dim",
     "GlooSyncBatchNorm, sync_batchnorm on CPU (_internals.BatchNorm)"),
    (TORCH, "torch", "_foreach_mul_", "FSDP's gradient clipping (_internals.foreach_mul_)"),
    (TORCH, "torch", "_foreach_lerp_", "FSDP's EMA (_internals.foreach_lerp_)"),
    (TORCH, "torch.distributed.checkpoint._traverse", "set_element",
     "loading a sharded checkpoint's non-tensor values (_internals.dcp_set_element)"),
    (TORCH, "torch.serialization", "_get_layout", "reading a DCP .metadata file (_internals.DCP_METADATA_GLOBALS)"),
    (TORCH, "torch.distributed.checkpoint.filesystem", "_StorageInfo",
     "reading a DCP .metadata file (_internals.DCP_METADATA_GLOBALS)"),
    (TORCH, "torch.distributed.checkpoint.filesystem", "FileSystemReader._slice_file",
     "one ranged read per item of a sharded checkpoint on S3 (_internals.dcp_reader_base)"),
    (TORCH, "torch.utils.data.dataloader", "_MultiProcessingDataLoaderIter._shutdown_workers",
     "stopping loader processes of an abandoned epoch (_internals.shutdown_loader_iterator)"),
    (TORCH, "torch", "_dynamo", "importing torch._dynamo before a worker is needed (_internals.import_dynamo)"),
    (TORCH, "torch._inductor.compile_fx", "compile_fx", "importing inductor before a compiling worker is needed (_internals.import_inductor)"),
    (TORCH, "torch._dynamo.utils", "counters", "trainer.compile's graph and cache counts (_internals.compile_counts)"),
    (RAY, "ray.experimental.internal_kv", "_internal_kv_put",
     "firing each failure.chaos fault once per run (_internals.kv_put_if_absent)"),
    (RAY, "ray._private.worker", "_global_node",
     "telling whether the driver started its Ray (driver/_internals.started_local_ray)"),
    (RAY, "ray._private.state", "state.get_draining_nodes",
     "leaving nodes drained for preemption before their deadline (driver/_internals.draining_nodes)"),
    (RAY, "ray._private.services", "find_bootstrap_address",
     "joining a user's `ray start` Ray before the kept local Ray (driver/_internals.bootstrap_address)"),
    (RAY, "ray._private.authentication.authentication_token_setup", "logger",
     "not printing Ray's token-auth notice for a Ray raytrainer starts (driver/_internals.quiet_token_auth_notice)"),
    (RAY, "ray._private.services", "get_node",
     "a node's start given longer than Ray's fixed 30 s (driver/_internals.patient_node_start)"),
    (RAY, "ray._private.utils", driver_internals.dashboard_check()[0],
     "a minimal dashboard agent in the Rays raytrainer starts (driver/_internals.minimal_dashboard_agent)"),
    (RAY, "ray._raylet", "persist_port",
     "writing a minimal agent's ports before its raylet waits for them (driver/_internals.agent_ports_given)"),
    (RAY, "ray._private.utils", "set_kill_on_parent_death_linux",
     "a Ray started for the run in process groups of its own (driver/_internals.own_process_groups)"),
    (RAY, "ray._private.utils", "get_ray_address_file",
     "naming the file of a dead `ray start` head in the warning (driver/_internals.bootstrap_address)"),
    (RAY, "ray._private.worker", "print_to_stdstream",
     "not printing Ray's death notice of a worker raytrainer killed itself (driver/_internals.mute_death_notice)"),
    (RAY, "ray._private.authentication.authentication_token_setup", "maybe_enable_token_auth_if_token_available",
     "joining a kept local Ray that runs with token auth (driver/_internals.enable_token_auth)"),
]


def test_a_placement_group_can_still_be_soft_targeted_at_a_node():
    """driver/_internals.single_slot_on: ray.util.placement_group's private keyword."""
    from ray.util.placement_group import placement_group

    assert "_soft_target_node_id" in inspect.signature(placement_group).parameters, (
        f"{RAY}: placement_group lost _soft_target_node_id, which places each worker's own group on the "
        "node the first gang placement chose (driver/_internals.single_slot_on)")


def test_a_node_ray_starts_still_runs_its_dashboard_agent_minimal_where_ray_default_is_missing():
    """driver/_internals.minimal_dashboard_agent: services.start_raylet adds --minimal to the
    agent's command where ray._private.utils says ray[default] is missing (it is installed
    here: it says so only inside)."""
    from ray._private import services, utils

    name, answer = driver_internals.dashboard_check()
    source = inspect.getsource(services.start_raylet)
    assert f"ray._private.utils.{name}()" in source and '"--minimal"' in source, (
        f"{RAY}: the dashboard agent's --minimal no longer follows {name}, which raytrainer answers so that "
        "the raylet of a Ray it starts does not abort after 15 s waiting for a full agent on a loaded machine "
        "(driver/_internals.minimal_dashboard_agent)")
    installed = getattr(utils, name)()
    with driver_internals.minimal_dashboard_agent():
        assert type(getattr(utils, name)()) is type(answer()) and getattr(utils, name)() != installed
    assert getattr(utils, name)() == installed


def test_a_process_ray_starts_still_dies_with_its_parent_through_the_function_raytrainer_extends():
    """driver/_internals.own_process_groups extends ray._private.utils.set_kill_on_parent_death_linux,
    which services.start_ray_process calls, looked up at the call, in the child before it runs
    the program, where kernel fate-sharing is on."""
    from ray._private import services

    source = inspect.getsource(services.start_ray_process)
    assert "ray._private.utils.set_kill_on_parent_death_linux()" in source and "preexec_fn" in source, (
        f"{RAY}: services.start_ray_process no longer calls utils.set_kill_on_parent_death_linux in the child, "
        "which raytrainer extends so that a Ray started for a run is not stopped by a signal to the run's process "
        "group (driver/_internals.own_process_groups)")


def test_a_raylet_is_still_started_with_its_agents_ports_where_raytrainer_gives_them():
    """driver/_internals.agent_ports_given reads these arguments of services.start_raylet and
    gives the runtime env agent's port; the raylet is told that port, the agent binds it."""
    from ray._private import services

    source = inspect.getsource(services.start_raylet)
    named = set(inspect.signature(services.start_raylet).parameters)
    wanted = {"session_dir", "node_id", "node_ip_address", "metrics_agent_port", "metrics_export_port",
              "runtime_env_agent_port"}
    assert wanted <= named and "--runtime_env_agent_port={runtime_env_agent_port}" in source \
        and "--runtime-env-agent-port={runtime_env_agent_port}" in source, (
        f"{RAY}: services.start_raylet no longer takes {sorted(wanted - named)} or no longer passes the runtime "
        "env agent's port to the raylet and the agent, which raytrainer gives so that the raylet does not abort "
        "after 15 s waiting for its agents on a loaded machine (driver/_internals.agent_ports_given)")


def test_a_port_given_to_an_agent_stays_held_until_the_agent_has_bound_and_written_it(tmp_path):
    """driver/_internals.held_until_served: the runtime env agent's port, chosen before its
    node starts, is held until the agent has written it, and the agent's own bind and listen
    (runtime_env/agent/main.py: SO_REUSEADDR, then listen) succeed meanwhile."""
    import socket

    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("127.0.0.1", 0))
    port = held.getsockname()[1]
    written = tmp_path / "runtime_env_agent_port"
    driver_internals.held_until_served(held, str(written))
    time.sleep(0.5)
    assert held.fileno() != -1  # nothing written yet: still held
    with socket.socket() as agent:
        agent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        agent.bind(("127.0.0.1", port))
        agent.listen()
        written.write_text(str(port))
        wait_until(lambda: held.fileno() == -1, "the held port released once its agent wrote it", 30)
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass  # the agent serves it


def test_a_node_ray_starts_still_waits_for_its_raylet_through_services_get_node():
    """driver/_internals.patient_node_start replaces services.get_node, which Ray's fixed wait
    for a new node's raylet asks in a loop."""
    source = inspect.getsource(ray._private.node.Node.__init__)
    assert "raylet_start_wait_time_s" in source and "ray._private.services.get_node(" in source, (
        f"{RAY}: a node's start no longer waits for its raylet by asking services.get_node, which raytrainer "
        "replaces to give a slow start longer than 30 s (driver/_internals.patient_node_start)")


def test_a_slow_node_start_is_waited_for_while_its_raylet_lives_and_no_longer(monkeypatch):
    """driver/_internals.patient_node_start: each services.get_node that Ray's loop makes
    (one call here) waits for the node while its raylet lives, up to the time given."""
    from ray._private import services

    asked = []
    registered_at = {"ab" * 28: 4, "cd" * 28: None}  # the node's raylet registers at this ask (None: never)

    def get_node(gcs_address, node_id):
        asked.append(node_id)
        if len(asked) != registered_at[node_id]:
            raise RuntimeError("Failed to get node info")  # as Ray's, while the raylet has not registered
        return {"NodeID": node_id}

    monkeypatch.setattr(services, "get_node", get_node)
    # Processes with the raylet's flag naming the node in their command line, as a raylet has.
    raylets = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"--node_id={node}"])
               for node in registered_at]
    try:
        with driver_internals.patient_node_start(30):
            assert services.get_node("gcs:1", "ab" * 28) == {"NodeID": "ab" * 28}
        assert len(asked) == 4 and services.get_node is get_node

        asked.clear()
        started = time.monotonic()
        with driver_internals.patient_node_start(0.5), pytest.raises(RuntimeError):  # up to its time, no longer
            services.get_node("gcs:1", "cd" * 28)
        assert time.monotonic() - started >= 0.5 and len(asked) >= 2

        raylets[1].kill()
        raylets[1].wait()
        asked.clear()
        with driver_internals.patient_node_start(30), pytest.raises(RuntimeError):  # its raylet gone: at once
            services.get_node("gcs:1", "cd" * 28)
        assert len(asked) == 1
    finally:
        for raylet in raylets:
            raylet.kill()
            raylet.wait()


@pytest.fixture
def keeper_sigterm():
    """This process's SIGTERM handler, put back after a test that runs localray.keep here
    (the keeper sets its own)."""
    term = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, term)


def test_every_ray_raytrainer_starts_is_patient_with_its_node(monkeypatch, tmp_path, keeper_sigterm):
    """patient_node_start (and with it a minimal dashboard agent) is in force where raytrainer
    starts a node: the kept Ray's keeper, a Ray for one run, and the bench's (and the tests')
    multi-node clusters."""
    from ray._private import services, utils
    from ray.cluster_utils import Cluster

    from raytrainer.bench.rt import local_cluster
    from raytrainer.driver import localray

    plain, start_raylet = services.get_node, services.start_raylet
    check = driver_internals.dashboard_check()[0]
    installed = getattr(utils, check)()
    patient = []

    class Starting(Exception):
        pass

    def starts_a_node(*args, **kwargs):
        patient.append((services.get_node is not plain, getattr(utils, check)() != installed,
                        services.start_raylet is not start_raylet))
        raise Starting  # no Ray started: what is asked is only under what it would start

    monkeypatch.setattr(ray, "init", starts_a_node)
    monkeypatch.setattr(Cluster, "add_node", starts_a_node)
    for start in (lambda: localray._start_for_this_run("local", {}), lambda: localray.keep(tmp_path, 1.0),
                  lambda: local_cluster(str(tmp_path))):
        with pytest.raises(Starting):
            start()
    assert patient == [(True, True, True)] * 3
    assert services.get_node is plain and services.start_raylet is start_raylet
    assert getattr(utils, check)() == installed


def test_a_kept_rays_start_that_fails_says_why_from_its_nodes_logs(monkeypatch, tmp_path, capsys, keeper_sigterm):
    """Ray's exception says only "The current node timed out during startup": the keeper
    writes the raylet's and the GCS's error lines, and the raylet's last, into keeper.log
    (its stderr), which the run prints as it starts a Ray of its own instead."""
    from raytrainer.driver import localray

    logs = tmp_path / "ray" / "session_latest" / "logs"
    logs.mkdir(parents=True)
    (logs / "raylet.out").write_text(
        "[2026-11-30 08:00:00,001 I 11 11] (raylet) main.cc:283: Setting cluster ID\n"
        "[2026-11-30 08:00:15,002 F 11 11] (raylet) node_manager.cc:3192: Check failed: ports_ready Timed out\n"
        "[2026-11-30 08:00:15,003 I 11 11] (raylet) the last line\n")
    (logs / "gcs_server.err").write_text("[2026-11-30 08:00:16,004 E 12 12] (gcs_server) gcs.cc:1: a GCS error\n")

    def times_out(*args, **kwargs):
        raise Exception("The current node timed out during startup.")

    monkeypatch.setattr(ray, "init", times_out)
    with pytest.raises(Exception, match="timed out during startup"):
        localray.keep(tmp_path, 1.0)
    err = capsys.readouterr().err
    assert "raylet.out: [2026-11-30 08:00:15,002 F 11 11]" in err and "Check failed: ports_ready" in err
    assert "gcs_server.err: [2026-11-30 08:00:16,004 E 12 12]" in err and "Setting cluster ID" not in err
    assert "its last line: [2026-11-30 08:00:15,003 I 11 11] (raylet) the last line" in err


def test_rays_death_notice_of_a_worker_raytrainer_killed_is_not_printed_and_any_other_is(capsys):
    """driver/_internals.mute_death_notice, on a notice as Ray 2.60 words it (the frozen-worker
    test of test_failure_shapes checks Ray's own, from a run)."""
    import ray._private.worker as ray_worker

    def notice(pid):
        return {"pid": "raylet", "is_err": False, "lines": [
            "A worker died or was killed while executing a task by an unexpected system error. To troubleshoot "
            f"the problem, check the logs for the dead worker. Worker IP address: 10.0.0.1 Worker port: 33715 "
            f"Worker PID: {pid} Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits"]}

    driver_internals.mute_death_notice(4242001)
    driver_internals.mute_death_notice(4242002)  # installed once, however often called
    ray_worker.print_to_stdstream(notice(4242001), ignore_prefix=False)
    ray_worker.print_to_stdstream(notice(4242002), ignore_prefix=False)
    assert capsys.readouterr().out == ""
    ray_worker.print_to_stdstream(notice(4242003), ignore_prefix=False)  # a death raytrainer did not cause
    ray_worker.print_to_stdstream({"pid": 77, "is_err": False, "lines": ["a worker's own line"]}, ignore_prefix=False)
    out = capsys.readouterr().out
    assert "Worker PID: 4242003" in out and "a worker's own line" in out


@pytest.mark.parametrize("whose,module,name,why", NAMES, ids=[f"{m}.{n}" for _, m, n, _ in NAMES])
def test_the_private_names_raytrainer_uses_exist(whose, module, name, why):
    found = _module(module)
    assert found is not None and _has(found, name), f"{whose} removed {module}.{name}, which raytrainer uses for {why}"


def test_accelerates_state_reset_is_where_it_was():
    state = pytest.importorskip("accelerate.state", reason="accelerate (raytrainer[hf]) is not installed")
    import accelerate

    assert callable(getattr(state.AcceleratorState, "_reset_state", None)), (
        f"accelerate {accelerate.__version__} removed AcceleratorState._reset_state, which raytrainer uses "
        "for a Hugging Face Trainer's world size after a re-form (_internals.reset_accelerate_state)")


def test_the_flight_recorder_and_the_scalers_device_are_where_they_were():
    # The flight recorder is optional (no dump on an older CPU build); on the torch we pin, it is there.
    if torch.__version__.startswith("2.13"):
        assert _internals.flight_recorder_dump() is not None, (
            f"{TORCH} removed torch._C._distributed_c10d._dump_fr_trace_json, which raytrainer uses for "
            "the record of a hung worker's collectives (_internals.flight_recorder_dump)")
    assert _internals.grad_scaler_device(torch.amp.GradScaler("cpu")) == "cpu", (
        f"{TORCH} removed GradScaler._device, which raytrainer uses for a fresh scaler after an interrupted step")


def test_a_dataloader_still_keeps_its_persistent_iterator_where_raytrainer_takes_it():
    """_internals.take_loader_iterator: a loader with persistent_workers keeps its iterator
    (and its processes) in its private _iterator, reused by the next __iter__."""
    from torch.utils.data import DataLoader

    loader = DataLoader(list(range(8)), batch_size=2, num_workers=1, persistent_workers=True,
                        multiprocessing_context="spawn")
    assert _internals.take_loader_iterator(loader) is None  # none made yet
    try:
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        kept = _internals.take_loader_iterator(loader)
    finally:
        _internals.shutdown_loader_iterator(getattr(loader, "_iterator", None))
    assert kept is not None, (f"{TORCH} no longer keeps a persistent_workers DataLoader's iterator in "
                              "DataLoader._iterator, which raytrainer stops the loader processes through "
                              "(_internals.take_loader_iterator)")
    _internals.shutdown_loader_iterator(kept)
    assert _internals.take_loader_iterator(loader) is None  # taken: the loader holds it no more


def test_ddp_still_rebuilds_its_buckets_through_the_reducer_hook():
    """_FixedBuckets works only while DDP's forward asks its reducer to rebuild."""
    source = inspect.getsource(torch.nn.parallel.DistributedDataParallel)
    assert "reducer._rebuild_buckets()" in source, (
        f"{TORCH}'s DistributedDataParallel no longer calls reducer._rebuild_buckets(), which raytrainer "
        "replaces to keep the gradient buckets (and so bit-identical recoveries): see _internals._FixedBuckets")


# ---------------------------------------------------------------------------- a lost Gloo peer


def _rank(rank, world, port, how, results):
    """Join a Gloo group; rank 1 is lost (`how`); the others report what they raised."""
    torch.set_num_threads(1)
    try:
        timeout = datetime.timedelta(seconds=3 if how == "rendezvous" else 60)
        if how == "rendezvous" and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # never comes
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        tensor = torch.ones(100_000)
        for i in range(1000):
            if rank == 1 and i == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(tensor)
        results.put((rank, None, None, False))
    except Exception as exc:  # noqa: BLE001 - what the test is about
        results.put((rank, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), _peer_failure(exc)))


def _lost_peer(how: str, world: int = 2) -> list[tuple]:
    ctx = mp.get_context("fork")
    results, (port,) = ctx.Queue(), free_ports(1)
    procs = [ctx.Process(target=_rank, args=(r, world, port, how, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return [results.get(timeout=60) for _ in range(world - 1)]
    except queue.Empty:
        raise AssertionError(f"the survivors of a peer lost in {how} did not raise within 60 s") from None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


def test_a_peer_lost_in_a_gloo_collective_is_a_peer_failure():
    """Measured on torch 2.13: a bare RuntimeError naming Gloo's transport (the only message
    raytrainer matches). Typed instead, the match can go; worded otherwise, it must change."""
    ((rank, kind, message, peer),) = _lost_peer("collective")
    assert kind is not None, "the survivor's all_reduce did not fail when its peer was SIGKILLed"
    assert kind == "builtins.RuntimeError", (
        f"{TORCH} now raises {kind} for a Gloo peer lost in a collective: match it by type in "
        "actor._peer_failure and drop _internals.is_gloo_transport_error")
    assert _internals.GLOO_TRANSPORT_MARKER in message, (
        f"{TORCH} changed the message of a Gloo peer lost in a collective, which raytrainer matches to "
        f"recover instead of failing the run (_internals.is_gloo_transport_error): {message!r}")
    assert peer


def test_a_peer_lost_before_the_rendezvous_is_a_typed_peer_failure():
    ((rank, kind, message, peer),) = _lost_peer("rendezvous")
    assert kind == "torch.distributed.DistStoreError", f"{TORCH} raised {kind} ({message!r}) for a peer that never came"
    assert peer


def test_a_workers_own_error_is_not_a_peer_failure():
    assert not _peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not _peer_failure(ValueError("gloo/transport/ in a user's message is not Gloo's"))
    assert _peer_failure(dist.DistNetworkError("Broken pipe"))


def test_dynamos_counters_still_count_graphs_and_inductors_cache_hits():
    """The keys compile_counts reads (a renamed key would read 0 for ever, silently)."""
    from pathlib import Path

    from torch._dynamo.utils import counters

    counters.clear()
    model = torch.compile(torch.nn.Linear(2, 1), backend="aot_eager")
    model(torch.ones(1, 2)).sum().backward()
    assert _internals.compile_counts()["compiled_graphs"] == 1
    source = Path(torch.__file__).parent
    assert 'counters["inductor"]["fxgraph_cache_hit"]' in (source / "_inductor/codecache.py").read_text()
    assert 'counters["aot_autograd"]["autograd_cache_hit"]' in (
        source / "_functorch/_aot_autograd/autograd_cache.py").read_text()
