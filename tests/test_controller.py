"""The controller against a fake worker group: no cluster, no torch."""

import json

import pytest

from raytrainer.controller import Controller, State
from raytrainer.errors import ConfigError, WorkerError
from raytrainer.group import Poll
from raytrainer.metrics import EventLog, JsonlWriter, MetricsHub


class FakeGroup:
    def __init__(self, polls, fail_on_setup=None, storage=None):
        self.polls = list(polls)
        self.fail_on_setup = fail_on_setup
        self.storage = storage  # what check_storage returns, or the error it raises
        self.calls = []

    def start(self):
        self.calls.append(("start", 2))
        return [{"ip": "10.0.0.1"}] * 2

    def check_storage(self, nodes):
        self.calls.append(("check_storage", len(nodes)))
        if isinstance(self.storage, Exception):
            raise self.storage
        return self.storage

    def setup(self, resume=None):
        self.calls.append(("setup",))
        if self.fail_on_setup:
            raise self.fail_on_setup
        return {"total_steps": 3}

    def launch(self):
        self.calls.append(("launch",))

    def poll(self, timeout):
        item = self.polls.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def shutdown(self):
        self.calls.append(("shutdown",))


def rows(*steps):
    return [{"step": s, "epoch": 0, "world_size": 2, "time": 0.0, "loss": 1.0 / s} for s in steps]


def make(tmp_path, group):
    hub = MetricsHub([JsonlWriter(tmp_path / "metrics.jsonl")])
    events = EventLog(tmp_path / "events.jsonl")
    return Controller(group, 2, hub, events, poll_interval_s=0), hub, events


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rows_reach_the_sinks_and_the_run_finishes(tmp_path):
    group = FakeGroup([Poll(rows(1, 2)), Poll([]), Poll(rows(3), done=True, result="weights")])
    controller, hub, events = make(tmp_path, group)
    assert controller.run() == "weights"
    hub.close(), events.close()
    assert controller.state is State.FINISHED
    assert [r["step"] for r in read(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    log = read(tmp_path / "events.jsonl")
    assert [e["event"] for e in log] == ["run_started", "group_formed", "finished"]
    assert log[1]["world_size"] == 2 and log[1]["total_steps"] == 3 and log[-1]["step"] == 3
    assert group.calls == [("start", 2), ("check_storage", 2), ("setup",), ("launch",), ("shutdown",)]


def test_a_worker_failure_fails_the_run_logs_it_and_shuts_down(tmp_path):
    error = WorkerError(1, "ValueError: boom", "Traceback ...", step=2)
    group = FakeGroup([Poll(rows(1)), error])
    controller, hub, events = make(tmp_path, group)
    with pytest.raises(WorkerError, match="rank 1, step 2"):
        controller.run()
    events.close()
    assert controller.state is State.FAILED
    failed = read(tmp_path / "events.jsonl")[-1]
    assert failed["event"] == "failed" and failed["rank"] == 1 and failed["step"] == 1
    assert "boom" in failed["cause"]
    assert group.calls[-1] == ("shutdown",)


def test_a_setup_failure_still_shuts_down(tmp_path):
    group = FakeGroup([], fail_on_setup=KeyboardInterrupt())
    controller, _, events = make(tmp_path, group)
    with pytest.raises(KeyboardInterrupt):
        controller.run()
    events.close()
    assert group.calls[-1] == ("shutdown",)
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
    group = FakeGroup([Poll(rows(1), done=True)], storage={"nodes": 2, "workers": 2})
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

    def reform(self, dead):
        self.calls.append(("reform", tuple(dead)))
        return {"step": 2, "world_size": 3, "source": 0, "replaced": [], "dropped": [], "added": 1,
                "resynced": []}


def test_room_to_grow_pauses_the_workers_and_reforms_the_group(tmp_path):
    paused = {"status": "paused", "step": 2, "time": 0.0}
    group = GrowingGroup([Poll(rows(1)), Poll(rows(2)), Poll(paused={0: paused}), Poll(paused={1: paused}),
                          Poll(rows(3), done=True, result="weights")])
    hub = MetricsHub([JsonlWriter(tmp_path / "metrics.jsonl")])
    events = EventLog(tmp_path / "events.jsonl")
    controller = Controller(group, 2, hub, events, poll_interval_s=0, max_workers=3, grow_check_s=0)
    assert controller.run() == "weights"
    events.close()
    # Asked once (no second pause while the first is under way), reformed once all paused.
    calls = [c for c in group.calls if c[0] in ("joinable", "pause", "reform", "launch")]
    assert calls == [("launch",), ("joinable",), ("joinable",), ("pause",), ("reform", ()), ("launch",)]
    log = read(tmp_path / "events.jsonl")
    resize = next(e for e in log if e["event"] == "resized")
    assert (resize["old_world_size"], resize["new_world_size"], resize["step"], resize["added"]) == (3 - 1, 3, 2, 1)
    assert resize["cause"] == "room to grow" and resize["seconds"] > 0
    assert controller.world == 3


def test_a_fixed_size_run_never_looks_for_room(tmp_path):
    group = GrowingGroup([Poll(rows(1)), Poll(rows(2)), Poll(rows(3), done=True, result="w")])
    controller, _, events = make(tmp_path, group)
    controller.run()
    assert ("joinable",) not in group.calls
