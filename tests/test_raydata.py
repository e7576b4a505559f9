"""Ray Data as the training input: each rank streams its split of a pipeline whose
preprocessing runs in Ray's tasks; the position survives a resume by row count."""

from pathlib import Path

import pytest

import raytrainer
from raytrainer.errors import ConfigError

from .conftest import assert_no_leaks


def config(tmp_path, name, steps, record, workers=2):
    return {
        "task": {"target": "tests.tasks:RayDataTask", "args": {"rows": 96, "record": str(record)}},
        "trainer": {"max_steps": steps, "global_batch_size": 16, "micro_batch_size": 4},
        "scaling": {"num_workers": workers},
        "checkpoint": {"every_n_steps": 3},
        "failure": {"max_failures": 0},
        "run": {"name": name, "storage": str(tmp_path)},
    }


def rows(record, rank):
    path = Path(f"{record}.{rank}")
    return [[int(i) for i in line.split()] for line in path.read_text().splitlines()]


def test_each_rank_streams_its_split_pass_after_pass_and_resumes_by_row_count(ray_local, tmp_path):
    record = tmp_path / "ids"
    # 96 rows, 8 per rank per step: a pass is 6 steps; 9 steps end half-way through the second.
    result = raytrainer.train(config(tmp_path, "rd", 9, record), progress=False)
    assert result.metrics["step"] == 9
    seen = {rank: rows(record, rank) for rank in (0, 1)}
    assert all(len(b) == 4 for r in seen.values() for b in r) and all(len(r) == 18 for r in seen.values())
    first = [i for r in seen.values() for b in r[:12] for i in b]  # the first pass: 6 steps x 2 micro-batches
    assert sorted(first) == list(range(96))  # every row once, over both ranks
    second = [i for r in seen.values() for b in r[12:] for i in b]
    assert len(set(second)) == len(second) == 48

    # Resumed from its step-6 checkpoint at one pass: 3 more steps, and a pass's rows again.
    record2 = tmp_path / "ids2"
    cfg = config(tmp_path, "rd", 12, record2)
    cfg["run"]["resume"] = str(tmp_path / "rd" / "checkpoints" / "step-00000009")
    cfg["run"]["name"] = "rd-resumed"
    result = raytrainer.train(cfg, progress=False)
    assert result.metrics["step"] == 12
    after = [i for rank in (0, 1) for b in rows(record2, rank) for i in b]
    # Steps 10-12 finish the second pass: 48 rows, none twice (which ones is Ray Data's choice).
    assert len(after) == len(set(after)) == 48
    assert_no_leaks()


def test_a_global_batch_that_does_not_split_evenly_is_a_config_error(ray_local, tmp_path):
    cfg = config(tmp_path, "uneven", 2, tmp_path / "ids", workers=3)
    cfg["trainer"]["global_batch_size"] = 16
    with pytest.raises(ConfigError, match=r"global_batch_size=16 must be a multiple of the world size 3"):
        raytrainer.train(cfg, progress=False)
    assert_no_leaks()


def test_workers_that_leave_ray_data_no_cpu_are_a_config_error_not_a_hang(ray_local, tmp_path):
    cfg = config(tmp_path, "full", 2, tmp_path / "ids")
    cfg["scaling"]["resources_per_worker"] = {"CPU": 2}  # 2 x 2 of the module's 4 CPUs
    with pytest.raises(ConfigError, match=r"hold 4 of the cluster's 4.*resources_per_worker: \{CPU: 0.5\}"):
        raytrainer.train(cfg, progress=False)
    assert_no_leaks()
