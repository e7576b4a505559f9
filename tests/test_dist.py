"""A worker's start, without Ray: what a new worker does before it is needed, so that a
recovery or a grow does not wait for it."""

import subprocess
import sys


def test_a_new_worker_has_imported_torch_dynamo_before_it_is_asked_to_join(tmp_path):
    # A fresh interpreter: this one may have imported torch._dynamo already.
    config = {"task": {"target": "tests.tasks:RegressionTask"}, "trainer": {"max_steps": 1},
              "scaling": {"num_workers": 1}, "run": {"name": "r", "storage": str(tmp_path)}}
    code = ("import sys; from raytrainer.worker import Worker; "
            "before = 'torch._dynamo' in sys.modules; "
            f"Worker({config!r}); "
            "print(before, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]

