"""raytrainer.worker.state.sharded on 1 to 3 local Gloo processes (no Ray).

Every comparison between a sharded run and a one-process run uses the same initial
weights (same seed), the same global batches (each rank takes its contiguous slice,
the ranks' mean losses averaged = the global mean) and AdamW. They differ only in the
order of float32 sums: a rank averages its slice, the reduce-scatter averages the
ranks' gradients, where the one process sums the whole batch at once. That is a few ulp
per gradient (about 1e-7 relative) that Adam's normalised update carries into the
weights: after 4 steps the largest difference measured is 4e-7 on weights of about 0.1
to 0.5 (a wrong gradient or a lost step shows as 1e-3 or more). So: rtol 1e-5, atol
1e-5, a margin for other CPUs' vector widths. What must be exact (a checkpoint's round
trip) is compared with torch.equal.
"""

from __future__ import annotations

import io
import os
import pickle
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist_procs import run_ranks
from tests.test_checkpoint import s3_server  # noqa: F401 (a fixture)

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 (2 ranks x 2 micro-batches)
RTOL, ATOL = 1e-5, 1e-5
STEPS = 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


def local_batch(step: int, rank: int, world_size: int):
    x, y = global_batch(step)
    n = GLOBAL_BATCH // world_size
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def sharded_step(model, optimizer, x, y, *, micro: int = 1, clip: float | None = None):
    from raytrainer.worker.state.sharded import clip_grad_norm, set_gradient_sync

    for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
        set_gradient_sync(model, i == micro - 1)  # reduce-scatter on the last only
        (F.mse_loss(model(xm), ym) / micro).backward()
    norm = clip_grad_norm(model.parameters(), clip) if clip is not None else None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def plain_step(model, optimizer, x, y, *, clip: float | None = None):
    F.mse_loss(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip) if clip is not None else None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def assert_close_dicts(a: dict, b: dict, exact: bool = False):
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL, msg=k)


# ---------------------------------------------------------------------------- training


def _train(rank, world_size, tmp):
    """4 steps of 2 micro-batches, clipped, with an EMA, on FSDP; rank 0 also trains the
    plain model on the whole global batch, and returns both sides."""
    import torch.distributed as dist
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from raytrainer.worker.state.sharded import ShardedEMA, full_model_state, local_param_bytes, shard_model

    reduce_scatters = 0
    # What FSDP2 calls, looked up at call time: reduce_scatter_single on torch 2.13,
    # reduce_scatter_tensor on older torch (2.10).
    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    original = getattr(dist, name)

    def counting(*args, **kwargs):
        nonlocal reduce_scatters
        reduce_scatters += 1
        return original(*args, **kwargs)

    setattr(dist, name, counting)

    model = shard_model(make_model(), reshard_after_forward=True)
    optimizer = make_optimizer(model)
    ema = ShardedEMA(model, 0.9)
    norms = []
    started = time.perf_counter()
    for step in range(STEPS):
        norms.append(float(sharded_step(model, optimizer, *local_batch(step, rank, world_size), micro=2, clip=0.5)))
        ema.update(model)
    seconds = time.perf_counter() - started
    full = full_model_state(model)
    ema_full = ema.full_state()
    with ema.swapped_in(model):  # validation with the averaged weights
        swapped = full_model_state(model)
    unswapped = full_model_state(model)
    out = {"norms": norms, "reduce_scatters": reduce_scatters, "local_bytes": local_param_bytes(model),
           "seconds": seconds, "types": sorted({type(p).__name__ for p in model.parameters()})}
    if rank == 0:
        path = os.path.join(tmp, "full.pt")
        torch.save(full, path)
        out["full"] = torch.load(path, weights_only=True)
        out["ema_full"] = ema_full
        out["swapped"], out["unswapped"] = swapped, unswapped
        # The reference: one process, the whole global batch, torch's own clip and EMA.
        ref = make_model()
        ref_opt = make_optimizer(ref)
        averaged = AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
        out["ref_norms"] = []
        for step in range(STEPS):
            out["ref_norms"].append(float(plain_step(ref, ref_opt, *global_batch(step), clip=0.5)))
            averaged.update_parameters(ref)
        out["ref"] = {k: v.detach().clone() for k, v in ref.state_dict().items()}
        out["ref_ema"] = {k: v.detach().clone() for k, v in averaged.module.state_dict().items()}
        out["total_bytes"] = sum(p.numel() * p.element_size() for p in ref.parameters())
    out["mixed"] = _mixed(rank, world_size)  # in the same processes: a launch costs seconds
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return run_ranks(_train, 2, str(tmp_path_factory.mktemp("trained")))


def test_fsdp_matches_one_process(trained):
    """2 ranks x 2 micro-batches (no reduce-scatter but on the last), clipped, match the
    plain model trained on the whole batch in one process."""
    rank0 = trained[0]
    assert rank0["types"] == ["DTensor"]
    assert_close_dicts(rank0["full"], rank0["ref"])
    # The full state is gathered from the shards: not just a copy of the initial weights.
    assert not torch.equal(rank0["full"]["0.weight"], make_model().state_dict()["0.weight"])


def test_no_reduce_scatter_between_micro_batches(trained):
    # Three Linear units, each one reduce-scatter per step (the root holds no parameter).
    assert [r["reduce_scatters"] for r in trained] == [3 * STEPS] * 2


def test_clip_grad_norm_over_shards(trained):
    """The global norm of the sharded gradients equals the unsharded model's, on every
    rank, and clipping by it gives the same weights (checked above)."""
    assert trained[0]["norms"] == trained[1]["norms"]
    torch.testing.assert_close(torch.tensor(trained[0]["norms"]), torch.tensor(trained[0]["ref_norms"]),
                               rtol=RTOL, atol=0)
    assert min(trained[0]["ref_norms"]) > 0.5  # every step was clipped


def test_each_rank_holds_half_the_parameters(trained):
    total = trained[0]["total_bytes"]
    assert [r["local_bytes"] for r in trained] == [total // 2] * 2  # every dim 0 is even here


def test_full_model_state_loads_weights_only(trained):
    """full_model_state: plain CPU tensors on rank 0 (torch.load(weights_only=True) read
    them back in _train), with the model's own keys."""
    full = trained[0]["full"]
    assert list(full) == list(make_model().state_dict())
    assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in full.values())


def test_sharded_ema_matches_averaged_model(trained):
    rank0 = trained[0]
    assert_close_dicts(rank0["ema_full"], rank0["ref_ema"])
    assert_close_dicts(rank0["swapped"], rank0["ema_full"], exact=True)
    assert_close_dicts(rank0["unswapped"], rank0["full"], exact=True)


# ---------------------------------------------------------------------------- checkpoints

SAVE_AT, END = 2, 4


def _state(model, optimizer, scheduler, ema, step):
    from raytrainer.worker.state.sharded import get_train_state

    return {**get_train_state(model, optimizer), "ema": ema.state_dict(),
            "scheduler": scheduler.state_dict(),
            "loop": {"step": step, "best": None, "reason": "running", "lr_scale": 0.5, "counts": {3: 1}}}


def _full_optim(model, optimizer):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from torch.utils._pytree import tree_map

    full = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # On one rank torch returns the live state tensors themselves (nothing to gather).
    return tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, full)


def _continue(model, optimizer, scheduler, ema, rank, world_size, start):
    for step in range(start, END):
        sharded_step(model, optimizer, *local_batch(step, rank, world_size))
        scheduler.step()
        ema.update(model)


def _build():
    from raytrainer.worker.state.sharded import ShardedEMA, shard_model

    model = shard_model(make_model())
    optimizer = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return model, optimizer, scheduler, ShardedEMA(model, 0.8)


def _save_run(rank, world_size, root):
    from raytrainer.checkpoint import Storage
    from raytrainer.worker.state.sharded import AsyncShardedSaver, full_model_state, save_sharded

    model, optimizer, scheduler, ema = _build()
    for step in range(SAVE_AT):
        sharded_step(model, optimizer, *local_batch(step, rank, world_size))
        scheduler.step()
        ema.update(model)
    storage = Storage(root)
    saver = AsyncShardedSaver()
    started = time.perf_counter()
    files = save_sharded(_state(model, optimizer, scheduler, ema, SAVE_AT), storage, "ckpt/sync")
    save_s = time.perf_counter() - started
    saved = {"model": full_model_state(model), "optim": _full_optim(model, optimizer),
             "ema": ema.full_state(), "scheduler": scheduler.state_dict()}
    future = saver.save(_state(model, optimizer, scheduler, ema, SAVE_AT), storage, "ckpt/async")
    _continue(model, optimizer, scheduler, ema, rank, world_size, SAVE_AT)  # on the default group
    async_files = future.result(timeout=60)
    saver.close()
    final = {"model": full_model_state(model), "ema": ema.full_state()}
    return {"saved": saved, "final": final, "files": files, "async_files": async_files, "save_s": save_s}


def _load_run(rank, world_size, uri, rel):
    from raytrainer.checkpoint import Storage
    from raytrainer.worker.state.sharded import full_model_state, load_sharded, local_param_bytes, set_train_state

    model, optimizer, scheduler, ema = _build()
    state = _state(model, optimizer, scheduler, ema, step=0)
    state["loop"] = {"step": -1}  # replaced whole by the saved values, whatever it holds
    started = time.perf_counter()
    load_sharded(state, Storage(uri), rel)
    load_s = time.perf_counter() - started
    set_train_state(model, optimizer, state)
    ema.load_state_dict(state["ema"])
    scheduler.load_state_dict(state["scheduler"])
    loaded = {"model": full_model_state(model), "optim": _full_optim(model, optimizer),
              "ema": ema.full_state(), "scheduler": scheduler.state_dict(), "loop": state["loop"]}
    _continue(model, optimizer, scheduler, ema, rank, world_size, state["loop"]["step"])
    return {"loaded": loaded, "final": {"model": full_model_state(model), "ema": ema.full_state()},
            "local_bytes": local_param_bytes(model), "load_s": load_s}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    return root, run_ranks(_save_run, 2, root)


def test_save_writes_one_file_per_rank(saved):
    _, (rank0, rank1) = saved
    assert rank1["files"] is None
    for files in (rank0["files"], rank0["async_files"]):
        assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp", "plain.pt"]


def _check_resumed(saved, loaded_ranks):
    _, (rank0, _) = saved
    loaded = loaded_ranks[0]["loaded"]
    assert_close_dicts(loaded["model"], rank0["saved"]["model"], exact=True)
    assert_close_dicts(loaded["ema"], rank0["saved"]["ema"], exact=True)
    saved_optim, loaded_optim = rank0["saved"]["optim"], loaded["optim"]
    assert saved_optim["param_groups"] == loaded_optim["param_groups"]
    for fqn, per_param in saved_optim["state"].items():
        assert_close_dicts(loaded_optim["state"][fqn], per_param, exact=True)
    assert loaded["scheduler"] == rank0["saved"]["scheduler"]
    assert loaded["loop"] == {"step": SAVE_AT, "best": None, "reason": "running", "lr_scale": 0.5, "counts": {3: 1}}
    # Training on from the checkpoint at another world size = the uninterrupted run.
    assert_close_dicts(loaded_ranks[0]["final"]["model"], rank0["final"]["model"])
    assert_close_dicts(loaded_ranks[0]["final"]["ema"], rank0["final"]["ema"])


def test_load_on_one_rank(saved):
    root, _ = saved
    _check_resumed(saved, run_ranks(_load_run, 1, root, "ckpt/sync"))


def test_load_async_checkpoint_on_three_ranks_from_file_uri(saved):
    """The asynchronous save holds the state at SAVE_AT although training went on while
    it was written; 3 ranks reshard it, each holding about a third of the weights."""
    root, _ = saved
    ranks = run_ranks(_load_run, 3, "file://" + root, "ckpt/async")
    _check_resumed(saved, ranks)
    total = sum(p.numel() * p.element_size() for p in make_model().parameters())
    for r in ranks:  # 32 rows in chunks of 11, 11, 10; 4 rows in 2, 2, 0
        assert abs(r["local_bytes"] - total / 3) < 0.05 * total


def test_load_refuses_an_incomplete_checkpoint(tmp_path):
    from raytrainer.checkpoint import Storage
    from raytrainer.worker.state.sharded import load_sharded

    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="no complete sharded checkpoint"):
        load_sharded({"model": {"w": torch.zeros(1)}}, Storage(str(tmp_path)), "partial")


def test_s3_round_trip_in_one_process(s3_server):
    """DCP through pyarrow's S3 filesystem (moto's server), without a process group: an
    unsharded model and optimizer, plain values, an existing checkpoint overwritten."""
    from raytrainer.checkpoint import Storage
    from raytrainer.worker.state.sharded import get_train_state, load_sharded, save_sharded, set_train_state

    model = make_model()
    optimizer = make_optimizer(model)
    plain_step(model, optimizer, *global_batch(0))
    storage = Storage("s3://bucket/sharded")
    save_sharded({**get_train_state(model, optimizer), "loop": {"step": 0}}, storage, "ckpt", thread_count=2)
    plain_step(model, optimizer, *global_batch(1))
    state = {**get_train_state(model, optimizer), "loop": {"step": 1}}
    files = save_sharded(state, storage, "ckpt", thread_count=2)
    assert sorted(files) == [".metadata", "__0_0.distcp", "__0_1.distcp", "plain.pt"]
    fresh = make_model()
    fresh_optimizer = make_optimizer(fresh)
    loaded = load_sharded({**get_train_state(fresh, fresh_optimizer), "loop": None}, storage, "ckpt")
    set_train_state(fresh, fresh_optimizer, loaded)
    assert loaded["loop"] == {"step": 1}
    assert_close_dicts(fresh.state_dict(), model.state_dict(), exact=True)
    for key, value in optimizer.state_dict()["state"].items():
        assert_close_dicts(fresh_optimizer.state_dict()["state"][key], value, exact=True)


def test_metadata_unpickler_builds_no_code():
    from raytrainer.worker.state.sharded import _MetadataUnpickler

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    with pytest.raises(pickle.UnpicklingError, match="may not name"):
        _MetadataUnpickler(io.BytesIO(pickle.dumps(Evil()))).load()


# ---------------------------------------------------------------------------- precision


def _mixed(rank, world_size):
    from raytrainer.worker.state.sharded import shard_model

    out = {}
    # bf16 compute and bf16 reduce-scatter on Gloo.
    # (and the other options: units by class name, parameters kept after forward)
    model = shard_model(make_model(), shard_classes=["Linear"], reshard_after_forward=False,
                        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    optimizer = make_optimizer(model)
    x, y = local_batch(0, rank, world_size)
    loss = F.mse_loss(model(x).float(), y)
    loss.backward()
    out["bf16_grad_dtype"] = str(next(model.parameters()).grad.dtype)
    out["bf16_loss"] = loss.item()
    optimizer.step()
    # fp16 with torch.amp.GradScaler: an inf in rank 1's shard only skips the step everywhere.
    model = shard_model(make_model(), param_dtype=torch.float16, reduce_dtype=torch.float32)
    optimizer = make_optimizer(model)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(F.mse_loss(model(x).float(), y)).backward()
    if rank == 1:
        next(model.parameters()).grad.to_local()[0, 0] = float("inf")
    before = [p.to_local().clone() for p in model.parameters()]
    scale = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    out["fp16_stepped"] = any(not torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters()))
    out["fp16_scale"] = (scale, scaler.get_scale())
    return out


def test_mixed_precision_on_gloo(trained):
    """bf16 parameters and bf16 reduce-scatter run on Gloo; fp16 with torch.amp.GradScaler
    skips a step on every rank when one rank's shard overflows."""
    ranks = [r["mixed"] for r in trained]
    x, y = global_batch(0)
    ref = F.mse_loss(make_model()(x), y).item()
    mean = sum(r["bf16_loss"] for r in ranks) / 2
    assert abs(mean - ref) < 0.02 * ref  # bf16 forward: about 3 significant digits
    assert {r["bf16_grad_dtype"] for r in ranks} == {"torch.float32"}  # sharded grads stay fp32
    assert [r["fp16_stepped"] for r in ranks] == [False, False]
    assert [r["fp16_scale"] for r in ranks] == [(65536.0, 32768.0)] * 2


# ---------------------------------------------------------------------------- units


def test_units():
    from raytrainer.worker.state.sharded import _units

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.mlp = nn.Linear(4, 4), nn.Linear(4, 4)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.blocks = nn.ModuleList([Block(), Block()])
            self.act = nn.ReLU()
            self.head = nn.Linear(4, 10, bias=False)

    net = Net()
    assert _units(net, None) == [net.embed, *net.blocks, net.head]
    net.head.weight = net.embed.weight  # tied: both stay in the root's group
    assert _units(net, None) == list(net.blocks)
    assert _units(net, ["Block"]) == list(reversed(net.blocks))
    # Nested units: the inner ones first (fully_shard goes bottom-up); the tied head is out.
    assert _units(net, ["Block", "Linear"]) == [net.blocks[1].mlp, net.blocks[1].attn, net.blocks[1],
                                                net.blocks[0].mlp, net.blocks[0].attn, net.blocks[0]]
    # An inner unit left out for a tie leaves its outer unit out too.
    net.blocks[0].mlp.weight = net.embed.weight
    assert net.blocks[0] not in _units(net, ["Block", "Linear"])
    with pytest.raises(ValueError, match="Conv2d"):
        _units(net, ["Conv2d"])
