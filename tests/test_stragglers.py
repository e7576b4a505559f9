"""Slow workers (driver/stragglers.py): the decision on synthetic per-rank compute times,
the watch over rows as the controller feeds it, and the controller moving a slow rank
(failure.stragglers: replace) against a fake group. A real run with a worker slowed from
outside is in tests/test_straggler_run.py."""

import json
import time

import pytest

from raytrainer.config.failure import FailureConfig
from raytrainer.contract import COMPUTE_KEY, Formed, Node, Poll, Reformed, RunEnd
from raytrainer.driver.controller import Controller, ControllerSettings, Records
from raytrainer.driver.metrics import EventLog, JsonlWriter, MetricsHub

from .test_preemption import NODES, DrainedGroup
from raytrainer.driver.stragglers import StragglerWatch, block_ratios, slow_ranks


def test_each_rank_is_compared_with_the_median_of_the_others():
    assert block_ratios([1.0, 2.0]) == [0.5, 2.0]  # of two, the slow one against the fast one
    assert block_ratios([1.0, 1.0, 1.0, 3.0]) == [1.0, 1.0, 1.0, 3.0]  # the slow one moves no median
    assert block_ratios([5.0]) == [1.0]  # nobody to compare with


def test_a_rank_is_slow_only_when_every_block_says_so():
    slow, even, hiccup = [1.0, 1.0, 1.5], [1.0, 1.0, 1.0], [1.0, 1.0, 4.0]
    assert slow_ranks([slow, slow], margin=1.3) == {2: 1.5}
    assert slow_ranks([hiccup, even], margin=1.3) == {}  # one bad block: a hiccup, not a slow worker
    assert slow_ranks([[1.0, 1.0, 1.2], slow], margin=1.3) == {}  # under the margin once
    assert slow_ranks([hiccup, slow], margin=1.3) == {2: 1.5}  # the smaller ratio is reported
    assert slow_ranks([[1.0, 1.0]], margin=1.3) == {}


class Events:
    def __init__(self):
        self.logged = []

    def log(self, event, step=None, **fields):
        self.logged.append({"event": event, "step": step, **fields})


def feed(watch, first, times):
    rows = [{"step": first + i, COMPUTE_KEY: list(t)} for i, t in enumerate(times)]
    watch.rows(rows)
    assert all(COMPUTE_KEY not in r for r in rows)  # not a metric: out of the rows
    return first + len(times)


def test_the_watch_reports_a_slow_rank_once_after_two_windows_and_starts_anew_after_a_reform():
    events = Events()
    watch = StragglerWatch(events, "replace", margin=1.3, window=5, node_ip=lambda r: "10.0.0.%d" % r)
    feed(watch, 1, [(0.01, 0.01)] * 10 + [(0.01, 0.05)] + [(0.01, 0.01)] * 9)  # one hiccup: nothing
    assert events.logged == []
    with pytest.warns(Warning, match="rank 1 .* 1.40x slower"):
        step = feed(watch, 21, [(0.01, 0.02)] * 10)
    assert [e for e in events.logged if e["event"] == "slow_worker"] == [
        {"event": "slow_worker", "step": 27, "rank": 1, "node": "10.0.0.1", "ratio": 1.4, "steps": 10,
         "since_step": 18, "margin": 1.3, "action": "replace"}]  # 2 slow steps of 5 in the older block
    assert watch.to_replace() == [1]
    feed(watch, step, [(0.01, 0.02)] * 10)
    assert len(events.logged) == 1  # once per group
    watch.formed()  # re-formed with rank 1 replaced
    assert watch.to_replace() == []
    feed(watch, 41, [(0.01, 0.011)] * 10)
    assert len(events.logged) == 1


def test_a_rank_slowed_mid_way_is_found_about_a_window_and_a_few_steps_later():
    events = Events()
    watch = StragglerWatch(events, "report", margin=1.3, window=20, node_ip=lambda r: None)
    with pytest.warns(Warning):
        feed(watch, 1, [(0.01, 0.01)] * 50 + [(0.01, 0.02)] * 40)  # twice as slow from step 51
    assert [e["step"] for e in events.logged] == [77]  # 7 slow steps of 20 (51-57) in the older block: 1.35x


def test_the_watch_judges_as_the_sums_over_the_last_two_windows_would_over_a_long_run():
    import random

    rng = random.Random(0)
    times = [[rng.uniform(0.01, 0.02) for _ in range(4)] for _ in range(3000)]
    for t in times[2000:]:
        t[3] *= 1.4  # rank 3 slow from step 2001
    first = None  # the step a brute-force judge of the last two windows finds rank 3 at
    for end in range(40, len(times) + 1):
        blocks = [[sum(col) for col in zip(*times[i:i + 20])] for i in (end - 40, end - 20)]
        if slow_ranks(blocks, 1.3):
            first = end
            break
    events = Events()
    watch = StragglerWatch(events, "report", margin=1.3, window=20, node_ip=lambda r: None)
    with pytest.warns(Warning):
        feed(watch, 1, times)
    assert first is not None and [(e["step"], e["rank"]) for e in events.logged] == [(first, 3)]


def test_report_mode_reports_but_moves_nothing_and_off_measures_nothing():
    events = Events()
    watch = StragglerWatch(events, "report", margin=1.3, window=5, node_ip=lambda r: None)
    with pytest.warns(Warning, match="failure.stragglers=replace"):
        feed(watch, 1, [(0.03, 0.01)] * 10)
    assert watch.to_replace() == [] and [e["rank"] for e in events.logged] == [0]
    off = StragglerWatch(events, "off", margin=1.3, window=5, node_ip=lambda r: None)
    feed(off, 1, [(0.03, 0.01)] * 10)
    assert len(events.logged) == 1


# ---------------------------------------------------------------------- the controller, with a fake group

class SlowGroup(DrainedGroup):
    """Two workers, rank 1 twice as slow in every row; its replacement is up at the second
    look; no node is drained."""

    def setup(self, resume=None):
        return Formed(NODES, total_steps=60)

    def draining(self):
        return {}

    def replacements(self, ranks):
        self.calls.append(("replacements", tuple(ranks)))
        self.looks += bool(ranks)
        return list(ranks) if self.looks > 1 else []

    def reform(self, plan):
        assert plan.state_from == "survivor" and not plan.regrow
        self.calls.append(("reform", plan.dead, plan.leave))
        return Reformed(step=40, nodes=[NODES[0], Node("10.0.0.3", node_id="n3", pid=3)], source=0, moved=[1])


def slow_rows(first, last):
    return [{"step": s, "epoch": 0, "world_size": 2, "time": 0.0, "loss": 1.0, COMPUTE_KEY: [0.01, 0.02]}
            for s in range(first, last + 1)]


def test_replace_moves_the_slow_rank_at_a_pause_as_a_drain_does_with_no_failure(tmp_path):
    paused = RunEnd("paused", 40, time=time.time())
    done = RunEnd("finished", 60, stop_reason="completed", model_uri="w")
    group = SlowGroup([Poll(slow_rows(1, 40)), Poll([]), Poll(paused={0: paused, 1: paused}),
                       Poll(slow_rows(41, 60), done=True, result=done)])
    events = EventLog(tmp_path / "events.jsonl")
    settings = ControllerSettings(min_workers=2, poll_interval_s=0, drain_check_s=0,
                                  failure=FailureConfig(stragglers="replace"))
    controller = Controller(group, settings, Records(hub=MetricsHub([JsonlWriter(tmp_path / "m.jsonl")]),
                                                     events=events))
    with pytest.warns(Warning, match="rank 1"):
        assert controller.run() == done
    events.close()
    calls = [c for c in group.calls if c[0] in ("replacements", "pause", "reform") and c != ("replacements", ())]
    # Asked for rank 1's replacement until it was up, then paused once, re-formed without it.
    assert calls == [("replacements", (1,)), ("replacements", (1,)), ("pause",), ("reform", (), (1,))]
    log = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    names = [e["event"] for e in log]
    assert names.count("slow_worker") == 1  # the rows after the move start anew: 20 steps, not judged yet
    assert "worker_failed" not in names and "recovered" not in names and "resized" not in names
    moved = next(e for e in log if e["event"] == "slow_worker_replaced")
    assert (moved["rank"], moved["old_pid"], moved["moved"], moved["steps_lost"]) == (1, 2, True, 0)
    assert moved["pids"] == [1, 3]
    assert all(COMPUTE_KEY not in json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines())
