"""Model bytes never pass through the driver: it finds checkpoints by their manifests and
hands references on, while the workers read and verify checkpoints, give their state to
each other through the object store, and write model.pt. Checked by what the driver
fetches and puts (a count that load does not move); the driver's peak RSS with a 2 GB
state is the bench's (python -m raytrainer.bench.driver_memory)."""

import pickle

import ray
import torch

import raytrainer

from .conftest import assert_no_leaks
from .faults import Run, kill

HIDDEN = 500_000  # 3M parameters: 12 MB of weights, 24 MB of training state with momentum
LIMIT = 1 << 20  # the largest thing the driver may fetch: metric rows, statuses, events


def config(tmp_path, max_steps, sleep_s=0.0):
    return {
        "task": {"target": "tests.tasks:RegressionTask",
                 "args": {"hidden": HIDDEN, "sleep_s": sleep_s, "steps_to": str(tmp_path / "at-")}},
        "trainer": {"max_steps": max_steps, "global_batch_size": 32},
        "scaling": {"num_workers": 2},
        "checkpoint": {"every_n_steps": 4},
        "failure": {"max_failures": 1},
        "run": {"name": "big", "storage": str(tmp_path)},
    }


def _size(obj) -> int:
    try:
        return len(pickle.dumps(obj))
    except Exception:  # noqa: BLE001 - not picklable: not model bytes either
        return 0


def test_the_driver_fetches_no_model_bytes_through_a_checkpoint_a_recovery_a_resume_and_the_end(
        ray_local, tmp_path, monkeypatch):
    fetched = []
    get = ray.get

    def recording_get(refs, *args, **kwargs):
        value = get(refs, *args, **kwargs)
        fetched.append(_size(value))
        return value

    def refusing_put(value, *args, **kwargs):
        raise AssertionError(f"the driver put {_size(value)} bytes in the object store")

    monkeypatch.setattr(ray, "get", recording_get)
    monkeypatch.setattr(ray, "put", refusing_put)

    run = Run(config(tmp_path, 12, sleep_s=0.1))
    run.wait_for_worker_step(tmp_path / "at-", 5)  # past the checkpoint of step 4, 7 steps of 0.1 s before the end
    kill(run.pids()[1])
    first = run.result()
    recovered = [e for e in first.events if e["event"] == "recovered"]
    assert len(recovered) == 1 and recovered[0]["state_from"] == "memory"  # a survivor's state, moved
    resumed = raytrainer.train(config(tmp_path, 14), progress=False)  # run.resume=auto: step 12's checkpoint
    assert [e["step"] for e in resumed.events if e["event"] == "resumed"] == [12]

    model = torch.load(tmp_path / "big" / "model.pt", weights_only=True)
    state_bytes = 2 * sum(t.numel() * t.element_size() for t in model.values())  # weights and momentum
    assert state_bytes > 20 * LIMIT
    assert fetched and max(fetched) < LIMIT, f"the driver fetched {max(fetched)} bytes at once"
    assert not list((tmp_path / "big").glob("*.tmp"))
    assert_no_leaks()
