"""Slow workers (driver/stragglers.py): the decision on synthetic per-rank compute times,
and the watch over rows as the controller feeds it. A real run with a worker slowed from
outside is in tests/test_straggler_run.py."""

import pytest

from raytrainer.contract import COMPUTE_KEY
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


def test_report_mode_reports_but_moves_nothing_and_off_measures_nothing():
    events = Events()
    watch = StragglerWatch(events, "report", margin=1.3, window=5, node_ip=lambda r: None)
    with pytest.warns(Warning, match="failure.stragglers=replace"):
        feed(watch, 1, [(0.03, 0.01)] * 10)
    assert watch.to_replace() == [] and [e["rank"] for e in events.logged] == [0]
    off = StragglerWatch(events, "off", margin=1.3, window=5, node_ip=lambda r: None)
    feed(off, 1, [(0.03, 0.01)] * 10)
    assert len(events.logged) == 1
