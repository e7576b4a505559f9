"""Fault tolerance: workers killed, hung or raising; the run recovers in memory from the
survivors and ends with the same weights as an undisturbed run."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import raytrainer
from raytrainer.contract import ReformPlan, Status
from raytrainer.errors import ConfigError, TaskError, WorkerError
from raytrainer.driver.policy import (Failure, FailurePolicy, FailuresExceeded, Replacing, StateChoice, blame,
                                      choose_source, choose_state, hand_over_by_copy, keep_waiting_for_placement,
                                      replacing, secure_at_once, secure_where)

from .conftest import assert_no_leaks, assert_no_loader_processes
from .faults import kill
from .test_copies import SHM
from .waits import wait_until


def config(tmp_path, name, chaos=(), workers=2, **failure):
    return {
        # Dropout: the replaced rank must draw the same random numbers as the lost one.
        "task": {"target": "tests.tasks:RegressionTask", "args": {"dropout": 0.1}},
        "trainer": {"max_steps": 24, "global_batch_size": 32, "log_every_n_steps": 4},
        "scaling": {"num_workers": workers},
        # exact: these runs must end bit-identical, whatever spare is up when a worker goes.
        "failure": {"chaos": list(chaos), "step_timeout_s": 4, "recovery": "exact", **failure},
        "run": {"name": name, "storage": str(tmp_path)},
    }


def weights(result):
    return torch.load(result.run_dir / "model.pt", weights_only=True)


def assert_same(a, b):
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def events(result, name):
    return [e for e in result.events if e["event"] == name]


@pytest.fixture(scope="module")
def undisturbed(ray_local, tmp_path_factory):
    return weights(raytrainer.train(config(tmp_path_factory.mktemp("base"), "base"), progress=False))


def test_three_kills_end_bit_identical_to_an_undisturbed_run(undisturbed, tmp_path):
    chaos = [{"action": "kill", "step": 5, "rank": 0}, {"action": "kill", "step": 11, "rank": 1},
             {"action": "kill", "step": 17}]
    result = raytrainer.train(config(tmp_path, "kills", chaos), progress=False)
    assert_same(weights(result), undisturbed)
    failed, recovered = events(result, "worker_failed"), events(result, "recovered")
    assert [f["kind"] for f in failed] == ["died"] * 3 and [f["rank"] for f in failed][:2] == [0, 1]
    assert all(f["node"] and "died" in f["cause"] for f in failed)
    assert len(recovered) == 3 and all(r["steps_lost"] <= 1 for r in recovered)
    assert [r["step"] for r in recovered] == [5, 11, 17]  # each kill came right after its step
    assert all(r["replaced"] and r["seconds"] > 0 for r in recovered)
    # Every step's row once: a redone step is not logged twice, and none is lost with a
    # worker, though each kill left rows no flush had reported yet (log_every_n_steps 4),
    # and the first took rank 0 with what it had not handed to the driver.
    assert [r["step"] for r in result.history if "loss" in r] == list(range(1, 25))
    assert result.metrics["step"] == 24
    assert_no_leaks()


def test_kills_with_loader_processes_end_bit_identical_and_leave_none_behind(undisturbed, tmp_path):
    """With 2 loader processes per rank (the undisturbed run has none): each kill takes
    the killed worker's loader processes with it, the replacement and the survivor start
    theirs again at the step's position, and the weights are the same bits."""
    cfg = config(tmp_path, "loaders", [{"action": "kill", "step": 5, "rank": 0}, {"action": "kill", "step": 11}])
    cfg["data"] = {"num_workers": 2, "prefetch_factor": 3}
    cfg["failure"]["step_timeout_s"] = 60  # starting loader processes on a busy 2-core machine is no hang
    result = raytrainer.train(cfg, progress=False)
    assert_same(weights(result), undisturbed)
    assert [r["step"] for r in events(result, "recovered")] == [5, 11]
    assert_no_leaks()
    assert_no_loader_processes()


def test_a_spare_that_does_not_answer_is_not_counted_on_though_its_node_looks_alive(ray_local, tmp_path):
    """A spare gone with its node stays "up" to Ray until its health checks fail (~15 s);
    a recovery that counted on it failed and started over. Here its process is SIGKILLed on
    a node that is alive: it answered once, and must answer again to be counted on. Before,
    it is up but not built while its build of the task is held (a large model's build at
    nice 19), and built once let go."""
    import ray

    from raytrainer.config import load_config
    from raytrainer.driver.group.actors import start_spare
    from raytrainer.driver.group.spares import Spare, WarmSpares

    held = tmp_path / "held"
    held.write_text("!")  # every process building the task waits while it exists (tasks._stall)
    cfg = config(tmp_path, "spare")
    cfg["task"]["args"]["stall_pid_file"] = str(held)
    spares = WarmSpares(load_config(cfg), 1)
    node = ray.get_runtime_context().get_node_id()
    actor = start_spare(spares.config, node)
    spares.spares.append(Spare(actor, actor.node.remote(), node))
    try:
        up = spares.spares[0].up  # a torch import at nice 19: minutes beside busy loops
        wait_until(lambda: ray.wait([up], timeout=0)[0], "the spare up", 120)
        pid = ray.get(up).pid
        assert spares.ready_on([node, node]) == [False, None]  # one spare, one place, still building
        held.unlink()
        wait_until(lambda: spares.ready_on([node]) == [True], "the spare built", 60)
        kill(pid)
        t0 = time.monotonic()
        assert spares.ready_on([node]) == [None] and spares.spares == []  # let go
        assert time.monotonic() - t0 < 5
    finally:
        held.unlink(missing_ok=True)
        spares.shutdown()
    assert_no_leaks()


def test_warm_spares_start_once_training_runs_and_take_lost_workers_places(ray_local, tmp_path):
    """No spare while the workers build their task and take their first step (it would
    import torch on their cores); failure.warm_spares of them once a step is reported; lost
    workers' places go to them, not to cold starts, which take over with the model and
    optimizer they built while they waited (worker/process/warm.py)."""
    from raytrainer.config import load_config
    from raytrainer.driver.group import RayWorkerGroup

    cfg = config(tmp_path, f"spares-{os.getpid()}", workers=3, warm_spares=2)
    cfg["trainer"]["max_steps"] = 10**6
    cfg["task"]["args"].update(sleep_s=0.02, builds_to=str(tmp_path / "builds"))
    group = RayWorkerGroup(load_config(cfg), use_gpu=False, cluster_can_grow=False)
    try:
        nodes = group.start()
        group.setup()
        assert group.spares.spares == []
        group.launch()
        stepped, deadline = False, time.monotonic() + 120
        while not group.spares.spares and time.monotonic() < deadline:
            stepped |= any("loss" in row for row in group.poll(0.1).rows)
        assert stepped  # started at the poll that brought a step's row, not before
        spares = [spare.actor for spare in group.spares.spares]
        assert len(spares) == 2
        import ray

        # node() is answered once a spare is up (torch imported): processes of their own
        pids = {ray.get(spare.node.remote(), timeout=120).pid for spare in spares}
        assert len(pids) == 2 and not pids & {n.pid for n in nodes}
        deadline = time.monotonic() + 120
        while len(builds(tmp_path, pids)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        built = builds(tmp_path, pids)
        assert len(built) == 2
        killed_at = time.time()
        kill(nodes[1].pid)
        kill(nodes[2].pid)
        failed, deadline = [], time.monotonic() + 60
        while len(failed) < 3 and time.monotonic() < deadline:  # ranks 1, 2 died, rank 0 interrupted
            failed += group.poll(0.5).failures
        assert sorted(f.rank for f in failed) == [0, 1, 2]
        assert set(group.spares_ready([1, 2])) == {1, 2}
        reformed = group.reform(ReformPlan(dead=[1, 2]))
        assert reformed.replaced == [1, 2] and set(group.actors[1:]) == set(spares)
        # Built once each, before the kill: their setup adopted what they built.
        assert builds(tmp_path, pids) == built and all(t < killed_at for _, t in built)
        # On the survivor's node, they took its state from the copy it wrote in shared memory,
        # not through the object store; the copy goes once they hold the state.
        assert (reformed.state_from, reformed.secured) == ("memory", "copy")
        assert group.copies.holder is None
        wait_until(lambda: not list(SHM.glob(f"raytrainer-copy-spares-{os.getpid()}-*")), "the copy removed", 30)
    finally:
        group.shutdown()
    assert_no_leaks()


def test_a_spare_still_building_is_not_waited_for_where_the_survivors_can_go_on(ray_local, tmp_path):
    """failure.recovery fast (the default): a lost rank whose node's spare is up but still
    building the training state ahead (a large model's build at nice 19 takes seconds) is
    left behind as if no spare were up: the survivors go on at once, its replacement joins
    once up, and the spare stays a spare."""
    from .faults import Run

    held, slow = tmp_path / "held", tmp_path / "slow"
    held.touch()
    slow.touch()
    cfg = config(tmp_path, f"building-{os.getpid()}", recovery="fast")
    # Steps of 0.5 s while `slow` exists: the spare imports torch at nice 19, which beside a
    # busy loop and another session's runs takes minutes (the run of 30 s once ended first).
    cfg["task"] = {"target": "tests.tasks:ElasticTask",
                   "args": {"dropout": 0.1, "sleep_s": 0.5, "slow_while": str(slow), "hold_ahead": str(held)}}
    cfg["trainer"]["max_steps"] = 1200
    run = Run(cfg)
    waiting = tmp_path / "held.waiting"
    try:
        run.wait_for(lambda: waiting.exists() and waiting.read_text().strip(), "the spare up, its build held", 600)
        spare = int(waiting.read_text().split()[0])
        kill(run.pids()[1])
        run.wait_for(lambda: of(run.events(), "recovered"), "the recovery")
        (recovered,) = of(run.events(), "recovered")
        assert (recovered["spares"], recovered["dropped"], recovered["attempts"]) == ([], [1], 1)
        assert recovered["replacing"].startswith("no warm spare ready for rank(s) [1]")
        held.unlink()
        run.wait_for(lambda: [e for e in of(run.events(), "resized") if e["new_world_size"] == 2],
                     "the replacement taken back in")
    finally:
        held.unlink(missing_ok=True)
        slow.unlink()
    result = run.result()
    assert [r["step"] for r in result.history if "loss" in r] == list(range(1, 1201))
    assert recovered["steps_lost"] <= 1
    assert spare not in run.pids()  # the replacement joined; the spare was never taken
    assert_no_leaks()


def of(events, name):
    return [e for e in events if e["event"] == name]


def builds(tmp_path, pids):
    """The task's model builds in processes `pids` (RegressionTask's builds_to), in order."""
    path = tmp_path / "builds"
    lines = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
    return [(int(pid), float(t)) for pid, t in lines if int(pid) in pids]


SPARE_IMPORTS = """
import os, sys, threading, time
from raytrainer.worker.process.actor import _WarmUp

def nice(tid):  # field 19 of /proc/.../stat, after the command name
    text = open(f"/proc/self/task/{tid}/stat").read()
    return int(text[text.rindex(")") + 2:].split()[16])

imports = _WarmUp(None, spare=True)
assert "torch" not in sys.modules or not hasattr(sys.modules["torch"], "optim")
seen = set()
while imports._thread.is_alive():
    try:
        seen.add(nice(imports._thread.native_id))
    except (OSError, TypeError):
        pass
    time.sleep(0.01)  # a busy loop here would take the CPU the nice thread waits for
imports.wait()
import torch._dynamo, raytrainer.worker.loop.loop
print(sorted(seen), nice(threading.get_native_id()), os.nice(0))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_a_warm_spare_imports_torch_on_a_thread_of_the_lowest_priority_and_trains_at_its_own():
    """The spare's import (seconds of CPU, while training runs on the same cores) runs at
    nice 19; the process and its other threads keep their priority."""
    out = subprocess.run([sys.executable, "-c", SPARE_IMPORTS], capture_output=True, text=True, check=True)
    seen, main_thread, process = out.stdout.split("]")[0] + "]", *out.stdout.split("]")[1].split()
    assert "19" in seen and (main_thread, process) == (str(os.nice(0)), str(os.nice(0))), out.stdout


@pytest.mark.hangs
def test_a_hang_is_detected_its_stacks_dumped_and_the_run_recovers(undisturbed, tmp_path):
    chaos = [{"action": "hang", "step": 4, "rank": 1}, {"action": "raise", "step": 9, "rank": 0},
             {"action": "delay", "step": 14, "rank": 1, "seconds": 0.5}]
    result = raytrainer.train(config(tmp_path, "hang", chaos), progress=False)
    assert_same(weights(result), undisturbed)
    failed = events(result, "worker_failed")
    assert [(f["kind"], f["rank"]) for f in failed] == [("hung", 1), ("error", 0)]
    assert "failure.step_timeout_s" in failed[0]["cause"] and "ChaosError" in failed[1]["cause"]
    stacks = list((tmp_path / "hang").glob("stacks-rank1-step*.txt"))
    assert len(stacks) == 1 and "raytrainer/worker/loop/chaos.py" in stacks[0].read_text()  # where it hung
    # Beside them, torch's flight record of its last collectives (Gloo here; NCCL on GPUs).
    # torch < 2.8 records NCCL's only (.ci/oldest.sh runs 2.7).
    from raytrainer.worker import _internals

    if _internals.records_gloo_collectives():
        record = json.loads(stacks[0].with_name(stacks[0].name.replace("stacks", "collectives")
                                                .replace(".txt", ".json")).read_text())
        assert any(e["profiling_name"] == "gloo:all_reduce" for e in record["entries"])
    assert len(events(result, "recovered")) == 2
    assert_no_leaks()


def test_max_losses_exceeded_fails_the_run_with_the_reason(ray_local, tmp_path):
    chaos = [{"action": "kill", "step": 3, "rank": 1}, {"action": "kill", "step": 6, "rank": 1}]
    with pytest.raises(FailuresExceeded, match=r"failure.max_losses=1 exceeded.*rank 1 died"):
        raytrainer.train(config(tmp_path, "max", chaos, max_failures=0, max_losses=1), progress=False)
    log = [json.loads(line) for line in (tmp_path / "max" / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in log if e["event"] in ("worker_failed", "recovered", "failed")] == \
        ["worker_failed", "recovered", "worker_failed", "failed"]
    assert "raise failure.max_losses" in log[-1]["reason"]
    assert_no_leaks()


def test_lost_workers_do_not_use_up_max_failures(ray_local, tmp_path):
    """Killed from outside three times with max_failures 0: the cluster's losses, each
    recovered, counted apart in the events."""
    chaos = [{"action": "kill", "step": s, "rank": 1} for s in (3, 9, 15)]
    result = raytrainer.train(config(tmp_path, "losses", chaos, max_failures=0), progress=False)
    recovered = events(result, "recovered")
    assert [(e["losses"], e["faults"]) for e in recovered] == [(1, 0), (2, 0), (3, 0)]
    assert_no_leaks()


def test_a_deterministic_user_exception_fails_fast_with_its_traceback(ray_local, tmp_path):
    cfg = config(tmp_path, "corrupt")
    cfg["task"]["args"]["fail_on_sample"] = 100  # wherever sample 100 lands, it raises
    with pytest.raises(WorkerError) as info:
        raytrainer.train(cfg, progress=False)
    assert "sample 100 is corrupt" in str(info.value) and "in train_step" in info.value.traceback
    log = [json.loads(line) for line in (tmp_path / "corrupt" / "events.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in log if e["event"] in ("worker_failed", "recovered", "failed")]
    assert kinds == ["worker_failed", "recovered", "worker_failed", "failed"]  # retried once only
    assert "again at the same step" in log[-1]["reason"]
    assert log[-1]["rank"] == info.value.rank
    assert_no_leaks()


def test_with_no_survivor_the_run_restarts_from_its_checkpoint(ray_local, tmp_path):
    base = weights(raytrainer.train(config(tmp_path, "alone", workers=1), progress=False))
    cfg = config(tmp_path, "lost", [{"action": "kill", "step": 7}], workers=1)
    cfg["checkpoint"] = {"every_n_steps": 5}
    result = raytrainer.train(cfg, progress=False)
    assert_same(weights(result), base)
    recovered = events(result, "recovered")
    assert len(recovered) == 1 and recovered[0]["from_checkpoint"] == "step-00000005"
    assert recovered[0]["step"] == 5  # steps 6 and 7 redone: lost to a checkpoint restart
    assert_no_leaks()


# ---------------------------------------------------------------------- the policy alone

def test_policy_counts_lost_workers_and_faults_apart_and_never_retries_our_own_errors():
    died = [Failure(1, "died", "gone", 3), Failure(0, "interrupted", "peer gone", 3)]
    unlimited = FailurePolicy(max_failures=0)
    assert all(unlimited.decide(died, step).recover for step in range(1, 50))  # a spot node lost 49 times
    assert (unlimited.losses, unlimited.faults, unlimited.failures) == (49, 0, 49)
    policy = FailurePolicy(max_failures=0, max_losses=2)
    assert policy.decide(died, 3).recover and policy.decide(died, 4).recover
    decision = policy.decide(died, 5)
    assert not decision.recover and isinstance(decision.error, FailuresExceeded)
    assert "failure.max_losses=2 exceeded" in decision.reason and "rank 1 died" in decision.reason
    hung = [Failure(1, "hung", "no progress", 3)]
    policy = FailurePolicy(max_failures=2)
    assert policy.decide(hung, 3).recover and policy.decide(hung, 4).recover
    decision = policy.decide(hung, 5)
    assert not decision.recover and "failure.max_failures=2 exceeded: failure 3 of this run" in decision.reason
    for ours in (ConfigError("bad key"), TaskError("no loss")):
        decision = FailurePolicy(5).decide([Failure(0, "error", f"x: {ours}", 1, error=ours)])
        assert not decision.recover and decision.error is ours


def test_policy_counts_faults_in_a_window_and_a_loss_that_recurs_at_one_step_as_a_fault():
    now = [0.0]
    policy = FailurePolicy(max_failures=1, window_s=3600, clock=lambda: now[0])
    hung = [Failure(1, "hung", "no progress", 3)]
    assert policy.decide(hung, 3).recover
    now[0] = 3601.0  # an hour later: the first is forgotten
    assert policy.decide(hung, 900).recover
    now[0] = 3700.0
    decision = policy.decide(hung, 950)
    assert not decision.recover and "failure 2 within failure.failure_window_s=3600" in decision.reason
    crash = [Failure(0, "died", "the worker process died (SIGSEGV)", None)]
    policy = FailurePolicy(max_failures=0)
    assert policy.decide(crash, 7).recover and policy.decide(crash, 7).recover  # two losses at step 7
    decision = policy.decide(crash, 7)  # a third with no step between: the run's own crash
    assert not decision.recover and "failure.max_failures=0 exceeded" in decision.reason
    assert (policy.losses, policy.faults) == (2, 1)


def test_policy_retries_a_worker_error_once_per_step_and_type():
    policy = FailurePolicy(max_failures=10)
    error = WorkerError(1, "ValueError: bad")
    at = lambda step, cause="ValueError: bad": [Failure(1, "error", cause, step, error=error)]  # noqa: E731
    assert policy.decide(at(4)).recover
    assert policy.decide(at(5)).recover  # another step: not the same failure
    assert policy.decide(at(4, "KeyError: k")).recover  # another type
    decision = policy.decide(at(4, "ValueError: other text"))
    assert not decision.recover and decision.error is error and "again at the same step" in decision.reason


def test_blame_the_silent_then_those_in_their_own_code_never_those_waiting_in_a_collective():
    waiting, working = Status(5, 40, "collective"), Status(5, 38, "user")
    assert blame({0: waiting, 1: None, 2: working}) == [1]  # frozen: it does not answer
    assert blame({0: waiting, 1: working, 2: Status(5, 40, "framework")}) == [1, 2]
    assert blame({0: waiting, 2: Status(5, 41, "collective")}) == [0]  # all wait: the one behind
    assert blame({0: waiting, 2: waiting}) == [0, 2]  # nothing tells them apart
    assert blame({0: waiting, 2: Status(5, 41, "collective")}, recovering=True) == []  # they wait for the failed
    assert blame({0: waiting, 1: None}, recovering=True) == [1]
    # A peer not stalled (slow, working on its own clock) is the one they wait for.
    assert blame({0: waiting, 2: Status(5, 41, "collective")}, others_progress=True) == []
    assert blame({0: waiting, 1: working}, others_progress=True) == [1]


def test_the_state_comes_from_the_survivor_furthest_ahead():
    assert choose_source({0: Status(4, 9, "framework"), 1: Status(5, 9, "framework", after_pending=True),
                          2: Status(5, 9, "framework")}) == 2  # step 5 with its work done
    assert choose_source({1: Status(5, 9, "framework"), 0: Status(5, 9, "framework")}) == 0


def test_a_state_kept_from_an_earlier_attempt_serves_unless_a_survivor_is_further():
    at5, at6 = Status(5, 9, "framework"), Status(6, 9, "framework")
    assert choose_state({0: at5, 2: at6}, None) == StateChoice(2, take=True)  # take the furthest survivor's
    assert choose_state({0: at5, 2: at6}, at6) == StateChoice(2, take=False)  # the kept copy is that state
    assert choose_state({0: at5}, at6) == StateChoice(None, take=False)  # its giver is gone: the kept copy
    assert choose_state({0: at6}, at5) == StateChoice(0, take=True)
    assert choose_state({}, at5) == choose_state({}, None) == StateChoice(None, take=False)


def test_a_re_form_secures_the_state_in_the_object_store_only_for_a_worker_that_takes_it():
    at, ahead = Status(7, 0, "train"), Status(8, 0, "train")
    quiet = dict(leaving=False, waited=False, joiners=False, holders=True)
    assert not secure_at_once(**quiet)
    for why in ("leaving", "waited", "joiners"):  # before a holder may be lost meanwhile
        assert secure_at_once(**{**quiet, why: True})
    assert secure_at_once(**{**quiet, "holders": False})  # from a copy: it is the only one

    def where(holders, keep, secured_before=False, copies_wanted=True):
        return secure_where(holders, keep, secured_before=secured_before, copies_wanted=copies_wanted)

    assert where({0: at, 1: at}, [0, 1]) == "holders"
    assert where({0: at, 1: at, 2: at}, [0, 2]) == "holders"  # rank 1 does not stay
    assert where({0: at, 1: ahead}, [0, 1]) == "object_store"  # rank 0 is behind
    assert where({0: at, 1: at}, [0, 1, 2]) == "object_store"  # rank 2 holds none yet
    assert where({0: at, 1: at}, [0, 1], secured_before=True) == "object_store"
    assert where({1: at}, [1]) == "copy" and where({0: at, 1: at}, [1]) == "copy"
    assert where({1: at}, [1], copies_wanted=False) is None  # one worker by choice


def test_workers_taking_the_state_on_the_givers_node_read_its_copy_there():
    def by_copy(takers, leaving=False, joiners=False, secured_before=False):
        return hand_over_by_copy("a", takers, leaving=leaving, joiners=joiners, secured_before=secured_before)

    assert by_copy(["a"]) and by_copy(["a", "a"])  # spares beside the survivor that gives it
    assert not by_copy(["a", "b"])  # one on another node: through the object store, for all
    assert not by_copy(["a", None])  # a replacement not up yet: its node is not known
    assert not by_copy([])  # nobody takes it
    assert not by_copy(["a"], leaving=True)  # a draining node's workers go: the state must outlive them
    assert not by_copy(["a"], joiners=True)
    assert not by_copy(["a"], secured_before=True)  # every worker takes what an earlier attempt secured


def test_a_lost_rank_goes_to_a_ready_spare_else_training_goes_on_without_it():
    def plan(lost, spares=(), world=3, building=(), **kw):
        kw = {"replicated": True, "exact": False, "global_batch_fixed": True, "elastic": False, **kw}
        return replacing(lost, spares_ready=spares, spares_up=(*spares, *building), world=world, **kw)

    assert plan([1], spares=[1]) == Replacing(spares=(1,), reason="warm spares take every lost rank")
    mixed = plan([2, 0], spares=[2])  # two lost close together, one spare up
    assert (mixed.spares, mixed.wait, mixed.regrow) == ((2,), (), (0,))
    assert plan([0, 1]).regrow == (0, 1)  # one survivor is enough: below min_workers for a while
    # Sharded state too: the survivors re-shard the peer snapshots onto the ranks left.
    assert plan([0, 2], world=4, replicated=False).regrow == (0, 2)
    assert plan([0, 2], spares=[2], world=4, replicated=False) == Replacing(
        spares=(2,), regrow=(0,), reason="no warm spare ready for rank(s) [0]: going on without them while their "
                                         "replacements start")
    assert plan([1], spares=[1], replicated=False).regrow == ()  # a spare: no re-shard at all
    assert plan([1], replicated=False, exact=True).wait == (1,)
    # Waited for, at the same world size: exactness asked for, a per-worker batch that a
    # fixed-size run would shrink, no survivor at all.
    assert plan([1, 2], spares=[1], exact=True) == Replacing(spares=(1,), wait=(2,),
                                                              reason="failure.recovery is exact")
    assert plan([1], global_batch_fixed=False).wait == (1,)
    assert plan([1], global_batch_fixed=False, elastic=True).regrow == (1,)  # elastic: it resizes anyway
    assert plan([0, 1, 2]).wait == (0, 1, 2)
    # A spare up but still building the training state: not waited for where the survivors
    # can go on; taken where the rank would be waited for (its build's rest beats a start).
    assert plan([1], building=[1]) == plan([1])
    assert (plan([1, 2], spares=[2], building=[1]).spares, plan([1, 2], spares=[2], building=[1]).regrow) == \
        ((2,), (1,))
    assert plan([1, 2], building=[1], exact=True) == Replacing(spares=(1,), wait=(2,),
                                                                reason="failure.recovery is exact")
    assert plan([1], building=[1], global_batch_fixed=False) == Replacing(
        spares=(1,), reason="warm spares take every lost rank")
    assert plan([0, 1, 2], building=[0, 1, 2]).spares == (0, 1, 2)


def test_a_spare_starts_cold_only_where_the_run_lasts_for_it_to_be_up_as_long_again(monkeypatch):
    from raytrainer.driver.group import spares

    pace = spares.Pace()
    assert pace.ends_in_s(100) is None  # nothing reported yet
    pace.add([{"event": "a worker's event"}, {"step": 4, "time": 10.0, "loss": 1.0}])
    assert pace.ends_in_s(100) is None  # one step: no pace yet
    assert pace.ends_in_s(None) == float("inf")  # no known length: a spare pays
    pace.add([{"step": 6, "time": 11.0, "loss": 1.0}])
    assert pace.ends_in_s(100) == 47.0 and pace.ends_in_s(5) == 0.0
    monkeypatch.setattr(spares, "COLD_START_S", [])
    assert spares.worth_a_cold_start(0.5)  # no cold start measured yet: as before
    monkeypatch.setattr(spares, "COLD_START_S", [5.0])
    assert spares.worth_a_cold_start(10.5) and not spares.worth_a_cold_start(9.5)


def test_replacements_are_awaited_up_to_replace_timeout_while_the_run_keeps_its_size():
    wait = lambda waited, placed, others: keep_waiting_for_placement(  # noqa: E731
        waited, placed, others, size=2, replace_timeout_s=10, placement_timeout_s=60)
    assert wait(5, 0, 2) and not wait(11, 0, 2)  # its size without them: give up after replace_timeout_s
    assert wait(30, 0, 1) and wait(30, 0, 0) and not wait(30, 1, 1)  # below its size: keep waiting
    assert not wait(61, 0, 0)  # ... up to placement_timeout_s


def test_the_next_warm_spares_start_once_the_recovered_group_has_trained_a_step(tmp_path, monkeypatch):
    # Not while the recovery runs, nor in the first step after it: its process start and
    # torch import would take the cores that the spare taking over (maybe still starting
    # itself) and the survivors need.
    from raytrainer.config import load_config
    from raytrainer.contract import Node
    from raytrainer.driver.group import RayWorkerGroup

    from types import SimpleNamespace

    group = RayWorkerGroup(load_config(config(tmp_path, "spare")), use_gpu=False)
    group.roster.actors, group.roster.slots = ["w0", "w1"], [("pg", 0), ("pg", 1)]
    group.roster.nodes = [Node("10.0.0.1", node_id="n0"), Node("10.0.0.2", node_id="n1")]
    calls = []
    status = Status(5, 10, "framework")
    group.kill = lambda rank: calls.append(("kill", rank))
    group.spares = SimpleNamespace(
        take=lambda node_id: calls.append(("take_spare", node_id)) or ("spare", "the spare's node() call",
                                                                         Node("10.0.0.2", node_id="n1", pid=7)),
        start=lambda roster, ends_in_s: calls.append(("start_spares", ends_in_s)))
    group.forming = SimpleNamespace(
        answers=lambda ranks, method: {r: status for r in ranks},
        take_state=lambda holders, avoid: (0, "state", status), secured=None,
        form=lambda calls_, use_gpu: calls.append(("form", sorted(calls_))),
        clear=lambda: None)
    # The spare's node() call, made as it started, says where it is: no second one to wait for.
    group.slots = SimpleNamespace(
        renew_lost=lambda slots: {},
        wait_placed=lambda roster, ranks, others, asked: calls.append(("wait_placed", asked)) or {
            r: roster.nodes[r] for r in ranks},
        ready_joiners=lambda take: [],
        start_joiners=lambda in_use, draining: calls.append(("start_joiners",)) or 0,
        starting=lambda: False)
    group._stepped = True  # the group before the loss had trained
    reformed = group.reform(ReformPlan(dead=[1]))
    assert calls == [("kill", 1), ("take_spare", "n1"), ("wait_placed", {1: "the spare's node() call"}),
                     ("form", [0, 1]), ("start_joiners",)]
    assert reformed.replaced == [1] and group.actors == ["w0", "spare"] and group.roster.nodes[1].pid == 7
    # Launched again: the spares start at the poll that brings the re-formed group's pace
    # (two steps' rows), with when the run will end at it (spares.py).
    import ray

    group.roster.actors = [SimpleNamespace(run=SimpleNamespace(remote=lambda: object())) for _ in range(2)]
    group.launch()
    group._total_steps = 40
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None: ([], list(refs)))
    drained = iter([([], [{"event": "a worker's event"}]), ([{"step": 6, "time": 100.0, "loss": 1.0}], []),
                    ([{"step": 7, "time": 100.5, "loss": 1.0}, {"step": 8, "time": 101.0, "loss": 1.0}], [])])
    group._drain = lambda timeout: next(drained)
    calls.clear()
    group.poll(0.0)
    group.poll(0.0)
    assert calls == []
    group.poll(0.0)
    assert calls == [("start_spares", 16.0)]  # 32 steps left at 0.5 s each
