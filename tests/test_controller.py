"""The controller against a fake worker group: no cluster, no torch."""

import json

import time

import pytest

from raytrainer.config import FailureConfig
from raytrainer.contract import Failure, Formed, Node, Poll, ReformFailed, ReformPlan, Reformed, RunEnd
from raytrainer.driver.controller import (Controller, ControllerSettings, FailedState, FinishedState, Records,
                                         RecoveringState, ResizingState)
from raytrainer.errors import ConfigError, WorkerError
from raytrainer.driver.metrics import EventLog, JsonlWriter, MetricsHub
from raytrainer.driver.policy import FailuresExceeded, poll_wait

NODES = [Node("10.0.0.1", pid=100), Node("10.0.0.2", pid=200)]


class FakeGroup:
    def __init__(self, polls, fail_on_setup=None, storage=None):
        self.polls = list(polls)
        self.fail_on_setup = fail_on_setup
        self.storage = storage  # what check_storage returns, or the error it raises
        self.calls = []
        self.waits = []  # each poll's timeout

    def start(self):
        self.calls.append(("start", 2))
        return NODES

    def check_storage(self, nodes):
        self.calls.append(("check_storage", len(nodes)))
        if isinstance(self.storage, Exception):
            raise self.storage
        return self.storage

    def setup(self, resume=None):
        self.calls.append(("setup",))
        if self.fail_on_setup:
            raise self.fail_on_setup
        return Formed(NODES, total_steps=3)

    def launch(self):
        self.calls.append(("launch",))

    def poll(self, timeout):
        self.waits.append(timeout)
        item = self.polls.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def draining(self):
        return {}

    def joiners_starting(self):
        return 0

    def replacements(self, ranks):
        return []

    def shutdown(self, keep=False):
        self.calls.append(("shutdown",))
        self.kept = keep


WEIGHTS = RunEnd("finished", 3, stop_reason="completed", model_uri="weights")


def rows(*steps):
    return [{"step": s, "epoch": 0, "world_size": 2, "time": 0.0, "loss": 1.0 / s} for s in steps]


def make(tmp_path, group):
    hub = MetricsHub([JsonlWriter(tmp_path / "metrics.jsonl")])
    events = EventLog(tmp_path / "events.jsonl")
    return Controller(group, ControllerSettings(min_workers=2, poll_interval_s=0), Records(hub=hub, events=events)), hub, events


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rows_reach_the_sinks_and_the_run_finishes(tmp_path):
    group = FakeGroup([Poll(rows(1, 2)), Poll([]), Poll(rows(3), done=True, result=WEIGHTS)])
    controller, hub, events = make(tmp_path, group)
    assert controller.run() == WEIGHTS
    hub.close(), events.close()
    assert controller.state == FinishedState(WEIGHTS)
    assert [r["step"] for r in read(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    log = read(tmp_path / "events.jsonl")
    assert [e["event"] for e in log] == ["run_started", "group_formed", "finished"]
    assert log[1]["world_size"] == 2 and log[1]["total_steps"] == 3 and log[-1]["step"] == 3
    assert group.calls == [("start", 2), ("check_storage", 2), ("setup",), ("launch",), ("shutdown",)]
    assert group.kept  # a finished run's worker processes may serve the next run (kept.py)


def test_while_training_runs_a_poll_waits_until_a_check_is_due_and_while_recovering_the_shortest():
    # The earliest check due in 0.6 s: wait that long; past due: the shortest; none due
    # within the longest wait: the longest.
    assert poll_wait(10.0, [10.6, 12.0], 0.2, 1.0) == pytest.approx(0.6)
    assert poll_wait(10.0, [9.0], 0.2, 1.0) == 0.2
    assert poll_wait(10.0, [15.0], 0.2, 1.0) == 1.0 and poll_wait(10.0, [], 0.2, 1.0) == 1.0


def test_the_controller_polls_long_while_training_and_short_while_it_settles_a_failure(tmp_path):
    reformed = Reformed(step=1, nodes=NODES, source=1, state_from="object_store", replaced=[1])
    group = FailingGroup([Poll(rows(1)), Poll(rows(2)), Poll(failures=[died(1)]), Poll(failures=[interrupted(0)]),
                          Poll(rows(2, 3), done=True, result=WEIGHTS)], [reformed])
    hub = MetricsHub([JsonlWriter(tmp_path / "metrics.jsonl")])
    events = EventLog(tmp_path / "events.jsonl")
    # Checks far apart: while training runs, every poll waits the longest (no timing: the
    # first drain check is due at once, the next one an hour on).
    settings = ControllerSettings(min_workers=2, poll_interval_s=0.25, max_poll_s=7.0, drain_check_s=3600,
                                  failure=FailureConfig(max_failures=1, step_timeout_s=None))
    assert Controller(group, settings, Records(hub=hub, events=events)).run() == WEIGHTS
    events.close()
    # 1st poll: the first drain check is due (0.25); then 7 s while training; the failure
    # is settled with short polls; training again: 7 s.
    assert group.waits == [0.25, 7.0, 7.0, 0.25, 7.0]


def test_a_worker_failure_fails_the_run_logs_it_and_shuts_down(tmp_path):
    error = WorkerError(1, "ValueError: boom", "Traceback ...", step=2)
    group = FakeGroup([Poll(rows(1)), error])
    controller, hub, events = make(tmp_path, group)
    with pytest.raises(WorkerError, match="rank 1, step 2"):
        controller.run()
    events.close()
    assert isinstance(controller.state, FailedState) and isinstance(controller.state.error, WorkerError)
    failed = read(tmp_path / "events.jsonl")[-1]
    assert failed["event"] == "failed" and failed["rank"] == 1 and failed["step"] == 1
    assert "boom" in failed["cause"]
    assert group.calls[-1] == ("shutdown",) and not group.kept


def test_a_setup_failure_still_shuts_down(tmp_path):
    group = FakeGroup([], fail_on_setup=KeyboardInterrupt())
    controller, _, events = make(tmp_path, group)
    with pytest.raises(KeyboardInterrupt):
        controller.run()
    events.close()
    assert group.calls[-1] == ("shutdown",) and not group.kept
    assert read(tmp_path / "events.jsonl")[-1]["cause"] == "interrupted"


def test_storage_not_shared_fails_before_setup(tmp_path):
    group = FakeGroup([], storage=ConfigError("run.storage='runs' is not shared"))
    controller, _, events = make(tmp_path, group)
    with pytest.raises(ConfigError, match="not shared"):
        controller.run()
    events.close()
    assert group.calls == [("start", 2), ("check_storage", 2), ("shutdown",)]
    failed = read(tmp_path / "events.jsonl")[-1]
    assert failed["event"] == "failed" and failed["error"] == "ConfigError"


def test_a_storage_check_that_ran_is_logged(tmp_path):
    group = FakeGroup([Poll(rows(1), done=True, result=WEIGHTS)], storage={"nodes": 2, "workers": 2})
    controller, _, events = make(tmp_path, group)
    controller.run()
    events.close()
    log = read(tmp_path / "events.jsonl")
    assert [e["event"] for e in log] == ["run_started", "storage_checked", "group_formed", "finished"]
    assert log[1]["nodes"] == 2


class GrowingGroup(FakeGroup):
    """Room for one more worker appears after the first poll."""

    def __init__(self, polls):
        super().__init__(polls)
        self.room = [0, 1]  # joinable() answers, in turn (then the last again)

    def joinable(self):
        self.calls.append(("joinable",))
        return self.room.pop(0) if len(self.room) > 1 else self.room[0]

    def pause(self):
        self.calls.append(("pause",))

    def reform(self, plan):
        assert plan == ReformPlan()  # a grow: no one lost or leaving, from the survivors' memory
        self.calls.append(("reform", plan.dead))
        return Reformed(step=2, nodes=NODES + [Node("10.0.0.3")], source=0, added=1)


def test_newcomers_started_together_join_together(tmp_path):
    """One newcomer up and another still starting: the workers are not paused until the
    other is up too (one re-form for both), or until replace_timeout_s has passed."""
    from raytrainer.driver.policy import grow_now

    assert not grow_now(0, 2, 99.0, 10.0)  # none up: nothing to join
    assert not grow_now(1, 1, 3.0, 10.0)  # one up, one starting: wait for it
    assert grow_now(2, 0, 0.0, 10.0)  # both up: at once
    assert grow_now(1, 1, 10.0, 10.0)  # the other never came up: those up join

    class Staggered(GrowingGroup):
        def __init__(self, polls):
            super().__init__(polls)
            self.room = [1, 1, 2]  # up: the first at once, the second two checks later
            self.starting = [1, 1, 0]

        def joiners_starting(self):
            return self.starting.pop(0) if len(self.starting) > 1 else self.starting[0]

    paused = RunEnd("paused", 3, time=0.0)
    group = Staggered([Poll(rows(1)), Poll(rows(2)), Poll(rows(3)), Poll(paused={0: paused}),
                       Poll(paused={1: paused}), Poll(rows(4), done=True, result=WEIGHTS)])
    settings = ControllerSettings(min_workers=2, max_workers=4, poll_interval_s=0, grow_check_s=0,
                                  replace_timeout_s=60)
    events = EventLog(tmp_path / "events.jsonl")
    controller = Controller(group, settings, Records(hub=MetricsHub([]), events=events))
    assert controller.run() == WEIGHTS
    events.close()
    calls = [c[0] for c in group.calls if c[0] in ("joinable", "pause", "reform")]
    assert calls == ["joinable", "joinable", "joinable", "pause", "reform"]


def test_room_to_grow_pauses_the_workers_and_reforms_the_group(tmp_path):
    paused = RunEnd("paused", 2, time=0.0)
    group = GrowingGroup([Poll(rows(1)), Poll(rows(2)), Poll(paused={0: paused}), Poll(paused={1: paused}),
                          Poll(rows(3), done=True, result=WEIGHTS)])
    hub = MetricsHub([JsonlWriter(tmp_path / "metrics.jsonl")])
    events = EventLog(tmp_path / "events.jsonl")
    settings = ControllerSettings(min_workers=2, max_workers=3, poll_interval_s=0, grow_check_s=0)
    controller = Controller(group, settings, Records(hub=hub, events=events))
    assert controller.run() == WEIGHTS
    events.close()
    # Asked once (no second pause while the first is under way), reformed once all paused.
    calls = [c for c in group.calls if c[0] in ("joinable", "pause", "reform", "launch")]
    assert calls == [("launch",), ("joinable",), ("joinable",), ("pause",), ("reform", ()), ("launch",)]
    log = read(tmp_path / "events.jsonl")
    resize = next(e for e in log if e["event"] == "resized")
    assert (resize["old_world_size"], resize["new_world_size"], resize["step"], resize["added"]) == (3 - 1, 3, 2, 1)
    assert resize["cause"] == "room to grow" and resize["seconds"] > 0
    assert controller.world == 3


def test_a_run_short_of_room_for_its_size_says_it_waits_and_grows_back(tmp_path, monkeypatch):
    """Started on 2 of its 3 workers (the cluster placed no more): once no room has come
    for UNPLACED_AFTER_S the run says so (event, console line, progress line), trains on,
    and the resize that restores its size says how long it waited."""
    import io

    from raytrainer.driver.metrics import ProgressBar
    from raytrainer.driver.resizing import Resizing

    monkeypatch.setattr(Resizing, "UNPLACED_AFTER_S", 0.0)
    paused = RunEnd("paused", 3, time=0.0)
    group = GrowingGroup([Poll(rows(1)), Poll(rows(2)), Poll(rows(3)), Poll(paused={0: paused}),
                          Poll(paused={1: paused}), Poll(rows(4), done=True, result=WEIGHTS)])
    group.room = [0, 0, 1]  # no room at the first two looks
    stream = io.StringIO()
    progress = ProgressBar(stream=stream, interval_s=0)
    hub = MetricsHub([progress])
    events = EventLog(tmp_path / "events.jsonl")
    events.listeners.append(hub.event)
    settings = ControllerSettings(min_workers=1, size=3, max_workers=3, poll_interval_s=0, grow_check_s=0)
    controller = Controller(group, settings, Records(hub=hub, events=events, progress=progress))
    assert controller.run() == WEIGHTS
    events.close()
    log = read(tmp_path / "events.jsonl")
    assert (log[0]["num_workers"], log[0]["min_workers"]) == (3, 1)
    waits = [e for e in log if e["event"] == "waiting_for_capacity"]
    assert len(waits) == 1 and (waits[0]["world_size"], waits[0]["size"], waits[0]["missing"]) == (2, 3, 1)
    resize = next(e for e in log if e["event"] == "resized")
    assert resize["new_world_size"] == 3 and resize["capacity_waited_s"] >= 0
    shown = stream.getvalue()
    assert "no room for 1 more worker(s)" in shown and "workers 2/3, waiting for room" in shown, shown


def test_a_fixed_size_run_never_looks_for_room(tmp_path):
    group = GrowingGroup([Poll(rows(1)), Poll(rows(2)), Poll(rows(3), done=True, result=WEIGHTS)])
    controller, _, events = make(tmp_path, group)
    controller.run()
    assert ("joinable",) not in group.calls


# ---------------------------------------------------------------------- recovery as a loop

class FailingGroup(FakeGroup):
    """A group whose re-forms go as scripted: each item a Reformed to return, or an
    exception (ReformFailed, NoSurvivors) to raise."""

    def __init__(self, polls, reforms, restore_setup_fails=()):
        super().__init__(polls)
        self.reforms = list(reforms)
        self.plans = []  # each ReformPlan asked for
        self.setup_fails = list(restore_setup_fails)

    def setup(self, resume=None):
        self.calls.append(("setup", resume))
        if self.setup_fails:
            raise self.setup_fails.pop(0)
        return Formed(NODES, total_steps=3)

    def status(self, timeout=1.0):
        return [None, None]

    def abort(self, ranks):
        self.calls.append(("abort", tuple(ranks)))

    def kill(self, rank, answering=()):
        self.calls.append(("kill", rank))
        return False  # gone, or no peer to say

    spares = ()  # the lost ranks a ready warm spare can take (spares_ready)

    def spares_ready(self, ranks):
        return {r: True for r in ranks if r in self.spares}

    def reform(self, plan):
        self.plans.append(plan)
        if plan.state_from == "peers":
            return self._from_peers(plan)
        if plan.regrow:
            self.calls.append(("regrow", plan.regrow))
        return self._scripted("reform", plan.dead)

    def _from_peers(self, plan):
        raise AssertionError("replicated state re-forms from a survivor")

    def _scripted(self, call, dead):
        self.calls.append((call, tuple(dead)))
        item = self.reforms.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item


def died(rank, step=1):
    return Failure(rank, "died", "the worker process died", step, "10.0.0.1")


def interrupted(rank, step=1):
    return Failure(rank, "interrupted", "Connection closed by peer", step, "10.0.0.1")


def recovering(tmp_path, group, max_failures, restore=None, **settings):
    hub = MetricsHub([JsonlWriter(tmp_path / "metrics.jsonl")])
    events = EventLog(tmp_path / "events.jsonl")
    failure = FailureConfig(max_failures=max_failures, step_timeout_s=None, max_losses=settings.pop("max_losses", None),
                            recovery=settings.pop("recovery", "fast"),
                            snapshot_every_n_steps=settings.pop("snapshot_every_n_steps", 10))
    settings = ControllerSettings(min_workers=2, poll_interval_s=0, failure=failure, **settings)
    controller = Controller(group, settings, Records(hub=hub, events=events), restore=restore)
    return controller, events


class RegrowingGroup(FailingGroup):
    """A group whose lost workers' replacements come up after the re-form, ready to join."""

    def __init__(self, polls, reforms, spares=()):
        super().__init__(polls, reforms)
        self.spares = spares

    def joinable(self):
        self.calls.append(("joinable",))
        return 1

    def pause(self):
        self.calls.append(("pause",))


def test_a_lost_worker_with_no_spare_up_is_left_behind_and_its_replacement_joins_once_up(tmp_path):
    paused = RunEnd("paused", 3, time=0.0)
    shrunk = Reformed(step=1, nodes=NODES[:1], source=0, dropped=[1])
    grown = Reformed(step=3, nodes=NODES, source=0, added=1)
    group = RegrowingGroup([Poll(rows(1)), Poll(failures=[died(1)]), Poll(failures=[interrupted(0)]),
                            Poll(rows(2, 3)), Poll(paused={0: paused}), Poll(rows(4), done=True, result=WEIGHTS)],
                           [shrunk, grown])
    controller, events = recovering(tmp_path, group, max_failures=1, grow_check_s=0)
    assert controller.run() == WEIGHTS
    events.close()
    # Not waited for: the survivor goes on alone, the group told to start rank 1's replacement;
    # once it is up the workers pause and the group grows back.
    calls = [c for c in group.calls if c[0] in ("regrow", "reform", "joinable", "pause", "launch")]
    assert calls == [("launch",), ("regrow", (1,)), ("reform", (1,)), ("launch",), ("joinable",), ("pause",),
                     ("reform", ()), ("launch",)]
    # The plans the controller built: without rank 1 left behind to regrow, then the grow.
    assert group.plans == [ReformPlan(dead=(1,), regrow=(1,)), ReformPlan()]
    log = read(tmp_path / "events.jsonl")
    recovered = next(e for e in log if e["event"] == "recovered")
    assert recovered["dropped"] == [1] and recovered["spares"] == [] and recovered["steps_lost"] == 0
    assert [(e["old_world_size"], e["new_world_size"], e["cause"]) for e in log if e["event"] == "resized"] == [
        (2, 1, "failure: rank 1 died"), (1, 2, "lost workers replaced")]


def test_a_worker_lost_at_the_first_poll_is_recovered_and_counted_once(tmp_path):
    """No poll before it: the failure is all the controller knows (no hang check has run)."""
    same = Reformed(step=0, nodes=NODES, source=0, replaced=[1])
    group = RegrowingGroup([Poll(failures=[died(1, step=None)]), Poll(failures=[interrupted(0, step=None)]),
                            Poll(rows(1, 2, 3), done=True, result=WEIGHTS)], [same], spares=(1,))
    controller, events = recovering(tmp_path, group, max_failures=1)
    assert controller.run() == WEIGHTS
    events.close()
    (recovered,) = [e for e in read(tmp_path / "events.jsonl") if e["event"] == "recovered"]
    assert (recovered["failures"], recovered["steps_lost"], recovered["spares"]) == (1, 0, [1])


def test_each_state_carries_its_data(tmp_path):
    """A recovery sees its failures in the state, a resize when the workers paused; the end
    holds the result (and a failure its error: test_a_worker_failure_fails_the_run_...)."""
    same = Reformed(step=0, nodes=NODES, source=0, replaced=[1])
    group = RegrowingGroup([Poll(failures=[died(1, step=None)]), Poll(failures=[interrupted(0, step=None)]),
                            Poll(rows(1, 2, 3), done=True, result=WEIGHTS)], [same], spares=(1,))
    controller, events = recovering(tmp_path, group, max_failures=1)
    seen = []
    recover = controller.recovery.recover
    controller.recovery.recover = lambda *args: (seen.append(controller.state), recover(*args))[1]
    assert controller.run() == WEIGHTS
    events.close()
    (state,) = seen
    assert isinstance(state, RecoveringState) and [f.rank for f in state.failures] == [1] and state.lost is None
    assert controller.state == FinishedState(WEIGHTS)

    paused = RunEnd("paused", 2, time=123.0)
    group = GrowingGroup([Poll(rows(1)), Poll(paused={0: paused}), Poll(paused={1: paused}),
                          Poll(rows(3), done=True, result=WEIGHTS)])
    settings = ControllerSettings(min_workers=2, max_workers=3, poll_interval_s=0, grow_check_s=0)
    controller = Controller(group, settings, Records(hub=MetricsHub([]), events=EventLog(tmp_path / "e2.jsonl")))
    reform = controller.former.reform
    controller.former.reform = lambda plan: (seen.append(controller.state), reform(plan))[1]
    assert controller.run() == WEIGHTS
    assert isinstance(seen[-1], ResizingState) and seen[-1].paused_at == 123.0 and seen[-1].leaving == {}


def test_a_recovery_in_two_attempts_counts_every_rank_it_left_behind(tmp_path):
    """Two of three workers killed close together: the first attempt leaves rank 1 behind
    and renumbers rank 2 as 1, which dies before the group forms; the second attempt leaves
    that one behind too. The recovery says both, as numbered when it began (the bench and
    the regrow count on it), and so does its resize."""
    three = NODES + [Node("10.0.0.3", pid=300)]

    class ThreeGroup(RegrowingGroup):
        def start(self):
            return three

        def setup(self, resume=None):
            return Formed(three, total_steps=3)

        def joinable(self):
            return 0

    renumbered = ReformFailed([died(1)], [1], world_size=2, renumbered=([0, 2], [1]))
    alone = Reformed(step=1, nodes=three[:1], source=0, dropped=[1])
    group = ThreeGroup([Poll(rows(1)), Poll(failures=[died(1)]), Poll(failures=[interrupted(0), interrupted(2)]),
                        Poll(rows(2, 3), done=True, result=WEIGHTS)], [renumbered, alone])
    controller, events = recovering(tmp_path, group, max_failures=2)
    assert controller.run() == WEIGHTS
    events.close()
    log = read(tmp_path / "events.jsonl")
    (recovered,) = [e for e in log if e["event"] == "recovered"]
    assert recovered["attempts"] == 2 and recovered["dropped"] == [1, 2]
    assert [(e["old_world_size"], e["new_world_size"], e["dropped"]) for e in log if e["event"] == "resized"] == [
        (3, 1, [1, 2])]


def test_a_ready_spare_or_exactness_keeps_the_world_size(tmp_path):
    for name, spares, recovery in (("spare", (1,), "fast"), ("exact", (), "exact")):
        same = Reformed(step=1, nodes=NODES, source=0, replaced=[1])
        group = RegrowingGroup([Poll(rows(1)), Poll(failures=[died(1)]), Poll(failures=[interrupted(0)]),
                                Poll(rows(2, 3), done=True, result=WEIGHTS)], [same], spares=spares)
        (tmp_path / name).mkdir()
        controller, events = recovering(tmp_path / name, group, max_failures=1, recovery=recovery)
        assert controller.run() == WEIGHTS
        events.close()
        assert ("reform", (1,)) in group.calls and not [c for c in group.calls if c[0] in ("regrow", "joinable")]
        log = read(tmp_path / name / "events.jsonl")
        assert not [e for e in log if e["event"] == "resized"]
        assert next(e for e in log if e["event"] == "recovered")["spares"] == list(spares)


class SilentGroup(FailingGroup):
    """Rank 1 answers its control channel as `answers` says, ask by ask (the last for every
    later ask); the polls wait (empty) at the one scripted after the peer's failure until
    `until(self)` holds."""

    def __init__(self, polls, reforms, answers, until, frozen=False):
        super().__init__(polls, reforms)
        self.answers, self.until, self.asks = list(answers), until, 0
        self.frozen = frozen  # what a stopped peer on its node sees as it kills it: its process still there

    def kill(self, rank, answering=()):
        self.calls.append(("kill", rank, tuple(answering)))
        return self.frozen

    def status(self, timeout=1.0):
        from raytrainer.contract import Status

        self.asks += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return [None, Status(1, 5, "collective") if answer else None]

    def poll(self, timeout):
        if len(self.polls) == 2 and not self.until(self):
            time.sleep(0.01)
            return Poll()
        return super().poll(timeout)


@pytest.mark.hangs  # the frozen case
@pytest.mark.parametrize("frozen", [False, True], ids=["its-node-gone", "frozen"])
def test_a_worker_silent_once_its_peer_stopped_is_lost_without_waiting_for_ray_to_say_so(tmp_path, frozen):
    # Its node went with it: the peer's collective failed at once, but Ray reports the worker
    # dead seconds later (its run() call has not ended in any poll here). Two asks in a row
    # unanswered: it is taken for dead and killed, through the peer that stopped. Where that
    # peer saw its process still there as it killed it, it was frozen: hung, not died.
    reformed = Reformed(step=1, nodes=NODES, source=0, replaced=[1])
    group = SilentGroup([Poll(rows(1)), Poll(failures=[interrupted(0)]), Poll(),
                         Poll(rows(2, 3), done=True, result=WEIGHTS)], [reformed],
                        answers=[False], until=lambda g: ("kill", 1, (0,)) in g.calls, frozen=frozen)
    controller, events = recovering(tmp_path, group, max_failures=1)
    controller.recovery.SILENT_AFTER_S = 0  # how long Ray gets to say it first (with its cause)
    assert controller.run() == WEIGHTS
    events.close()
    assert ("kill", 1, (0,)) in group.calls and ("reform", (1,)) in group.calls and group.asks == 2
    failed = next(e for e in read(tmp_path / "events.jsonl") if e["event"] == "worker_failed")
    assert (failed["rank"], failed["kind"]) == (1, "hung" if frozen else "died") and "did not answer" in failed["cause"]


def test_a_worker_slow_to_answer_once_is_not_taken_for_dead(tmp_path):
    # A loaded machine: rank 1 misses one ask, answers the next, then its collective fails
    # as its peer's did. It is a survivor, not killed.
    reformed = Reformed(step=1, nodes=NODES, source=0)
    group = SilentGroup([Poll(rows(1)), Poll(failures=[interrupted(0)]), Poll(failures=[interrupted(1)]),
                         Poll(rows(2, 3), done=True, result=WEIGHTS)], [reformed],
                        answers=[False, True], until=lambda g: g.asks >= 3 or any(c[0] == "kill" for c in g.calls))
    controller, events = recovering(tmp_path, group, max_failures=1)
    controller.recovery.SILENT_AFTER_S = 0
    assert controller.run() == WEIGHTS
    events.close()
    assert not [c for c in group.calls if c[0] == "kill"]
    assert not [e for e in read(tmp_path / "events.jsonl") if e["event"] == "worker_failed" and e["kind"] == "died"]


def test_a_run_left_below_min_workers_fails_once_its_replacements_are_overdue(tmp_path):
    from raytrainer.errors import PlacementError

    shrunk = Reformed(step=1, nodes=NODES[:1], source=0, dropped=[1])
    group = RegrowingGroup([Poll(rows(1)), Poll(failures=[died(1)]), Poll(failures=[interrupted(0)]),
                            Poll(rows(2))], [shrunk])
    group.joinable = lambda: 0  # the replacement never comes up
    controller, events = recovering(tmp_path, group, max_failures=1, placement_timeout_s=0)
    with pytest.raises(PlacementError, match="fewer than scaling.min_workers=2.*placement_timeout_s=0"):
        controller.run()
    events.close()
    assert read(tmp_path / "events.jsonl")[-1]["event"] == "failed" and group.calls[-1] == ("shutdown",)


def test_a_failure_while_reforming_is_one_more_counted_failure_and_recovery_starts_over(tmp_path):
    reformed = Reformed(step=1, nodes=NODES, source=None, state_from="object_store", replaced=[0])
    group = FailingGroup(
        [Poll(rows(1)), Poll(failures=[died(1)]), Poll(failures=[interrupted(0)]),
         Poll(rows(2, 3), done=True, result=WEIGHTS)],
        [ReformFailed([died(0)], dead=[0]), reformed])
    controller, events = recovering(tmp_path, group, max_failures=2)
    assert controller.run() == WEIGHTS
    events.close()
    # The survivors were aborted (a no-op on Gloo, vital on NCCL) before the group re-formed.
    assert [c for c in group.calls if c[0] in ("abort", "reform")] == [("abort", (0,)), ("reform", (1,)),
                                                                      ("reform", (0,))]
    log = read(tmp_path / "events.jsonl")
    assert [(e["event"], e.get("rank")) for e in log if e["event"] in ("worker_failed", "recovered")] == \
        [("worker_failed", 1), ("worker_failed", 0), ("recovered", None)]
    recovered = next(e for e in log if e["event"] == "recovered")
    assert recovered["failures"] == 2 and recovered["attempts"] == 2 and recovered["state_from"] == "object_store"


def test_failures_while_recovering_are_bounded_by_max_losses(tmp_path):
    group = FailingGroup([Poll(rows(1)), Poll(failures=[died(1)]), Poll(failures=[interrupted(0)])],
                         [ReformFailed([died(0)], dead=[0]), ReformFailed([died(1)], dead=[1])])
    controller, events = recovering(tmp_path, group, max_failures=0, max_losses=1)
    with pytest.raises(FailuresExceeded, match=r"max_losses=1 exceeded: 2 lost workers' recoveries .*rank 0 died"):
        controller.run()
    events.close()
    log = read(tmp_path / "events.jsonl")
    assert log[-1]["event"] == "failed" and "raise failure.max_losses" in log[-1]["reason"]
    assert group.calls[-1] == ("shutdown",)


def test_with_no_survivor_it_restores_and_a_failed_restart_is_absorbed_too(tmp_path):
    from raytrainer.errors import NoSurvivors

    checkpoint = (1, "step-00000001", b"state")
    group = FailingGroup(
        [Poll(rows(1)), Poll(failures=[died(0), died(1)]), Poll(rows(2, 3), done=True, result=WEIGHTS)],
        [NoSurvivors("none"), Reformed(step=1, nodes=NODES, source=1, replaced=[0])])
    restores = []
    controller, events = recovering(tmp_path, group, max_failures=3,
                                    restore=lambda: restores.append(1) or checkpoint)
    # The first setup (the start) works; the restart from the checkpoint loses rank 0.
    original = group.setup

    def setup(resume=None):
        if resume == b"state":
            group.setup = original
            raise ReformFailed([died(0)], dead=[0])
        return original(resume)

    group.setup = setup
    assert controller.run() == WEIGHTS
    events.close()
    assert restores == [1]
    log = read(tmp_path / "events.jsonl")
    recovered = next(e for e in log if e["event"] == "recovered")
    assert recovered["attempts"] == 2 and recovered["failures"] == 2 and recovered["source_rank"] == 1
    assert [c for c in group.calls if c[0] == "reform"] == [("reform", (0, 1)), ("reform", (0,))]


def test_a_worker_lost_while_the_group_first_forms_is_recovered_from(tmp_path):
    group = FailingGroup([Poll(rows(1, 2, 3), done=True, result=WEIGHTS)],
                         [Reformed(step=0, nodes=NODES, source=0, replaced=[1])],
                         restore_setup_fails=[ReformFailed([died(1, step=None)], dead=[1])])
    controller, events = recovering(tmp_path, group, max_failures=1)
    assert controller.run() == WEIGHTS
    events.close()
    assert ("reform", (1,)) in group.calls
    assert [e["event"] for e in read(tmp_path / "events.jsonl")][:3] == ["run_started", "worker_failed", "recovered"]


class ShardedGroup(FailingGroup):
    """Workers whose strategy shards the state (FSDP): setup says so; re-forms from peer
    snapshots go as scripted in `reforms`."""

    def setup(self, resume=None):
        self.calls.append(("setup", resume))
        return Formed(NODES, total_steps=3, replicated=False)

    def _from_peers(self, plan):
        if plan.regrow or plan.grow:
            self.calls.append(("reshard", plan.regrow, plan.grow))
        return self._scripted("reform_from_peers", plan.dead)


def test_sharded_state_recovers_from_peer_snapshots_and_replays_the_steps_since(tmp_path):
    from_peers = Reformed(step=2, nodes=NODES, source=None, state_from="peers", replaced=[1],
                          snapshot_step=2, peers={1: 0})
    val = {"step": 2, "epoch": 0, "world_size": 2, "time": 0.0, "val_loss": 0.5}
    group = ShardedGroup([Poll(rows(1, 2) + [val] + rows(3)), Poll(failures=[died(1, step=3)]),
                          Poll(failures=[interrupted(0)]),
                          Poll(rows(3, 4) + [val, dict(val, step=4)], done=True, result=WEIGHTS)], [from_peers])
    controller, events = recovering(tmp_path, group, max_failures=1, restore=lambda: pytest.fail("read storage"),
                                    recovery="exact")
    assert controller.run() == WEIGHTS
    events.close()
    # The replayed step 3 and validation of step 2 were recorded the first time only.
    written = read(tmp_path / "metrics.jsonl")
    assert [(r["step"], "val_loss" in r) for r in written] == [(1, False), (2, False), (2, True), (3, False),
                                                               (4, False), (4, True)]
    assert [c for c in group.calls if c[0] in ("setup", "shutdown", "reform", "reform_from_peers")] == [
        ("setup", None), ("reform_from_peers", (1,)), ("shutdown",)]
    recovered = next(e for e in read(tmp_path / "events.jsonl") if e["event"] == "recovered")
    assert recovered["state_from"] == "peers" and recovered["snapshot_step"] == 2
    assert recovered["peers"] == {"1": 0} and recovered["steps_lost"] == 1 and recovered["replaced"] == [1]


@pytest.mark.parametrize("snapshots", [True, False])
def test_sharded_state_with_no_peer_snapshot_to_go_back_to_restarts_from_the_newest_checkpoint(tmp_path, snapshots):
    from raytrainer.errors import NoSurvivors

    checkpoint = (2, "step-00000002", "/runs/r/checkpoints/step-00000002")
    group = ShardedGroup([Poll(rows(1, 2, 3)), Poll(failures=[died(0, step=3), died(1, step=3)]),
                          Poll(rows(3), done=True, result=WEIGHTS)],
                         [NoSurvivors("no peer snapshot serves: rank 0 was lost together with rank 1")])
    hub = MetricsHub([JsonlWriter(tmp_path / "metrics.jsonl")])
    events = EventLog(tmp_path / "events.jsonl")
    failure = FailureConfig(max_failures=1, step_timeout_s=None, snapshot_every_n_steps=10 if snapshots else 0)
    controller = Controller(group, ControllerSettings(min_workers=2, poll_interval_s=0, failure=failure),
                            Records(hub=hub, events=events), restore=lambda: checkpoint)
    assert controller.run() == WEIGHTS
    events.close()
    # The whole group restarts, every worker reading its shards.
    assert [c for c in group.calls if c[0] in ("setup", "shutdown", "reform", "reform_from_peers")] == [
        ("setup", None)] + ([("reform_from_peers", (0, 1))] if snapshots else []) + [
        ("shutdown",), ("setup", checkpoint[2]), ("shutdown",)]
    recovered = next(e for e in read(tmp_path / "events.jsonl") if e["event"] == "recovered")
    assert recovered["state_from"] == "checkpoint" and recovered["from_checkpoint"] == "step-00000002"
    assert recovered["steps_lost"] == 1
    assert ("rank 0 was lost together with rank 1" if snapshots else "snapshot_every_n_steps is 0") in recovered["why"]


def test_sharded_state_goes_on_without_the_lost_ranks_resharded_and_grows_back_when_they_are_up(tmp_path):
    """failure.recovery fast (the default): the survivors re-shard the peer snapshots
    onto the ranks left (the world shrinks at once), and the replacement joins at a grow,
    re-sharded again from the snapshots the workers kept as they paused."""
    shrunk = Reformed(step=2, nodes=NODES[:1], source=None, state_from="peers", dropped=[1], snapshot_step=2,
                      peers={1: 0})
    grown = Reformed(step=4, nodes=NODES, source=None, state_from="peers", added=1, snapshot_step=4)
    paused = RunEnd("paused", 4, time=0.0)
    group = ShardedGroup([Poll(rows(1, 2, 3)), Poll(failures=[died(1, step=3)]), Poll(failures=[interrupted(0)]),
                          Poll(rows(3, 4), paused={0: paused}), Poll(rows(5), done=True, result=WEIGHTS)],
                         [shrunk, grown])
    group.joinable = lambda: 1
    controller, events = recovering(tmp_path, group, max_failures=1, restore=lambda: pytest.fail("read storage"))
    assert controller.run() == WEIGHTS
    events.close()
    assert [c for c in group.calls if c[0] in ("setup", "shutdown", "reshard", "reform_from_peers")] == [
        ("setup", None), ("reshard", (1,), False), ("reform_from_peers", (1,)), ("reshard", (), True),
        ("reform_from_peers", ()), ("shutdown",)]
    assert group.plans == [ReformPlan(dead=(1,), regrow=(1,), state_from="peers"),
                           ReformPlan(state_from="peers", grow=True)]
    log = read(tmp_path / "events.jsonl")
    recovered = next(e for e in log if e["event"] == "recovered")
    assert recovered["state_from"] == "peers" and recovered["dropped"] == [1] and recovered["steps_lost"] == 1
    assert "going on without them" in recovered["replacing"]
    assert [(e["old_world_size"], e["new_world_size"], e["cause"].split(":")[0]) for e in log
            if e["event"] == "resized"] == [(2, 1, "failure"), (1, 2, "lost workers replaced")]


def test_exact_recovery_of_sharded_state_waits_for_the_replacement_at_the_same_world_size(tmp_path):
    same = Reformed(step=2, nodes=NODES, source=None, state_from="peers", replaced=[1], snapshot_step=2)
    group = ShardedGroup([Poll(rows(1, 2, 3)), Poll(failures=[died(1, step=3)]), Poll(failures=[interrupted(0)]),
                          Poll(rows(3), done=True, result=WEIGHTS)], [same])
    controller, events = recovering(tmp_path, group, max_failures=1, recovery="exact")
    assert controller.run() == WEIGHTS
    events.close()
    assert not [c for c in group.calls if c[0] == "reshard"] and ("reform_from_peers", (1,)) in group.calls
    assert group.plans == [ReformPlan(dead=(1,), state_from="peers")]
    recovered = next(e for e in read(tmp_path / "events.jsonl") if e["event"] == "recovered")
    assert recovered["replacing"] == "failure.recovery is exact"


def test_a_sharded_run_resizes_through_the_checkpoint_its_workers_wrote_as_they_paused(tmp_path):
    """Without peer snapshots (failure.snapshot_every_n_steps 0) a grow restarts the group
    from the checkpoint the workers wrote as they paused."""
    paused = RunEnd("paused", 2, time=0.0)
    checkpoint = (2, "step-00000002", "/runs/r/checkpoints/step-00000002")
    group = ShardedGroup([Poll(rows(1, 2), paused={0: paused}), Poll(paused={1: paused}),
                          Poll(rows(3), done=True, result=WEIGHTS)], [])
    controller, events = recovering(tmp_path, group, max_failures=0, restore=lambda: checkpoint,
                                    snapshot_every_n_steps=0)
    assert controller.run() == WEIGHTS
    events.close()
    assert [c for c in group.calls if c[0] in ("setup", "shutdown")] == [
        ("setup", None), ("shutdown",), ("setup", checkpoint[2]), ("shutdown",)]
    log = read(tmp_path / "events.jsonl")
    resized = next(e for e in log if e["event"] == "resized")
    assert resized["step"] == 2 and resized["cause"] == "room to grow"
    assert not [e for e in log if e["event"] in ("worker_failed", "recovered")]


def test_a_checkpoint_the_workers_find_corrupt_is_skipped_for_the_next_older(tmp_path):
    """The driver only names the checkpoint; rank 0 reads it and reports it corrupt: the
    controller warns, logs it, and forms the group from the next older one."""
    from raytrainer.errors import CheckpointCorrupt

    group = FakeGroup([Poll(rows(5, 6), done=True, result=WEIGHTS)])
    setups = []

    def setup(resume=None):
        setups.append(resume)
        if resume == "ref-6":
            raise CheckpointCorrupt("step-00000006", "is corrupt: its state.pt differs")
        return Formed(NODES, total_steps=6)

    group.setup = setup
    hub = MetricsHub([JsonlWriter(tmp_path / "metrics.jsonl")])
    events = EventLog(tmp_path / "events.jsonl")
    asked = []
    controller = Controller(group, ControllerSettings(min_workers=2, poll_interval_s=0), Records(hub=hub, events=events),
                            resume=(6, "step-00000006", "ref-6"),
                            restore=lambda before=None: asked.append(before) or (4, "step-00000004", "ref-4"))
    with pytest.warns(RuntimeWarning, match="checkpoint step-00000006 is corrupt.*falling back to an older one"):
        assert controller.run() == WEIGHTS
    events.close()
    assert setups == ["ref-6", "ref-4"] and asked == [6]
    log = read(tmp_path / "events.jsonl")
    assert [(e["event"], e["step"]) for e in log if e["event"] in ("checkpoint_skipped", "resumed")] == [
        ("checkpoint_skipped", 6), ("resumed", 4)]


def test_your_own_loop_counts_as_a_batch_that_follows_the_world_size():
    # A fixed-size run of your own loop is never shrunk behind its back (its batches may be
    # per worker, as a Hugging Face Trainer's are): a lost worker is waited for, unless a
    # spare is up; a Task run with the default fixed_global batch goes on without it.
    from raytrainer.config import load_config

    base = {"trainer": {"max_steps": 4}, "scaling": {"num_workers": 2}}
    loop = load_config({**base, "task": {"loop": "tests.tasks:regression_loop"}})
    task = load_config({**base, "task": {"target": "tests.tasks:RegressionTask"}})
    per_worker = load_config({**base, "task": {"target": "tests.tasks:RegressionTask"}},
                             ["trainer.batch_policy=per_worker"])
    assert ControllerSettings.of(loop).per_worker_batch and ControllerSettings.of(per_worker).per_worker_batch
    assert not ControllerSettings.of(task).per_worker_batch


class StoppingGroup(FakeGroup):
    """A signal arrives at the driver after the first poll."""

    def __init__(self, polls):
        super().__init__(polls)
        self.controller = None

    def poll(self, timeout):
        if ("launch",) in self.calls and self.controller.stop_signal is None:  # training
            self.controller.request_stop(2)
        return super().poll(timeout)

    def pause(self):
        self.calls.append(("pause",))

    def save_paused(self):
        self.calls.append(("save_paused",))
        return Poll(rows(3), events=[{"event": "checkpoint_committed", "step": 3, "path": "p", "bytes": 1}])


def test_a_stop_pauses_the_workers_once_commits_a_checkpoint_there_and_raises_stopped(tmp_path):
    from raytrainer.errors import Stopped

    paused = RunEnd("paused", 3, time=0.0)
    group = StoppingGroup([Poll(rows(1, 2)), Poll([]), Poll(paused={0: paused}), Poll(paused={1: paused})])
    hub = MetricsHub([JsonlWriter(tmp_path / "metrics.jsonl")])
    events = EventLog(tmp_path / "events.jsonl")
    controller = Controller(group, ControllerSettings(min_workers=2, poll_interval_s=0), Records(hub=hub, events=events),
                            restore=lambda before=None: (3, "step-00000003", None))
    group.controller = controller
    with pytest.raises(Stopped) as info:
        controller.run()
    events.close()
    assert isinstance(info.value, KeyboardInterrupt) and (info.value.step, info.value.checkpoint_step) == (3, 3)
    assert [c[0] for c in group.calls if c[0] in ("pause", "save_paused", "shutdown")] == \
        ["pause", "save_paused", "shutdown"]
    log = read(tmp_path / "events.jsonl")
    assert [e["event"] for e in log][-2:] == ["checkpoint_committed", "stopped"]
    assert log[-1]["signal"] == "SIGINT" and log[-1]["checkpoint"] == "step-00000003"


class SlowGroup(FakeGroup):
    """Rank 0 works for `seconds` of a fake clock without finishing a batch (a compile, a
    long load, a core it gets a sliver of), its working thread busy all along; rank 1 waits
    for it in a collective. One poll per fake second, then the run ends."""

    def __init__(self, clock, seconds):
        super().__init__([Poll() for _ in range(seconds)] + [Poll(rows(1), done=True, result=WEIGHTS)])
        self.clock = clock

    def poll(self, timeout):
        self.clock.now += 1.0
        return super().poll(timeout)

    def status(self, timeout=1.0):
        from raytrainer.contract import Status

        return [Status(0, 5, "user", busy_s=self.clock.now), Status(0, 5, "collective", busy_s=0.0)]

    def kill(self, rank, answering=()):
        self.calls.append(("kill", rank))
        return False


def test_a_slow_worker_is_not_hung_however_long_it_takes(tmp_path, monkeypatch):
    import raytrainer.driver.controller as controller_module
    import raytrainer.driver.watchdog as watchdog_module

    class Clock:
        now = 1000.0

        def monotonic(self):
            return self.now

        def time(self):
            return self.now

    clock = Clock()
    for module in (controller_module, watchdog_module):  # the hang check runs in the watchdog, on this clock
        monkeypatch.setattr(module, "time", clock)
    group = SlowGroup(clock, seconds=20)  # step_timeout_s 3, 20 s without a batch done
    hub = MetricsHub([JsonlWriter(tmp_path / "metrics.jsonl")])
    events = EventLog(tmp_path / "events.jsonl")
    settings = ControllerSettings(min_workers=2, poll_interval_s=0,
                                  failure=FailureConfig(max_failures=0, step_timeout_s=3))
    assert Controller(group, settings, Records(hub=hub, events=events)).run() == WEIGHTS
    events.close()
    assert not [c for c in group.calls if c[0] == "kill"]
    assert "worker_failed" not in [e["event"] for e in read(tmp_path / "events.jsonl")]


def test_a_reform_plan_names_its_ranks_as_tuples_and_grows_only_from_peers():
    """The one way the controller asks a group to re-form (WorkerGroup.reform): the plan is
    a value (the fakes above compare it), whatever sequences it was built from."""
    assert ReformPlan(dead=[1], leave=[2], regrow=[1]) == ReformPlan(dead=(1,), leave=(2,), regrow=(1,))
    assert ReformPlan().state_from == "survivor" and not ReformPlan().grow
    with pytest.raises(ValueError, match="from peers"):
        ReformPlan(grow=True)  # from a survivor the workers ready to join always join


@pytest.mark.parametrize("replicated, recovery, plan", [
    (True, "fast", ReformPlan(dead=(1,), regrow=(1,))),
    (True, "exact", ReformPlan(dead=(1,))),
    (False, "fast", ReformPlan(dead=(1,), regrow=(1,), state_from="peers")),
    (False, "exact", ReformPlan(dead=(1,), state_from="peers")),
])
def test_each_recovery_path_asks_for_its_plan(tmp_path, replicated, recovery, plan):
    """Replicated state re-forms from a survivor, sharded from the peer snapshots; a fast
    recovery leaves the rank with no spare up behind to regrow, an exact one waits for it."""
    reformed = Reformed(step=1, nodes=NODES, source=0 if replicated else None, replaced=[1])
    polls = [Poll(rows(1)), Poll(failures=[died(1)]), Poll(failures=[interrupted(0)]),
             Poll(rows(2, 3), done=True, result=WEIGHTS)]
    group = FailingGroup(polls, [reformed]) if replicated else ShardedGroup(polls, [reformed])
    controller, events = recovering(tmp_path, group, max_failures=1, recovery=recovery)
    assert controller.run() == WEIGHTS
    events.close()
    assert group.plans == [plan]
