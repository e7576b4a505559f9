"""The GPU check (`bash .ci/gpu.sh`, or `python -m raytrainer.bench.gpu`): one command that
runs, on one CUDA GPU in about 3.5 minutes (an H100), the paths no CPU run exercises, and prints a
table of pass/fail lines, each with the figure it measured (JSON too: $OUT/gpu-checks.json
where $OUT is set, or --json PATH).

    nccl-1rank        a 1-rank NCCL group forms and trains (loss falls)
    2ranks-1gpu       2 ranks sharing the GPU over Gloo with CUDA tensors train; and what a
                      2-rank NCCL group on one device does (torch/NCCL refuse it: the line says)
    amp-bf16          trainer.precision bf16 on CUDA trains
    amp-fp16          fp16 with its GradScaler on CUDA trains (the scale is reported)
    fsdp2             trainer.strategy fsdp (FSDP2) on CUDA trains and commits a sharded checkpoint
    digits-gpu        configs/digits.yaml with scaling.use_gpu: true reaches its accuracy
    kill-cuda-worker  a CUDA worker SIGKILLed mid-run: recovered from the survivor's memory
    async-pinned      checkpoint.async's copy of a GPT-2-small Adam state into pinned host
                      memory, against a synchronous torch.save: the training thread's stall
    gpt2-throughput   GPT-2-small (124M) in bf16: tokens/s and MFU of a plain torch loop and of
                      raytrainer, side by side on the same GPU
    loops-gpu         the Hugging Face, Lightning and accelerate examples as your own loop on
                      the GPU (those installed)

Without CUDA it prints that nothing was run and exits 0. The pure parts (the table, the JSON,
the FLOP and MFU arithmetic, the GPT model and the plain loop at a tiny size) are tested on
CPU in CI (tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..task import Task

ROOT = Path(__file__).resolve().parents[2]  # the repository: configs/ and examples/ for the digits check

# Dense bf16 tensor-core peaks, FLOP/s (the vendors' datasheets, without sparsity): MFU's
# denominator. H100 is the SXM part (the PCIe card: 756e12); H200 has H100's compute.
PEAK_BF16 = {"H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12,
             "L4": 121e12, "A10": 125e12, "RTX 4090": 165e12}


@dataclass
class Check:
    """One line of the table. `passed` None: not run (skipped, with the reason as figure)."""
    name: str
    passed: bool | None
    figure: str
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)


def line(check: Check) -> str:
    verdict = {True: "PASS", False: "FAIL", None: "SKIP"}[check.passed]
    return f"{verdict}  {check.name:<17} {check.figure}  ({check.seconds:.1f} s)"


def table(checks: list[Check]) -> str:
    passed = sum(c.passed is True for c in checks)
    failed = sum(c.passed is False for c in checks)
    return "\n".join([line(c) for c in checks] + [f"{passed} passed, {failed} failed, "
                                                  f"{len(checks) - passed - failed} skipped"])


def report(checks: list[Check], device: dict[str, Any]) -> dict[str, Any]:
    return {"device": device, "ok": all(c.passed is not False for c in checks),
            "checks": [asdict(c) for c in checks]}


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)
    return path


# --------------------------------------------------------------------------- FLOPs and MFU


def gpt_flops_per_token(n_params: int, n_layer: int, n_embd: int, seq_len: int) -> float:
    """Training FLOPs per token of a GPT (PaLM's appendix B, nanoGPT's estimate_mfu): 6 per
    parameter (forward 2, backward 4) plus the attention's score and value matmuls,
    12 * layers * width * context."""
    return 6.0 * n_params + 12.0 * n_layer * n_embd * seq_len


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    return tokens_per_s * flops_per_token / peak_flops


def peak_flops(device_name: str) -> float | None:
    """The card's dense bf16 peak from its name (torch.cuda.get_device_name), else None."""
    return next((peak for key, peak in PEAK_BF16.items() if key in device_name), None)


# --------------------------------------------------------------------------- a GPT


@dataclass(frozen=True)
class GPTSize:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    seq_len: int = 1024
    vocab: int = 50304  # GPT-2's 50257, rounded up to a multiple of 64 (as nanoGPT does)
    batch: int = 16  # sequences per step


GPT2_SMALL = GPTSize()
TINY = GPTSize(n_layer=2, n_head=2, n_embd=32, seq_len=16, vocab=64, batch=4)


class Block(torch.nn.Module):
    def __init__(self, s: GPTSize):
        super().__init__()
        self.n_head = s.n_head
        self.ln1, self.ln2 = torch.nn.LayerNorm(s.n_embd), torch.nn.LayerNorm(s.n_embd)
        self.qkv = torch.nn.Linear(s.n_embd, 3 * s.n_embd)
        self.proj = torch.nn.Linear(s.n_embd, s.n_embd)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(s.n_embd, 4 * s.n_embd), torch.nn.GELU(approximate="tanh"),
                                       torch.nn.Linear(4 * s.n_embd, s.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (y.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for y in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    """GPT-2's shape (pre-norm blocks, tied embedding and head), SDPA attention."""

    def __init__(self, s: GPTSize = GPT2_SMALL):
        super().__init__()
        self.size = s
        self.wte = torch.nn.Embedding(s.vocab, s.n_embd)
        self.wpe = torch.nn.Embedding(s.seq_len, s.n_embd)
        self.blocks = torch.nn.ModuleList(Block(s) for _ in range(s.n_layer))
        self.ln_f = torch.nn.LayerNorm(s.n_embd)
        self.head = torch.nn.Linear(s.n_embd, s.vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    def flops_per_token(self) -> float:
        s = self.size
        n_params = sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()  # positions: no matmul
        return gpt_flops_per_token(n_params, s.n_layer, s.n_embd, s.seq_len)


def token_data(s: GPTSize, samples: int, seed: int = 0) -> torch.Tensor:
    """Random token sequences (seq_len + 1: inputs and shifted targets); throughput only."""
    return torch.randint(0, s.vocab, (samples, s.seq_len + 1), generator=torch.Generator().manual_seed(seed))


def plain_loop(s: GPTSize, steps: int, warmup: int, device: str, bf16: bool = True) -> dict[str, float]:
    """The floor: a plain torch loop (no DDP, no process group), bf16 autocast, fused AdamW
    on CUDA; tokens/s over the steps after `warmup`."""
    torch.manual_seed(0)
    model = GPT(s).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.startswith("cuda"))
    data = token_data(s, s.batch * 4).to(device)
    cuda = device.startswith("cuda")
    started = 0.0
    losses = []
    for step in range(warmup + steps):
        if step == warmup:
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
        batch = data[(step % 4) * s.batch:(step % 4 + 1) * s.batch]
        with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    tokens_per_s = steps * s.batch * s.seq_len / seconds
    return {"tokens_per_s": tokens_per_s, "flops_per_token": model.flops_per_token(),
            "loss": float(losses[-1]), "first_loss": float(losses[0])}


def gpt_params(s: GPTSize) -> int:
    """GPT's parameter count (the head tied to the embedding)."""
    d = s.n_embd
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return s.vocab * d + s.seq_len * d + s.n_layer * block + 2 * d


class GPTTask(Task):
    """The same model and data as plain_loop, as a raytrainer Task (by import path)."""

    def __init__(self, size: dict[str, int] | None = None, samples: int = 256):
        self.size = GPTSize(**(size or {}))
        self.samples = samples
        self.tokens_per_sample = self.size.seq_len
        s = self.size
        self.flops_per_sample = s.seq_len * gpt_flops_per_token(gpt_params(s) - s.seq_len * s.n_embd, s.n_layer,
                                                                s.n_embd, s.seq_len)

    def build_model(self):
        torch.manual_seed(0)
        return GPT(self.size)

    def build_optimizer(self, model):
        return torch.optim.AdamW(model.parameters(), lr=3e-4, fused=torch.cuda.is_available())

    def train_dataset(self):
        return torch.utils.data.TensorDataset(token_data(self.size, self.samples))

    def train_step(self, model, batch):
        (tokens,) = batch
        return {"loss": model(tokens[:, :-1], tokens[:, 1:])}


class MLPTask(Task):
    """A small regression for the correctness checks (loss falls fast)."""

    def __init__(self, samples: int = 4096, width: int = 256):
        self.samples, self.width = samples, width

    def build_model(self):
        return torch.nn.Sequential(torch.nn.Linear(32, self.width), torch.nn.GELU(), torch.nn.Linear(self.width, 1))

    def build_optimizer(self, model):
        return torch.optim.AdamW(model.parameters(), lr=3e-3)

    def train_dataset(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.samples, 32, generator=g)
        return torch.utils.data.TensorDataset(x, torch.tanh(x @ torch.randn(32, 1, generator=g)))

    def train_step(self, model, batch):
        x, y = batch
        return {"loss": torch.nn.functional.mse_loss(model(x), y)}


# --------------------------------------------------------------------------- the checks


def _train(name: str, storage: str, target: str = "raytrainer.bench.gpu:MLPTask", args: dict | None = None,
           trainer: dict | None = None, scaling: dict | None = None, **sections: Any):
    import raytrainer

    cfg = {"task": {"target": target, "args": args or {}},
           "trainer": {"max_steps": 60, "global_batch_size": 256, **(trainer or {})},
           "scaling": {"num_workers": 1, "use_gpu": True, **(scaling or {})},
           "run": {"name": name, "storage": storage}, "loggers": [], **sections}
    return raytrainer.train(cfg, progress=False)


def _losses(result) -> tuple[float, float]:
    rows = [r for r in result.history if "loss" in r]
    return rows[0]["loss"], rows[-1]["loss"]


def _fell(result, factor: float = 0.7) -> tuple[bool, str]:
    first, last = _losses(result)
    ok = math.isfinite(last) and last < factor * first
    return ok, f"loss {first:.4f} -> {last:.4f}"


def check_nccl_one_rank(tmp: str) -> Check:
    result = _train("nccl1", tmp, scaling={"backend": "nccl"})
    ok, fig = _fell(result)
    return Check("nccl-1rank", ok, f"{fig}, {len(result.history)} steps")


_TWO_NCCL = r'''
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
def run(rank):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", 0))
    t = torch.ones(4, device="cuda") * (rank + 1)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    assert t[0].item() == 3.0, t
    dist.destroy_process_group()
if __name__ == "__main__":  # spawn's children import this file
    mp.spawn(run, nprocs=2)
    print("NCCL 2 ranks on one GPU: all_reduce ok")
'''


def run_two_nccl(tmp: str, port: int, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    """_TWO_NCCL run from a file in `tmp`, its temporary files there too: mp.spawn leaves a
    pytorch-errorfile-*.pickle in the temp dir for each rank that raises, which the refusal
    this check expects on a GPU makes every time."""
    script = Path(tmp) / "two_nccl.py"
    script.write_text(_TWO_NCCL)
    return subprocess.run([sys.executable, str(script), str(port)], capture_output=True, text=True,
                          timeout=timeout_s, env=dict(os.environ, TMPDIR=str(tmp)))


def check_two_ranks_one_gpu(tmp: str) -> Check:
    result = _train("gloo2", tmp, scaling={"num_workers": 2, "backend": "gloo",
                                            "resources_per_worker": {"CPU": 1, "GPU": 0.5}})
    ok, fig = _fell(result)
    ok = ok and all(r["world_size"] == 2 for r in result.history)
    # What NCCL does with two ranks on one device, in plain torch (a subprocess: a refusal
    # may hang or abort the process). A file, not `-c`: mp.spawn's children import `run`
    # from the parent's __main__, which `-c` does not have.
    try:
        out = run_two_nccl(tmp, 29_500 + os.getpid() % 1000)
        text = (out.stdout + out.stderr).strip()
        nccl = "trains (all_reduce ok)" if out.returncode == 0 else \
            "refused: " + next((ln.strip() for ln in text.splitlines() if "Duplicate GPU" in ln or "Error" in ln),
                               text.splitlines()[-1] if text else f"exit {out.returncode}")[:160]
    except subprocess.TimeoutExpired:
        nccl = "hung (no answer in 60 s)"
    return Check("2ranks-1gpu", ok, f"gloo+CUDA tensors: {fig}; NCCL 2 ranks on 1 GPU: {nccl}",
                 data={"nccl_two_ranks": nccl})


def check_amp(precision: str) -> Callable[[str], Check]:
    def check(tmp: str) -> Check:
        result = _train(f"amp-{precision}", tmp, trainer={"precision": precision})
        ok, fig = _fell(result)
        skipped = result.history[-1].get("skipped_steps", 0)
        extra = f", {skipped} steps skipped by the scaler" if precision == "fp16" else ""
        return Check(f"amp-{precision}", ok, fig + extra)
    return check


def check_fsdp2(tmp: str) -> Check:
    result = _train("fsdp2", tmp, target="raytrainer.bench.gpu:GPTTask",
                    args={"size": {"n_layer": 4, "n_head": 4, "n_embd": 256, "seq_len": 256, "vocab": 4096},
                          "samples": 512},
                    trainer={"strategy": "fsdp", "precision": "bf16", "max_steps": 30, "global_batch_size": 16},
                    checkpoint={"every_n_steps": 15})
    ok, fig = _fell(result, factor=0.95)
    committed = [e["step"] for e in result.events if e["event"] == "checkpoint_committed"]
    ok = ok and 15 in committed
    return Check("fsdp2", ok, f"{fig}, checkpoints at {committed}")


def check_digits(tmp: str) -> Check:
    import importlib.util

    import raytrainer
    import yaml

    if importlib.util.find_spec("sklearn") is None:
        return Check("digits-gpu", None, "not run: scikit-learn (the digits) is not installed: "
                     "pip install -e '.[examples]'")
    cfg = yaml.safe_load((ROOT / "configs/digits.yaml").read_text())
    cfg["scaling"] = {**cfg.get("scaling", {}), "use_gpu": True, "num_workers": 1}
    cfg.update(run={"name": "digits", "storage": tmp}, loggers=[])
    result = raytrainer.train(cfg, progress=False)
    acc = max((r["val_accuracy"] for r in result.history if "val_accuracy" in r), default=0.0)
    return Check("digits-gpu", acc > 0.9, f"val_accuracy {acc:.3f}, {len(result.history)} rows")


def check_kill(tmp: str) -> Check:
    """2 CUDA workers sharing the GPU (Gloo), rank 1 SIGKILLed by pid mid-run."""
    import threading

    import raytrainer

    cfg = {"task": {"target": "raytrainer.bench.gpu:MLPTask", "args": {"samples": 65536}},
           "trainer": {"max_steps": 400, "global_batch_size": 256},
           "scaling": {"num_workers": 2, "use_gpu": True, "backend": "gloo",
                       "resources_per_worker": {"CPU": 1, "GPU": 0.5}},
           "run": {"name": "kill", "storage": tmp}, "loggers": []}
    run_dir = Path(tmp) / "kill"
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(r=raytrainer.train(cfg, progress=False)), daemon=True)
    thread.start()

    def read(name: str) -> list[dict]:
        try:
            return [json.loads(x) for x in (run_dir / name).read_text().splitlines() if x.strip()]
        except (OSError, ValueError):
            return []

    deadline = time.monotonic() + 120
    while not any(r.get("step", 0) >= 50 for r in read("metrics.jsonl")):
        if time.monotonic() > deadline or not thread.is_alive():
            return Check("kill-cuda-worker", False, "the run did not reach step 50")
        time.sleep(0.05)
    pids = next(e["pids"] for e in reversed(read("events.jsonl")) if "pids" in e)
    os.kill(pids[1], 9)
    thread.join(180)
    if "r" not in box:
        return Check("kill-cuda-worker", False, "the run did not end within 180 s after the kill")
    recovered = [e for e in box["r"].events if e["event"] == "recovered"]
    steps = [r["step"] for r in box["r"].history]
    ok = len(recovered) == 1 and recovered[0].get("state_from") == "memory" and steps[-1] == 400
    rec = recovered[0] if recovered else {}
    return Check("kill-cuda-worker", ok, f"recovered in {rec.get('seconds', float('nan')):.2f} s from "
                 f"{rec.get('state_from')}, {rec.get('steps_lost')} steps lost", data={"recovered": rec})


def check_async_pinned(tmp: str) -> Check:
    """checkpoint.async's copy (worker.state.writer.SharedState) of a GPT-2-small AdamW state on the
    GPU into host memory, pinned: the stall a save costs the training thread, against a
    synchronous torch.save of the same state."""
    from ..worker.state.writer import SharedState, view

    model = GPT(GPT2_SMALL).cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    model(*(lambda t: (t[:, :-1], t[:, 1:]))(token_data(GPT2_SMALL, 2).cuda())).backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    shared = SharedState()
    t0 = time.perf_counter()
    shared.copy(state)  # the first save: allocates and pins the buffer
    first = time.perf_counter() - t0
    stalls = []
    for _ in range(3):
        t0 = time.perf_counter()
        layout, _ = shared.copy(state)
        stalls.append(time.perf_counter() - t0)
    stall = statistics.median(stalls)
    some = model.state_dict()["wte.weight"]
    same = torch.equal(view(shared.buffer, layout["model"]["wte.weight"]), some.cpu())
    t0 = time.perf_counter()
    torch.save(state, os.path.join(tmp, "sync.pt"))
    sync = time.perf_counter() - t0
    ok = shared.pinned and same
    return Check("async-pinned", ok, f"{nbytes / 1e9:.2f} GB: pinned copy {stall:.3f} s (first {first:.2f} s, "
                 f"{nbytes / stall / 1e9:.1f} GB/s) vs sync torch.save {sync:.2f} s, {sync / stall:.0f}x; "
                 f"pinned={shared.pinned}", data={"bytes": nbytes, "stall_s": stall, "first_s": first, "sync_s": sync})


def _tensors(tree: Any):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


def check_throughput(tmp: str, steps: int = 30, warmup: int = 8) -> Check:
    name = torch.cuda.get_device_name()
    peak = peak_flops(name)
    plain = plain_loop(GPT2_SMALL, steps, warmup, "cuda")
    torch.cuda.empty_cache()
    s = GPT2_SMALL
    result = _train("gpt2", tmp, target="raytrainer.bench.gpu:GPTTask", args={"samples": s.batch * (steps + warmup)},
                    trainer={"precision": "bf16", "max_steps": steps + warmup, "global_batch_size": s.batch,
                             "log_every_n_steps": 1})
    rates = [r["tokens_per_s"] for r in result.history if "tokens_per_s" in r][warmup:]
    ours = statistics.median(rates) if rates else 0.0
    fpt = plain["flops_per_token"]
    mfus = {k: mfu(v, fpt, peak) if peak else None for k, v in (("plain", plain["tokens_per_s"]), ("raytrainer", ours))}
    ratio = ours / plain["tokens_per_s"]

    def pct(x: float | None) -> str:
        return f"{100 * x:.1f}%" if x is not None else "n/a (unknown peak)"

    fig = (f"tokens/s plain {plain['tokens_per_s']:,.0f} (MFU {pct(mfus['plain'])}) | raytrainer {ours:,.0f} "
           f"(MFU {pct(mfus['raytrainer'])}) | ratio {ratio:.2f}; B={s.batch} T={s.seq_len} bf16, no compile")
    # A pass: both trained, and raytrainer keeps at least 80% of the plain loop's rate.
    ok = math.isfinite(plain["loss"]) and bool(rates) and ratio >= 0.8
    return Check("gpt2-throughput", ok, fig, data={"plain": plain, "raytrainer_tokens_per_s": ours, "mfu": mfus,
                                                   "peak_flops": peak, "device": name})


LOOPS = {  # your own loop's framework examples: (the module they need, the config, its overrides)
    "hf": ("transformers", "configs/hf_trainer.yaml", {"max_bytes": 200_000, "save_steps": 10, "eval_steps": 10}),
    "lightning": ("lightning", "configs/lightning_loop.yaml", {}),
    "accelerate": ("accelerate", "configs/accelerate_loop.yaml", {}),
}


def check_loops(tmp: str) -> Check:
    """The Hugging Face, Lightning and accelerate examples as your own loop on the GPU, 20
    steps each (those whose framework is installed)."""
    import importlib.util

    import raytrainer
    import yaml

    ran, missing, bad = [], [], []
    for name, (module, config, args) in LOOPS.items():
        if importlib.util.find_spec(module) is None:
            missing.append(name)
            continue
        cfg = yaml.safe_load((ROOT / config).read_text())
        cfg["task"]["args"].update(args)
        cfg["trainer"]["max_steps"] = 20
        cfg["scaling"] = {"num_workers": 1, "use_gpu": True}
        cfg.update(run={"name": name, "storage": tmp}, loggers=[])
        result = raytrainer.train(cfg, progress=False)
        steps = [r["step"] for r in result.history if "loss" in r]
        (ran if steps and steps[-1] == 20 else bad).append(name)
    if not ran and not bad:
        return Check("loops-gpu", None, f"not run: none of {sorted(LOOPS)} is installed")
    return Check("loops-gpu", not bad, f"20 steps on the GPU: {ran or 'none'}; failed: {bad or 'none'}; "
                 f"not installed: {missing or 'none'}")


CHECKS: list[tuple[str, Callable[[str], Check]]] = [
    ("nccl-1rank", check_nccl_one_rank),
    ("2ranks-1gpu", check_two_ranks_one_gpu),
    ("amp-bf16", check_amp("bf16")),
    ("amp-fp16", check_amp("fp16")),
    ("fsdp2", check_fsdp2),
    ("digits-gpu", check_digits),
    ("kill-cuda-worker", check_kill),
    ("async-pinned", check_async_pinned),
    ("gpt2-throughput", check_throughput),
    ("loops-gpu", check_loops),
]


def run_checks(names: list[str] | None, budget_s: float, echo: Callable[[str], None] = print) -> list[Check]:
    """Each check in order, its line printed as it ends; an exception is that check's FAIL;
    the checks left when the budget is spent are skipped."""
    started = time.monotonic()
    out = []
    for name, fn in CHECKS:
        if names and name not in names:
            continue
        if time.monotonic() - started > budget_s:
            out.append(Check(name, None, f"not run: the {budget_s:.0f} s budget was spent"))
            echo(line(out[-1]))
            continue
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"gpu-{name}-") as tmp:
            try:
                check = fn(tmp)
            except Exception as exc:  # noqa: BLE001 - one check's failure is its line, the others run
                tb = traceback.format_exc().strip().splitlines()
                check = Check(name, False, f"{type(exc).__name__}: {str(exc)[:300]}", data={"traceback": tb[-12:]})
        check.name, check.seconds = name, time.monotonic() - t0
        out.append(check)
        echo(line(check))
    return out


def device_info() -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                            "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(name=p.name, memory_gb=round(p.total_memory / 2**30, 1), count=torch.cuda.device_count(),
                    nccl=".".join(map(str, torch.cuda.nccl.version())), peak_bf16=peak_flops(p.name))
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raytrainer.bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("checks", nargs="*", help=f"a subset, by name: {', '.join(n for n, _ in CHECKS)}")
    parser.add_argument("--json", help="where to write the JSON (default: $OUT/gpu-checks.json where $OUT is set)")
    parser.add_argument("--budget-s", type=float, default=330.0, help="skip the checks left after this long")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.checks) - {n for n, _ in CHECKS})
    if unknown:
        parser.error(f"unknown check(s) {unknown}; choose from {[n for n, _ in CHECKS]}")
    target = args.json or (os.path.join(os.environ["OUT"], "gpu-checks.json") if os.environ.get("OUT") else None)
    device = device_info()
    if not device["cuda_available"]:
        print(f"no CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda}): nothing was run")
        if target:
            write_json(target, {**report([], device), "ran": False})
        return 0
    print(f"GPU check on {device['name']} ({device['memory_gb']} GiB), torch {device['torch']}, "
          f"CUDA {device['cuda']}, NCCL {device['nccl']}")
    checks = run_checks(args.checks or None, args.budget_s)
    print(table(checks))
    if target:
        print(f"JSON: {write_json(target, {**report(checks, device), 'ran': True})}")
    return 0 if all(c.passed is not False for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
