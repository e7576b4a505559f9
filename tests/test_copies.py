"""Two copies, always: a lone survivor keeps a copy of the state in its node's shared memory,
so a second failure in the window before its replacement joins loses at most a step; and
the state moves between workers packed (worker/state/transfer.py), one copy per tensor each way."""

import copy
import os
import random
import struct
from pathlib import Path

import pytest
import torch

import raytrainer
from raytrainer.worker.state import copies
from raytrainer.worker.state.strategy import load_optimizer
from raytrainer.worker.state.transfer import Packed, pack, unpack

from .conftest import assert_no_leaks
from .faults import Run, kill

SHM = Path(copies.default_dir())


def copies_left(run: str) -> list[str]:
    """The copies of run `run` in this node's shared memory (other test sessions' runs make
    and remove theirs meanwhile: a spare's recovery on one node goes through one)."""
    return sorted(p.name for p in SHM.glob(f"raytrainer-copy-{run}-*"))


def training_state(width=512, layers=3):
    """A model with Adam's state after a step, a few MB, with the odds and ends a loop's
    state holds: a bf16 tensor, 0-dim and empty tensors, counters, None."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                              "ema": torch.randn(7, dtype=torch.bfloat16), "empty": torch.empty(0, 3),
                              "loop": {"step": 12, "best": None, "scale": torch.tensor(2.0)}}


def assert_same_state(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_state(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_state(x, y)
    else:
        assert a == b


def test_a_state_of_a_few_mb_crosses_the_object_store_packed_and_loads_into_a_new_worker(ray_local):
    model, optimizer, state = training_state()
    packed = pack(state)
    assert packed.nbytes > 3e6
    ref = ray_local.put(packed)
    del packed

    @ray_local.remote(num_cpus=0)
    def take(packed):  # another process: unpack, load, step on
        fresh = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(3)])
        opt = torch.optim.Adam(fresh.parameters())
        loaded = unpack(packed, views=("model", "optimizer"))  # views, copied by the loads
        mapped = {b.ctypes.data for b in packed.buffers}
        views = [t.data_ptr() in mapped for t in loaded["model"].values()]
        views += [t.data_ptr() in mapped for s in loaded["optimizer"]["state"].values() for t in s.values()]
        copies = [t.data_ptr() in mapped for t in (loaded["ema"], loaded["loop"]["scale"])]
        as_loaded = copy.deepcopy(loaded)
        fresh.load_state_dict(loaded["model"])
        load_optimizer(opt, loaded["optimizer"])  # clones what the optimizer lacks
        fresh(torch.ones(4, 512)).sum().backward()
        opt.step()  # in place: the object store's memory is read-only, the state must not be it
        return as_loaded, fresh.state_dict(), isinstance(packed, Packed), views, copies

    loaded, stepped, was_packed, views, copies = ray_local.get(take.remote(ref))
    assert was_packed
    assert views and all(views) and copies and not any(copies)
    assert_same_state(state, loaded)
    model(torch.ones(4, 512)).sum().backward()
    optimizer.step()
    assert_same_state(model.state_dict(), stepped)


def test_a_copy_written_in_turns_reads_back_its_newest_complete_step(tmp_path, monkeypatch):
    monkeypatch.setattr(copies, "PART_BYTES", 1024)  # its 0.1 MB in one part per core, as 2 GB would be
    _, _, state = training_state(width=64)
    name = f"raytrainer-copy-unit-{os.getpid()}"
    copy = copies.StateCopy(name)
    try:
        assert copies.read(name) == (None, None)
        copy.take(12, lambda: state)
        copy.take(12, lambda: 1 / 0)  # the same step again: nothing to take
        newer = {**state, "loop": {**state["loop"], "step": 13}}
        copy.take(13, lambda: newer)
        step, packed = copies.read(name)
        assert step == 13
        assert_same_state(newer, unpack(packed))
        # The bytes in one part file per writer (this machine's cores, up to MAX_PARTS).
        parts = min(copies.MAX_PARTS, os.cpu_count())
        assert sorted(p.name for p in SHM.glob(f"{name}-1.*")) == [f"{name}-1.{i}" for i in range(parts)]
        # A death in the middle of writing step 13 leaves its file incomplete: step 12 serves.
        newest = next(p for p in SHM.glob(f"{name}-[01]") if struct.unpack("<8sq", p.read_bytes()[:16])[1] == 13)
        with open(newest, "r+b") as f:
            f.seek(16)
            f.write(struct.pack("<q", 0))
        step, packed = copies.read(name)
        assert step == 12
        assert_same_state(state, unpack(packed))
    finally:
        copy.remove()
    assert not list(SHM.glob(f"{name}-*"))


def test_a_worker_given_the_survivors_copy_loads_the_step_it_was_written_for():
    """A warm spare on the giver's node takes the state from the giver's copy (CopiedState),
    not from the object store: the step the driver names, else a clear error."""
    from raytrainer.contract import CopiedState
    from raytrainer.worker.process.forming import resolve

    _, _, state = training_state(width=64)
    name = f"raytrainer-copy-taken-{os.getpid()}"
    copy = copies.StateCopy(name)
    try:
        copy.take(12, lambda: state)
        assert_same_state(state, unpack(resolve(CopiedState(name, 12), own_snapshot=None)))
        with pytest.raises(RuntimeError, match=f"{name}, holds step 12, not 13"):
            resolve(CopiedState(name, 13), own_snapshot=None)
    finally:
        copy.remove()


def test_copy_now_writes_the_step_a_recovery_secured_elsewhere():
    """A lone holder's copy skips the step its recovery secured in the object store; asked
    for a copy now (a spare on its node takes the state from it), it writes that step."""
    from types import SimpleNamespace

    from raytrainer.worker.process.actor import Worker

    _, _, state = training_state(width=64)
    name = f"raytrainer-copy-now-{os.getpid()}"
    worker = object.__new__(Worker)
    worker._copy, worker.rank = copies.LoneCopy(lambda: worker.rank), 0  # as Worker.__init__ makes it
    worker.loop = SimpleNamespace(step=12, state_dict=lambda: state, keeper=None)
    try:
        worker.keep_copy(name, secured=12)
        assert copies.read(name) == (None, None)
        assert worker.copy_now(name) == 12
        assert copies.read(name)[0] == 12
    finally:
        worker.keep_copy(None)
    assert not list(SHM.glob(f"{name}-*"))


def test_a_copy_with_no_room_is_warned_of_and_training_goes_on_without_it(monkeypatch):
    """The lone holder's keeper, where the copy finds no room: a warning naming the rank,
    and the loop's keeper dropped (no step waits on a copy that cannot be made)."""
    from types import SimpleNamespace

    _, _, state = training_state(width=8)
    monkeypatch.setattr(copies, "_free_bytes", lambda path: 0)
    rank = [3]
    lone = copies.LoneCopy(lambda: rank[0])
    loop = SimpleNamespace(step=5, state_dict=lambda: state, keeper=None)
    lone.keep(loop, f"raytrainer-no-room-{os.getpid()}")
    assert loop.keeper is not None
    rank[0] = 1  # renumbered since: the warning says the rank it has now
    with pytest.warns(UserWarning, match=r"rank 1: no copy of the state kept .*no room for two copies"):
        loop.keeper(6, loop.state_dict)
    assert loop.keeper is None
    lone.remove()
    assert lone.copy is None


def test_the_tensors_are_spread_whole_over_the_parts_largest_first():
    places, sizes = copies._place([100, 0, 60, 50, 40, 10], 3)
    assert sizes == [100, 70, 90]  # 100 | 60, 10 | 50, 40
    assert places == [(0, 0), (1, 70), (1, 0), (2, 0), (2, 50), (1, 60)]
    assert copies._place([0, 0], 4) == ([(0, 0), (0, 0)], [0])  # no empty part files
    assert copies._place([7], 8) == ([(0, 0)], [7])


def test_the_step_a_recovery_secured_is_not_copied_again_the_next_one_is(tmp_path):
    _, _, state = training_state(width=64)
    name = f"raytrainer-copy-secured-{os.getpid()}"
    copy = copies.StateCopy(name, step=12)
    try:
        copy.take(12, lambda: 1 / 0)  # the object store holds step 12: the first step goes on at once
        assert copies.read(name) == (None, None)
        copy.take(13, lambda: state)
        assert copies.read(name)[0] == 13
        assert [p.name for p in SHM.glob(f"{name}-0.*")] == [f"{name}-0.0"]  # 0.1 MB: one part
    finally:
        copy.remove()


def test_the_driver_tells_a_lone_holder_which_step_its_recovery_secured():
    from raytrainer.config import load_config
    from raytrainer.contract import Node, Status
    from raytrainer.driver.group.actors import Roster
    from raytrainer.driver.group.copies import KeptCopies

    class Actor:
        def __init__(self):
            self.calls = []
            self.keep_copy = self  # actor.keep_copy.remote(...)

        def remote(self, *args):
            self.calls.append(args)

    kept = KeptCopies(load_config({"task": {"target": "tests.tasks:RegressionTask"}, "trainer": {"max_steps": 1},
                                   "scaling": {"num_workers": 2}}))
    lone, node = Actor(), Node(node_id="n1", ip="127.0.0.1")
    kept.after_form(Roster(actors=[lone], nodes=[node]), (Status(step=7, progress=0, phase="train"), "ref"))
    (name, secured), = lone.calls
    assert name.startswith("raytrainer-copy-") and secured == 7
    assert kept.secured[1] == "ref"
    kept.after_form(Roster(actors=[lone, Actor()], nodes=[node, node]), None)  # a second holder is back
    assert lone.calls[-1] == (None,) and kept.holder is None and kept.secured is None


def test_a_re_form_puts_the_state_in_the_object_store_only_for_a_worker_that_takes_it():
    """reforming._secure carries out policy.secure_where (its cases: test_fault_tolerance):
    two holders at the same step are its copies; a lone holder writes its copy beside it,
    and where it has no room for one the object store holds it."""
    from types import SimpleNamespace

    from raytrainer.contract import Node, Status
    from raytrainer.driver.group.reforming import _secure

    def group(written=7, secured=None):
        calls = []
        forming = SimpleNamespace(
            secured=secured, answer=lambda rank, ref: (calls.append(("answer", rank, ref)), written)[1],
            take_state=lambda holders, avoid=(): (calls.append(("put",)), (1, "ref", holders[1]))[1])
        copies = SimpleNamespace(wanted=True, copy_now=lambda actor, node: (calls.append(("copy", actor, node)),
                                                                            "copying")[1])
        roster = SimpleNamespace(actors=["a0", "a1", "a2"],
                                 nodes=[Node(node_id=f"n{i}", ip="127.0.0.1") for i in range(3)])
        return SimpleNamespace(forming=forming, copies=copies, roster=roster), calls

    at = Status(step=7, progress=0, phase="train")
    two, calls = group()
    assert _secure(two, {0: at, 1: at}, keep=[0, 1])[1:] == (None, at, "holders") and calls == []
    lone, calls = group()
    assert _secure(lone, {1: at}, keep=[1]) == (1, None, at, "copy")
    assert calls == [("copy", "a1", "n1"), ("answer", 1, "copying")]
    full, calls = group(written=None)  # no room in /dev/shm nor the temp dir
    assert _secure(full, {1: at}, keep=[1])[1:] == ("ref", at, "object_store") and calls[-1] == ("put",)
    earlier, calls = group(secured=(at, "ref0"))  # an earlier attempt of this recovery secured it
    assert _secure(earlier, {0: at, 1: at}, keep=[0, 1])[3] == "object_store" and calls == [("put",)]


# ---------------------------------------------------------------------------- from outside


def config(tmp_path, name, steps=40):
    # Default failure settings (fast recovery, a warm spare); steps slow enough (0.15 s a
    # micro-batch) that the test acts inside the window before a replacement joins.
    return {
        "task": {"target": "tests.tasks:RegressionTask", "args": {"sleep_s": 0.15}},
        "trainer": {"max_steps": steps, "global_batch_size": 32},
        "scaling": {"num_workers": 2},
        "run": {"name": name, "storage": str(tmp_path)},
    }


def recovered(run):
    return [e for e in run.events() if e["event"] == "recovered"]


@pytest.mark.parametrize("steps_alone", [2, 0], ids=["after-two-steps-alone", "at-once"])
def test_the_lone_survivor_killed_too_resumes_from_its_copy_losing_at_most_a_step(ray_local, tmp_path, steps_alone):
    """Killed after two steps alone: from the copy in shared memory. Killed as soon as its
    recovery ends: from the state that recovery secured (its first copy is of the step
    after, so none is written yet)."""
    name = f"kills-{os.getpid()}"
    assert copies_left(name) == []
    base = raytrainer.train(config(tmp_path, "base"), progress=False)
    run = Run(config(tmp_path, name))
    run.wait_for_step(3)
    pick = random.Random(os.getpid())
    # Kill a worker until a recovery leaves one (a warm spare up takes the lost rank's place:
    # two holders still; the next kill finds the spare used up).
    lone = None
    for _ in range(2):
        seen = len(recovered(run))
        kill(pick.choice(run.pids()))
        run.wait_for(lambda: len(recovered(run)) > seen, "a recovery")
        if len(recovered(run)[-1]["pids"]) == 1:
            lone = recovered(run)[-1]
            break
    assert lone is not None, f"no recovery left one worker: {recovered(run)}"
    # No worker took the state: its second copy is the one it wrote beside it, not the object store's.
    assert lone["secured"] == "copy", lone
    # It trains on alone, copying its state at every step; kill it too before its replacement joins.
    if steps_alone:
        run.wait_for_step(lone["step"] + steps_alone)
    grown = [e for e in run.events() if e["event"] == "resized" and e["new_world_size"] > 1 and e["time"] > lone["time"]]
    kill(lone["pids"][0])
    result = run.result()
    assert grown == [], "the replacement joined before the second kill: not the window this test is about"
    assert copies_left(name) == [], f"copies left behind: {copies_left(name)}"
    after = [e for e in result.events if e["event"] == "recovered" and e["time"] > lone["time"]][0]
    assert after["state_from"] == "copy", after
    assert after["steps_lost"] <= 1, after
    if steps_alone:
        assert after["step"] > lone["step"], "the copy is of a step the lone survivor took"
    else:
        assert after["step"] >= lone["step"], after
    # A run that trained at world size 1 for a while ends within float rounding of one that never did.
    ours = torch.load(result.run_dir / "model.pt", weights_only=True)
    theirs = torch.load(base.run_dir / "model.pt", weights_only=True)
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-5)
    assert_no_leaks()
