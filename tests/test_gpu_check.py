"""The GPU check's pure parts, on CPU (raytrainer/bench/gpu.py; .ci/gpu.sh runs it on a GPU):
the table and its JSON, the FLOP and MFU arithmetic, the GPT and the plain loop at a tiny
size, and the dry run where there is no CUDA."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from raytrainer.bench import gpu

from .conftest import ROOT


def test_gpt_parameter_count_and_flops_match_the_model():
    assert gpu.gpt_params(gpu.TINY) == sum(p.numel() for p in gpu.GPT(gpu.TINY).parameters())
    with torch.device("meta"):
        small = gpu.GPT(gpu.GPT2_SMALL)
    n = sum(p.numel() for p in small.parameters())
    assert n == gpu.gpt_params(gpu.GPT2_SMALL) and 124e6 < n < 125e6  # GPT-2 small, vocab 50304
    # 6 per parameter but the positions', plus the attention's 12 * L * d * T: ~0.85 GFLOP/token.
    assert small.flops_per_token() == 6 * (n - 1024 * 768) + 12 * 12 * 768 * 1024
    task = gpu.GPTTask(size={"n_layer": 2, "n_head": 2, "n_embd": 32, "seq_len": 16, "vocab": 64})
    assert task.flops_per_sample == gpu.GPT(gpu.TINY).flops_per_token() * 16 and task.tokens_per_sample == 16


def test_mfu_is_achieved_flops_over_the_cards_peak():
    assert gpu.mfu(tokens_per_s=100_000, flops_per_token=1e9, peak_flops=1e15) == pytest.approx(0.1)
    assert gpu.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu.peak_flops("NVIDIA H200") == 989e12
    assert gpu.peak_flops("Some Future Card") is None


def test_the_plain_loop_trains_the_tiny_gpt_on_cpu():
    out = gpu.plain_loop(gpu.TINY, steps=3, warmup=1, device="cpu", bf16=False)
    assert out["tokens_per_s"] > 0 and torch.isfinite(torch.tensor(out["loss"]))
    assert out["flops_per_token"] == gpu.GPT(gpu.TINY).flops_per_token()


def test_a_failing_check_is_its_own_line_and_a_spent_budget_skips_the_rest(monkeypatch):
    def fine(tmp):
        assert os.path.isdir(tmp)
        return gpu.Check("x", True, "loss 1.0 -> 0.1")

    def broken(tmp):
        raise RuntimeError("NCCL error: unhandled cuda error")

    monkeypatch.setattr(gpu, "CHECKS", [("a", fine), ("b", broken), ("c", fine)])
    lines = []
    checks = gpu.run_checks(None, budget_s=3600, echo=lines.append)
    assert [(c.name, c.passed) for c in checks] == [("a", True), ("b", False), ("c", True)]
    assert lines[1].startswith("FAIL  b") and "RuntimeError: NCCL error" in lines[1]
    assert "traceback" in checks[1].data
    assert gpu.table(checks).splitlines()[-1] == "2 passed, 1 failed, 0 skipped"
    data = gpu.report(checks, {"name": "cpu"})
    assert data["ok"] is False and [c["passed"] for c in data["checks"]] == [True, False, True]
    skipped = gpu.run_checks(["a", "c"], budget_s=-1, echo=lines.append)
    assert [(c.name, c.passed) for c in skipped] == [("a", None), ("c", None)]
    assert gpu.report(skipped, {})["ok"] is True and lines[-1].startswith("SKIP  c")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is for machines without CUDA")
def test_without_cuda_nothing_is_run_and_the_json_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu.main([]) == 0
    assert "nothing was run" in capsys.readouterr().out
    data = json.loads((tmp_path / "gpu-checks.json").read_text())
    assert data["ran"] is False and data["checks"] == [] and data["device"]["cuda_available"] is False
    with pytest.raises(SystemExit):
        gpu.main(["no-such-check"])


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine runs the real check")
def test_the_script_exits_0_where_there_is_no_gpu():
    out = subprocess.run(["bash", os.path.join(ROOT, ".ci/gpu.sh")], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHON=sys.executable))
    assert out.returncode == 0 and "nothing was run" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the check itself runs the script")
def test_the_two_rank_nccl_script_gets_its_ranks_started(tmp_path):
    # Its first version ran with `python -c`: mp.spawn's children could not find `run` in that
    # __main__, and the check reported an AttributeError as NCCL's answer (seen on an H100).
    # Without CUDA both ranks start and fail at CUDA, which is as far as this machine goes.
    out = gpu.run_two_nccl(str(tmp_path), 29517, timeout_s=120)
    assert out.returncode != 0 and "Can't get attribute" not in out.stderr, out.stderr[-2000:]
    assert "CUDA" in out.stderr or "cuda" in out.stderr, out.stderr[-2000:]
    # The error file mp.spawn writes for each rank that raised is in the check's folder
    # (removed with it), not left in /tmp. One or two: a rank may be stopped by mp.spawn,
    # once the other failed, before it fails itself.
    assert list(tmp_path.glob("pytorch-errorfile-*.pickle"))
