"""Failures as a cluster produces them, injected from outside at any moment: two workers
killed close together (the second while the first recovery is under way), a worker
frozen with SIGSTOP, kills and freezes at random moments inside a step, a kill while a
checkpoint is being written, a kill right after a recovery. With failure.recovery: exact
each run recovers in memory at the same world size and ends bit-identical to an
undisturbed one; with fast (the default), a lost worker with no warm spare up is left
behind, the survivors go on at once and take its replacement in once it is up, and the
run ends within float tolerance of an undisturbed one, nothing lost."""

import os
import threading
import time

import pytest
import torch

from raytrainer.contract import ReformPlan

from .conftest import assert_no_leaks
from .faults import Run, freeze, kill
from .waits import join, patience, wait_until

STEPS = 30


def config(tmp_path, name, chaos=(), recovery="exact", **args):
    return {
        # No dropout: a fast recovery resizes, and a rank's random stream is its own (that a
        # replaced rank draws the numbers the lost one would have is test_fault_tolerance's).
        "task": {"target": "tests.tasks:RegressionTask", "args": {"sleep_s": 0.01, **args}},
        "trainer": {"max_steps": STEPS, "global_batch_size": 48, "log_every_n_steps": 1},
        # A replacement waited for must be up within placement_timeout_s: its process start
        # (importing torch) took over 60 s at a load of 44 on the 2-core VM.
        "scaling": {"num_workers": 3, "placement_timeout_s": round(patience(60))},
        # collective_timeout_s bounds a rendezvous left waiting for a peer lost meanwhile
        # (once, in CI, a re-form of the double kill waited the default 600 s: not yet
        # explained; this keeps such a wait from holding the module's CPUs for minutes).
        "failure": {"chaos": list(chaos), "step_timeout_s": 3, "max_failures": 6, "collective_timeout_s": 30,
                    "recovery": recovery},
        "run": {"name": name, "storage": str(tmp_path)},
    }


def weights(run_dir):
    return torch.load(run_dir / "model.pt", weights_only=True)


def assert_same(a, b):
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def of(events, name):
    return [e for e in events if e["event"] == name]


@pytest.fixture(scope="module")
def undisturbed(ray_local, tmp_path_factory):
    run = Run(config(tmp_path_factory.mktemp("base"), "base"))
    return weights(run.result().run_dir)


@pytest.mark.hangs
def test_fast_recovery_goes_on_at_once_and_takes_the_replacements_in_once_up(undisturbed, tmp_path):
    """failure.recovery: fast, one warm spare, faults from outside by pid: a kill (the spare
    takes the rank, or none is up yet), a kill right after that recovery (no spare up), two
    kills a third of a second apart, a freeze. Each time the survivors go on without waiting
    for a process to start; the group is back at 3 once the replacements are up."""
    slow = tmp_path / "slow"  # the run goes slowly while it exists
    slow.touch()
    cfg = config(tmp_path, "fast", recovery="fast", slow_while=str(slow), sleep_s=0.2)
    cfg["task"]["target"] = "tests.tasks:ElasticTask"  # RegressionTask's maths, paced by `slow`
    cfg["trainer"]["max_steps"] = STEPS = 300
    cfg["failure"]["max_failures"] = 10
    run = Run(cfg)

    def recoveries():
        return of(run.events(), "recovered")

    def back_at_3():
        wait_until(lambda: world_size(run.events()) == 3, "the group back at 3 workers")

    run.wait_for_step(3)
    kill(run.pids()[0])  # rank 0
    wait_until(lambda: len(recoveries()) == 1, "the first recovery")
    kill(run.pids()[-1])  # right after it: the spare, if it took rank 0, is not replaced yet
    wait_until(lambda: len(recoveries()) == 2, "the second recovery")
    back_at_3()
    pids = run.pids()
    kill(pids[1])
    time.sleep(0.3)
    kill(pids[2])
    wait_until(lambda: len(recoveries()) >= 3, "the double kill's recovery")
    back_at_3()
    # The pids the run reports are its workers' now. Where a spare took rank 1 in an attempt
    # that then failed (rank 2 lost as the group formed), the next attempt kept reporting the
    # killed worker's pid for rank 1, and the freeze below hit no process (seen once, in CI).
    assert all(os.path.exists(f"/proc/{pid}") for pid in run.pids()), run.pids()
    before = len(recoveries())
    freeze(run.pids()[1])
    wait_until(lambda: len(recoveries()) > before, "the freeze's recovery")
    back_at_3()
    slow.unlink()
    result = run.result()

    recovered = of(result.events, "recovered")
    # At most the step in flight: a rank can finish a step (and report it) while the others
    # still wait for its last bytes of the all-reduce, which its kill then resets (Gloo
    # fails the op on the reset, seen in CI at load 14): they redo that one step.
    assert all(r["steps_lost"] <= 1 for r in recovered), outline(result.events)
    # Four kills, each a death (one that a re-forming group's status call finds dead too, not
    # a silent worker: seen as `hung` once in CI), and one freeze.
    kinds = sorted(f["kind"] for f in of(result.events, "worker_failed") if f["kind"] in ("died", "hung"))
    assert kinds == ["died"] * 4 + ["hung"], outline(result.events)
    # The state is put in the object store for a worker that takes it (a spare, a replacement,
    # one behind; or a joiner), unless all of them are on the giver's node (one node here) and
    # up: then they read the copy the giver writes beside it. Else two survivors or more are
    # its copies, or one writes its copy beside it. A kill with no spare up leaves two (the
    # first, or the one right after it).
    for r in recovered:
        if r["spares"] or r["replaced"] or r["resynced"]:
            assert r["secured"] in ("copy", "object_store"), outline(result.events)
        elif len(r["pids"]) == 1:
            assert r["secured"] in ("copy", "object_store"), outline(result.events)
        else:
            assert r["secured"] in ("holders", "object_store"), outline(result.events)
    assert any(r["secured"] == "holders" for r in recovered), outline(result.events)
    # Every step's row once, though rank 0 was lost holding rows (a new rank 0 sends them).
    assert [r["step"] for r in result.history if "loss" in r] == list(range(1, STEPS + 1)), outline(result.events)
    assert [r["world_size"] for r in result.history if "loss" in r][-1] == 3, result.events
    dropped = [d for r in recovered for d in r["dropped"]]
    grown = [e for e in of(result.events, "resized") if e["cause"] == "lost workers replaced"]
    assert dropped and sum(e["added"] for e in grown) == len(dropped)  # every one left behind came back
    base = weights(Run(config(tmp_path, "base-300", sleep_s=0.0) | {
        "trainer": cfg["trainer"]}).result().run_dir)
    for key, value in weights(result.run_dir).items():
        torch.testing.assert_close(value, base[key], rtol=1e-4, atol=1e-5)
    assert_no_leaks()


def outline(events):
    """The run's failures, recoveries and resizes, one short line each (for a failure's message)."""
    keys = ("step", "rank", "kind", "steps_lost", "state_from", "secured", "source_rank", "attempts", "spares",
            "dropped", "old_world_size", "new_world_size", "why")
    return "\n".join(f"{e['event']} " + " ".join(f"{k}={e[k]}" for k in keys if k in e) for e in events
                     if e["event"] in ("worker_failed", "recovered", "resized", "group_formed"))


def world_size(events):
    """The world size the newest event says."""
    size = None
    for e in events:
        size = e.get("world_size", e.get("new_world_size", size)) if e["event"] in ("group_formed", "resized") else size
    return size


def test_two_workers_killed_a_third_of_a_second_apart(undisturbed, tmp_path):
    run = Run(config(tmp_path, "double", sleep_s=0.1, steps_to=str(tmp_path / "at-")))
    run.wait_for_worker_step(tmp_path / "at-", 5)  # see the frozen worker's test
    pids = run.pids()
    kill(pids[1])
    time.sleep(0.3)  # the first recovery is under way
    kill(pids[2])
    result = run.result()
    assert_same(weights(result.run_dir), undisturbed)
    failed, recovered = of(result.events, "worker_failed"), of(result.events, "recovered")
    assert {f["rank"] for f in failed} == {1, 2} and all(f["kind"] == "died" for f in failed)
    # Usually the second kill lands while the first recovery re-forms: two attempts. On a
    # quiet machine both deaths may already be settled together: one attempt, one failure.
    attempts = sum(r["attempts"] for r in recovered)
    assert attempts in (1, 2) and all(r["steps_lost"] <= 1 for r in recovered)
    assert recovered[-1]["failures"] == attempts
    assert result.metrics["step"] == STEPS
    assert_no_leaks()


@pytest.mark.hangs
def test_a_frozen_worker_is_the_only_one_replaced(undisturbed, tmp_path, capfd):
    # Frozen once a worker has trained step 5, as the workers write it: the driver's rows
    # trail them (by 3.6 s in a CI run), and waiting for those once let all 30 steps end
    # before the freeze (the run finished with no failure at all). Steps of 0.1 s (the
    # weights are the same) leave 2.5 s of training to land in.
    run = Run(config(tmp_path, "frozen", sleep_s=0.1, steps_to=str(tmp_path / "at-")), progress=True)
    run.wait_for_worker_step(tmp_path / "at-", 5)
    frozen = run.pids()[1]
    freeze(frozen)
    result = run.result()
    assert_same(weights(result.run_dir), undisturbed)
    failed, recovered = of(result.events, "worker_failed"), of(result.events, "recovered")
    assert [(f["kind"], f["rank"]) for f in failed] == [("hung", 1)]
    assert "did not answer at all" in failed[0]["cause"]
    assert len(recovered) == 1 and recovered[0]["replaced"] == [1] and recovered[0]["steps_lost"] <= 1
    assert recovered[0]["source_rank"] in (0, 2) and frozen not in recovered[0]["pids"]
    assert_no_leaks()
    # The console says it in raytrainer's words; Ray's notice of the process raytrainer
    # killed ("an unexpected system error ... the OOM killer") is not printed.
    out, err = capfd.readouterr()
    step = failed[0]["step"]
    line = f"raytrainer: rank 1 ({failed[0]['node']}) hung at step {step}: no progress for "
    assert line in err and "did not answer at all" in err.split(line)[1].splitlines()[0], err
    assert f"raytrainer: recovered at step {recovered[0]['step']} in " in err, err
    assert f"Worker PID: {frozen}" not in out + err, out


@pytest.mark.hangs
def test_kills_and_a_freeze_at_random_moments_inside_steps(undisturbed, tmp_path):
    chaos = [{"action": "kill", "step": 4, "rank": 0, "at": "random"},
             {"action": "kill", "step": 11, "rank": 2, "at": "random"},
             {"action": "freeze", "step": 18, "rank": 1, "at": "random"}]
    result = Run(config(tmp_path, "random", chaos)).result()
    assert_same(weights(result.run_dir), undisturbed)
    failed = of(result.events, "worker_failed")
    assert [(f["kind"], f["rank"]) for f in failed] == [("died", 0), ("died", 2), ("hung", 1)]
    assert all(r["steps_lost"] <= 1 for r in of(result.events, "recovered"))
    assert_no_leaks()


def test_a_kill_while_rank_0_writes_a_checkpoint(undisturbed, tmp_path):
    marker = tmp_path / "saving-"
    cfg = config(tmp_path, "ckpt", saving_marker=str(marker))
    cfg["checkpoint"] = {"every_n_steps": 10}
    run = Run(cfg)
    rank0 = wait_until(lambda: next((p for p in run.pids()[:1] if (tmp_path / f"saving-{p}").exists()), None),
                       "rank 0 to write a checkpoint", 120, every_s=0.02)
    kill(rank0)  # inside its checkpoint write (taking the model's state takes a second)
    result = run.result()
    assert_same(weights(result.run_dir), undisturbed)
    assert [f["rank"] for f in of(result.events, "worker_failed")] == [0]
    committed = of(result.events, "checkpoint_committed")
    on_disk = sorted(p.name for p in (result.run_dir / "checkpoints").iterdir())
    assert on_disk == sorted(c["path"].rsplit("/", 1)[-1] for c in committed)[-2:]  # nothing half-written
    assert committed[-1]["step"] == STEPS
    assert_no_leaks()


@pytest.mark.hangs
def test_the_survivor_giving_its_state_freezes_while_the_group_re_forms(undisturbed, tmp_path):
    # Killed once a worker has trained step 2, as the workers write it (the driver's rows
    # trailed them by 3.6 s in a CI run whose 30 steps were all done before step 5's row
    # came, the kill and freeze then landing after training); steps of 0.3 s leave the
    # recovery's state-taking (a second) well inside the run.
    run = Run(config(tmp_path, "source", saving_marker=str(tmp_path / "saving-"), sleep_s=0.3,
                     steps_to=str(tmp_path / "at-")))
    run.wait_for_worker_step(tmp_path / "at-", 2)
    pids = run.pids()
    kill(pids[1])
    source = wait_until(  # its state is being taken (a second)
        lambda: next((p for p in (pids[0], pids[2]) if (tmp_path / f"saving-{p}").exists()), None),
        "a survivor's state to be taken", 60, every_s=0.02)
    freeze(source)
    result = run.result()
    assert_same(weights(result.run_dir), undisturbed)
    failed, recovered = of(result.events, "worker_failed"), of(result.events, "recovered")
    assert [(f["kind"], f["rank"]) for f in failed] == [("died", 1), ("hung", pids.index(source))]
    assert len(recovered) == 1 and recovered[0]["attempts"] == 2 and recovered[0]["failures"] == 2
    assert source not in run.pids()
    # From the other survivor's memory, unless it had to be killed to unblock it (it was
    # left waiting in a collective on the source): then from the start, no checkpoint here.
    assert recovered[0].get("state_from") == "memory" or recovered[0]["from_checkpoint"] is None
    assert_no_leaks()


def test_a_worker_found_dead_as_the_group_re_forms_is_counted_died_not_hung(ray_local):
    """The status call a re-forming group makes on its survivors: one whose process is gone
    fails as `died` at once; only one that does not answer in time is `hung` (a worker
    SIGKILLed between a failure and that call was once counted hung)."""
    import signal

    import ray

    from raytrainer.config import load_config
    from raytrainer.contract import Node, ReformFailed
    from raytrainer.driver.group.actors import CONTROL, Roster
    from raytrainer.driver.group.forming import Forming

    @ray.remote(num_cpus=0, concurrency_groups={CONTROL: 1})
    class Worker:
        def status(self):
            return os.getpid()

    workers = [Worker.remote() for _ in range(3)]
    try:
        pids = ray.get([w.status.remote() for w in workers])
        os.kill(pids[1], signal.SIGKILL)
        killed = []
        config = load_config({"task": {"target": "tests.tasks:RegressionTask"}, "trainer": {"max_steps": 1}})
        roster = Roster(actors=workers, nodes=[Node(node_id="n", ip="127.0.0.1")] * 3)
        with pytest.raises(ReformFailed) as failed:
            Forming(config, roster, killed.append).answers([0, 1, 2], "status")
        assert [(f.rank, f.kind) for f in failed.value.failures] == [(1, "died")] and failed.value.dead == [1]
        assert killed == [1]
        assert Forming(config, roster, killed.append).answers([0, 2], "status") == {0: pids[0], 2: pids[2]}
    finally:
        for worker in workers:
            ray.kill(worker)


@pytest.mark.parametrize("call", ["regroup", "setup", "reshard"])
def test_a_holder_late_to_the_rendezvous_is_asked_to_abort_again_not_killed(ray_local, call):
    """A group forms and a peer dies: the workers still forming are asked to abort their
    rendezvous. A survivor holding the training state that was not in it yet (loading the
    state, or its call not started on a loaded machine) found nothing to abort, and waited
    there for the dead peer; after FORM_GRACE_S it was killed, and with it the state: a
    double kill right after a grow once restarted a 3-worker run from step 0 so (CI, load
    14). Now it is asked again until it leaves, and stays a survivor: one keeping its
    replicated state (`regroup`), and one going on from its own peer snapshot (sharded
    state: `setup` with a Snapshot in its memory, while the dead peer loads its copy; or a
    re-shard from its own and the copies secured in the object store)."""
    import threading

    import ray

    from raytrainer.config import load_config
    from raytrainer.contract import Node, ReformFailed, Reshard, Snapshot, Status
    from raytrainer.driver.group.actors import CONTROL, Roster
    from raytrainer.driver.group.forming import Forming
    from raytrainer.errors import PeerFailure

    late_s = Forming.FORM_GRACE_S + 2.0

    @ray.remote(num_cpus=0, concurrency_groups={CONTROL: 1})
    class Worker:
        def __init__(self):
            self.where, self.aborted = None, threading.Event()

        def rendezvous(self):
            return "127.0.0.1", 0

        def setup(self, rank, world_size, addr, port, use_gpu, resume=None):
            return self.regroup(rank, world_size, addr, port)

        def regroup(self, rank, world_size, addr, port, state=None):
            if rank == 1:
                os._exit(1)  # the peer lost as the group forms
            self.where = "before"
            time.sleep(late_s)  # loading the state: an abort now finds no rendezvous to end
            self.where = "joining"
            if not self.aborted.wait(60):
                return "waited for the dead peer"
            raise PeerFailure("the rendezvous was aborted")

        def abort(self):
            if self.where == "joining":
                self.aborted.set()

        def status(self):
            return Status(5, 5, "setup" if self.where is None else "step", forming=self.where, busy_s=None)

    workers = [Worker.remote() for _ in range(2)]
    killed = []
    try:
        config = load_config({"task": {"target": "tests.tasks:RegressionTask"}, "trainer": {"max_steps": 1}})
        roster = Roster(actors=workers, nodes=[Node(node_id="n", ip="127.0.0.1")] * 2)
        forming = Forming(config, roster, killed.append)
        with pytest.raises(ReformFailed) as failed:
            if call == "regroup":
                forming.form({0: (False, None), 1: (False, None)}, use_gpu=False)
            elif call == "setup":
                forming.form({0: (None, Snapshot(5, 0)), 1: (None, Snapshot(5, 1, b"its copy"))}, use_gpu=False)
            else:
                secured = ray.put(Snapshot(5, 1, b"its copy"))
                forming.form({0: (None, Reshard(5, (Snapshot(5, 0), secured))),
                              1: (None, Reshard(5, (ray.put(Snapshot(5, 0, b"a copy")), secured)))}, use_gpu=False)
        assert sorted((f.rank, f.kind) for f in failed.value.failures) == [(0, "interrupted"), (1, "died")]
        assert failed.value.dead == [1] and killed == [1]  # the holder stays, with its state
    finally:
        for worker in workers:
            ray.kill(worker)


def test_a_peer_killing_a_silent_worker_says_whether_its_process_was_frozen_or_gone(ray_local):
    """A recovery kills a worker silent once its peers stopped (recovery.settle) through a
    peer on its node that stopped too, which sees whether its process was still there: a
    frozen worker is hung, not "died: its process, or its node, is gone" (a freeze landing
    as a kill's recovery began was once counted died). With no such peer it cannot say."""
    import signal

    import ray

    from raytrainer.config import load_config
    from raytrainer.contract import Node
    from raytrainer.driver.group import RayWorkerGroup
    from raytrainer.driver.group.actors import CONTROL
    from raytrainer.worker.process import control

    @ray.remote(num_cpus=0, concurrency_groups={CONTROL: 1})
    class Worker:
        def status(self):
            return os.getpid()

        def kill_process(self, pid):
            return control.kill(pid)

    workers = [Worker.remote() for _ in range(4)]
    try:
        pids = ray.get([w.status.remote() for w in workers])
        node = ray.get_runtime_context().get_node_id()
        config = load_config({"task": {"target": "tests.tasks:RegressionTask"}, "trainer": {"max_steps": 1}})
        group = RayWorkerGroup(config, use_gpu=False)
        group.roster.actors = workers
        group.roster.nodes = [Node(ip="127.0.0.1", node_id=node, pid=pid) for pid in pids]
        os.kill(pids[1], signal.SIGSTOP)
        os.kill(pids[2], signal.SIGKILL)
        wait_until(lambda: not control.running(pids[2]), "the SIGKILLed process gone")  # as when a peer is silent
        assert group.kill(1, answering=[0]) is True  # frozen
        assert group.kill(2, answering=[0]) is False  # gone
        assert group.kill(3, answering=[]) is False  # alive, but no peer known to answer to say so
        wait_until(lambda: not any(control.running(pid) for pid in pids[1:]), "the killed processes gone")
    finally:
        for worker in workers:
            ray.kill(worker)


def form_within(group, timeout_s, stuck):
    """group.setup() in a thread, which must end within timeout_s (else the test fails with
    `stuck`) by a ReformFailed: returned."""
    from raytrainer.contract import ReformFailed

    ended = []

    def form():
        try:
            group.setup()
            ended.append(None)
        except ReformFailed as exc:
            ended.append(exc)

    thread = threading.Thread(target=form, daemon=True)
    thread.start()
    join(thread, timeout_s)
    assert not thread.is_alive(), stuck
    assert isinstance(ended[0], ReformFailed)
    return ended[0]


def test_a_rank_0_frozen_as_the_group_forms_is_found_hung_not_waited_for(ray_local, tmp_path):
    """The group's rendezvous address is asked of rank 0 first: a rank 0 frozen then (or
    whose process never answers) is a hang like any other, found after step_timeout_s and
    reported to the controller, not a call the driver waits on for ever."""
    from raytrainer.config import load_config
    from raytrainer.driver.group import RayWorkerGroup

    group = RayWorkerGroup(load_config(config(tmp_path, "rendezvous")), use_gpu=False, cluster_can_grow=False)
    frozen = None
    try:
        frozen = group.start()[0].pid
        freeze(frozen)
        ended = form_within(group, 120, "the driver is still waiting for a frozen rank 0")
        assert [(f.rank, f.kind) for f in ended.failures] == [(0, "hung")] and ended.dead == [0]
    finally:
        if frozen is not None:
            kill(frozen)
        group.shutdown()
    assert_no_leaks()


def test_a_worker_that_never_reaches_the_rendezvous_is_found_hung_not_waited_for(ray_local, tmp_path):
    """A worker stuck in its own code while the group forms (here: building the task, like
    a stuck read) still answers its control channel; its peers wait for it in the
    rendezvous. It is the one hung, found after step_timeout_s, not a wait of
    failure.collective_timeout_s (600 s here)."""
    from raytrainer.config import load_config
    from raytrainer.driver.group import RayWorkerGroup

    stall = tmp_path / "stall-pid"
    cfg = config(tmp_path, "never-arrives", stall_pid_file=str(stall))
    cfg["failure"]["collective_timeout_s"] = 600
    group = RayWorkerGroup(load_config(cfg), use_gpu=False, cluster_can_grow=False)
    try:
        stall.write_text(str(group.start()[1].pid))
        ended = form_within(group, 120, "the driver is still waiting on peers waiting for rank 1")
        # Its peers, asked to abort the rendezvous, stay (interrupted), holding their state.
        assert sorted((f.rank, f.kind) for f in ended.failures) == [(0, "interrupted"), (1, "hung"),
                                                                    (2, "interrupted")]
        assert "rendezvous" in next(f.cause for f in ended.failures if f.rank == 1) and ended.dead == [1]
    finally:
        stall.unlink(missing_ok=True)
        group.shutdown()
    assert_no_leaks()


def test_survivors_of_a_failed_re_form_form_the_next_group_with_a_fresh_worker(ray_local, tmp_path):
    """The double kill's hang, made deterministic: a re-form fails part-way (a new worker
    never arrives, so the others' group init times out and they stay, as survivors), and
    the next re-form joins them with a fresh worker. torch names a process's default group
    after a counter that a failed init leaves moved: without resetting it the survivors
    and the fresh worker wait for each other's keys until collective_timeout_s, at every
    attempt."""
    from raytrainer.config import load_config
    from raytrainer.contract import ReformFailed
    from raytrainer.driver.group import RayWorkerGroup

    stall = tmp_path / "stall-pids"
    cfg = config(tmp_path, "failed-re-form", stall_pid_file=str(stall))
    cfg["failure"].update(step_timeout_s=120, collective_timeout_s=8)  # the wait for the init to time out
    group = RayWorkerGroup(load_config(cfg), use_gpu=False, cluster_can_grow=False)
    try:
        nodes = group.start()
        group.setup()
        kill(nodes[1].pid)
        stall.write_text("!" + " ".join(str(n.pid) for n in nodes))  # rank 1's replacement stalls
        with pytest.raises(ReformFailed) as failed:
            group.reform(ReformPlan(dead=[1]))
        assert sorted((f.rank, f.kind) for f in failed.value.failures) == [(0, "interrupted"), (2, "interrupted")]
        assert failed.value.dead == [1]
        stall.unlink()
        reformed = group.reform(ReformPlan(dead=[1]))
        assert reformed.replaced == [1] and [n.pid for n in reformed.nodes][::2] == [nodes[0].pid, nodes[2].pid]
    finally:
        stall.unlink(missing_ok=True)
        group.shutdown()
    assert_no_leaks()


def test_a_worker_lost_while_its_peers_wait_in_the_rendezvous_leaves_them_in_place(ray_local, tmp_path):
    """A worker dies while its peers wait for it in the new group's rendezvous (here: rank
    1's replacement, killed by pid while it builds its task): the peers are asked to abort
    the rendezvous and stay, holding their state, to form the next group; before, they
    waited FORM_GRACE_S and were killed, and every rank started cold."""
    import ray
    from ray._private import state

    from raytrainer.config import load_config
    from raytrainer.contract import ReformFailed
    from raytrainer.driver.group import RayWorkerGroup

    stall = tmp_path / "stall-pids"
    cfg = config(tmp_path, "lost-in-rendezvous", stall_pid_file=str(stall))
    cfg["failure"].update(step_timeout_s=120, collective_timeout_s=600)  # neither to end the wait
    group = RayWorkerGroup(load_config(cfg), use_gpu=False, cluster_can_grow=False)
    ended = []

    def reform():
        try:
            ended.append(group.reform(ReformPlan(dead=[1])))
        except ReformFailed as exc:
            ended.append(exc)

    try:
        nodes = group.start()
        group.setup()
        kill(nodes[1].pid)
        stall.write_text("!" + " ".join(str(n.pid) for n in nodes))  # rank 1's replacement stalls
        thread = threading.Thread(target=reform, daemon=True)
        thread.start()
        wait_until(lambda: [s and s.forming for s in group.status()][::2] == ["joining", "joining"],
                   "the survivors in the rendezvous")
        replacement = state.actors()[group.roster.actors[1]._actor_id.hex()]["Pid"]
        kill(replacement)
        join(thread, 60)
        assert not thread.is_alive(), "the survivors still wait in the rendezvous"
        (failed,) = ended
        assert isinstance(failed, ReformFailed) and failed.dead == [1]
        assert sorted((f.rank, f.kind) for f in failed.failures) == [(0, "interrupted"), (1, "died"),
                                                                     (2, "interrupted")]
        stall.unlink()
        reformed = group.reform(ReformPlan(dead=[1]))
        assert [n.pid for n in reformed.nodes][::2] == [nodes[0].pid, nodes[2].pid] and reformed.source is not None
        assert ray.get(group.roster.actors[0].status.remote()).step == 0
    finally:
        stall.unlink(missing_ok=True)
        group.shutdown()
    assert_no_leaks()
