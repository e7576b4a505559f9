"""How the ranks divide the training state: a Strategy.

The loop, the worker and the group ask the strategy instead of assuming:
- how to make the model the step calls (wrap), how to accumulate without a gradient
  sync, and how to clip the global gradient norm;
- the model and optimizer state for recovery and checkpoints, and the full weights at
  the end;
- whether the state is `replicated` (every rank holds all of it, so any survivor can
  give it to a replacement) or sharded (a lost rank's shards exist nowhere else).

DDP: replicated, checkpoints are one `state.pt` written by rank 0. FSDP: sharded,
checkpoints are torch.distributed.checkpoint directories written by every rank (the
torch-level pieces are in sharded.py).
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch
from torch.nn.parallel import DistributedDataParallel

from ...config import TrainerConfig
from .. import _internals
from .syncbn import convert_sync_batchnorm
from .carrier import Carrier


class Strategy(Protocol):
    name: str
    replicated: bool
    """Every rank holds the whole state (a survivor's state is everybody's)."""
    carrier: Carrier | None
    """Set by wrap where the step's gradient reduction also carries the step's metrics
    (carrier.Carrier); None: the metrics window reduces them with a collective of its own."""

    def prepare(self, module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """The module to build the optimizer over: converted, on its device, sharded."""

    def wrap(self, module: torch.nn.Module, world_size: int, device: torch.device,
             synced: bool = False) -> torch.nn.Module:
        """The model the step calls, once the state is loaded. `synced`: every rank of the
        group holds the same state already (each loaded the same one, or trained it in
        step with the others); a group-wide fact, never one rank's."""

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """A micro-batch's backward that only accumulates: no gradient communication."""

    def clip_grad_norm(self, module: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm over all ranks' gradients; return the norm before."""

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        """fp16's loss scaler; every rank must skip the same steps."""

    def model_state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """The model's and the optimizer's state dicts (this rank's shards, if sharded)."""

    def load_model_state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         model: dict, optim: dict) -> None: ...

    def full_weights(self, module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on CPU, on rank 0 (None elsewhere). A collective for
        a sharded strategy: every rank calls it."""

    def build_ema(self, module: torch.nn.Module, decay: float) -> Any:
        """The exponential moving average of the weights (see state.TrainState)."""

    def read_checkpoint(self, uri: str, template: dict[str, Any]) -> dict[str, Any]:
        """Sharded strategies only: the state saved in the checkpoint directory `uri`,
        read into `template` (this rank's state, for its structure and shards). A
        replicated state reaches the workers as the bytes of its state.pt, read once by
        the driver."""


class DDP:
    """DistributedDataParallel: every rank holds the whole model and optimizer."""

    name = "ddp"
    replicated = True

    def __init__(self, cfg: TrainerConfig, most_workers: int):
        self.cfg = cfg
        self.carrier: Carrier | None = None
        # Decided once for the whole run: every rank must run the same collectives, and
        # an elastic run may grow past one worker later.
        self.sync_batchnorm = cfg.sync_batchnorm and most_workers > 1

    def prepare(self, module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        if self.sync_batchnorm:
            module = convert_sync_batchnorm(module, device)
        return module.to(device)

    def wrap(self, module: torch.nn.Module, world_size: int, device: torch.device,
             synced: bool = False) -> torch.nn.Module:
        self.carrier = None
        if world_size == 1:
            return module
        # Wrapping broadcasts rank 0's weights to every rank (the state must be final),
        # unless every rank has them already: a re-form's or a resume's broadcast moved a
        # third of an Adam state for nothing (seconds at 2 GB).
        ddp = DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None,
                                      init_sync=not synced)
        self.carrier = Carrier(device, ddp.process_group)
        ddp.register_comm_hook(self.carrier, _allreduce_carrying)  # before the reducer is wrapped
        _internals.keep_initial_buckets(ddp)  # bit-identical after a re-form
        return ddp

    def no_sync(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync() if isinstance(model, DistributedDataParallel) else contextlib.nullcontext()

    def clip_grad_norm(self, module: torch.nn.Module, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(device.type)  # gradients are all-reduced: the same inf everywhere

    def model_state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        return module.state_dict(), optimizer.state_dict()

    def load_model_state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         model: dict, optim: dict) -> None:
        module.load_state_dict(model)
        load_optimizer(optimizer, optim)

    def full_weights(self, module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return None
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

    def build_ema(self, module: torch.nn.Module, decay: float) -> Any:
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        # Every rank applies the same averaged gradients, so every rank's EMA is the
        # same without any communication.
        return AveragedModel(module, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)


class FSDP:
    """torch's FSDP2 (fully_shard): parameters, gradients and optimizer state sharded over
    the ranks, gathered unit by unit for the forward and backward (see sharded.py)."""

    name = "fsdp"
    replicated = False
    carrier = None  # no DDP bucket to ride on: the metrics window reduces the metrics

    # The oldest torch FSDP is tested on (`bash .ci/oldest.sh`). FSDP2's public fully_shard
    # came with 2.6, but 2.7 refuses reshard_after_forward=None, and on 2.8 a 2-rank run's
    # validation metrics came out doubled and a checkpoint resharded to 3 ranks resumed to
    # other weights (Gloo, CPU); 2.9 and 2.10 pass test_strategy, test_snapshot, test_sharded.
    NEEDS_TORCH = "2.9"

    def __init__(self, cfg: TrainerConfig, task: Any = None):
        self.cfg, self.options, self.task = cfg, cfg.fsdp, task
        if torch.__version__ < self.NEEDS_TORCH:
            from ...errors import ConfigError

            raise ConfigError(
                f"trainer.strategy=fsdp needs torch >= {self.NEEDS_TORCH} (FSDP2, torch.distributed.fsdp."
                f"fully_shard); the workers have torch {torch.__version__}: upgrade torch there, or use "
                "trainer.strategy=ddp")

    def prepare(self, module: torch.nn.Module, device: torch.device, mesh: Any = None) -> torch.nn.Module:
        """`mesh`: the group's, where it is made already (your own loop's: ctx.state's
        DTensors are on it); else one over the default group (a collective)."""
        from torch.distributed.fsdp import FSDPModule

        from ...errors import TaskError
        from .sharded import default_mesh, shard_model

        module = module.to(device)
        mesh = mesh if mesh is not None else default_mesh(device.type)
        hook = getattr(self.task, "shard", None)
        if hook is None:
            dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, None: None}
            try:
                return shard_model(module, mesh, shard_classes=self.options.shard,
                                   reshard_after_forward=self.options.reshard_after_forward,
                                   param_dtype=dtypes[self.options.param_dtype],
                                   reduce_dtype=dtypes[self.options.reduce_dtype])
            except ValueError as exc:  # a class name the model does not have
                from ...errors import ConfigError

                raise ConfigError(f"trainer.fsdp.shard: {exc}") from None
        module = hook(module, mesh) or module
        if not isinstance(module, FSDPModule):
            raise TaskError(f"{type(self.task).__name__}.shard(model, mesh) must apply fully_shard to the "
                            "model itself (its root), after its units, and return it or None")
        return module

    def wrap(self, module: torch.nn.Module, world_size: int, device: torch.device,
             synced: bool = False) -> torch.nn.Module:
        return module  # fully_shard changed the module in place

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module):
        model.set_requires_gradient_sync(False)  # keep unsharded gradients; no reduce-scatter
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def clip_grad_norm(self, module: torch.nn.Module, max_norm: float) -> torch.Tensor:
        from .sharded import clip_grad_norm

        return clip_grad_norm(module.parameters(), max_norm)

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        # DTensor all-reduces the inf check of sharded gradients: every rank skips alike.
        return torch.amp.GradScaler(device.type)

    def model_state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        from .sharded import get_train_state

        state = get_train_state(module, optimizer)
        return state["model"], state["optimizer"]

    def load_model_state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         model: dict, optim: dict) -> None:
        from .sharded import set_train_state

        set_train_state(module, optimizer, {"model": model, "optimizer": optim})

    def full_weights(self, module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        from .sharded import full_model_state

        return full_model_state(module)

    def build_ema(self, module: torch.nn.Module, decay: float) -> Any:
        from .sharded import ShardedEMA

        return ShardedEMA(module, decay)  # AveragedModel's deepcopy of a sharded module fails

    def read_checkpoint(self, uri: str, template: dict[str, Any]) -> dict[str, Any]:
        from .sharded import checkpoint_location, load_sharded

        return load_sharded(template, *checkpoint_location(uri))  # resharded to this world size


def load_optimizer(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """optimizer.load_state_dict(saved), each of its per-parameter tensors copied into the
    one the optimizer holds already where that has its shape and dtype (memory in use:
    a copy there costs a seventh of one into fresh memory, which is mostly page faults),
    else adopted, or cloned where it is a read-only view of a state handed over
    (transfer.unpack): the optimizer steps its state in place."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in saved["param_groups"] for i in group["params"]]
    held = {i: optimizer.state.get(p, {}) for i, p in zip(ids, params)}
    state = {i: {key: _into(held.get(i, {}).get(key), value) for key, value in entry.items()}
             for i, entry in saved["state"].items()}
    optimizer.load_state_dict({**saved, "state": state})


def _into(mine: Any, value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(mine, torch.Tensor) and mine.shape == value.shape and mine.dtype == value.dtype:
        with torch.no_grad():
            return mine.copy_(value)
    from .transfer import is_view

    return value.clone() if is_view(value) else value


# Unannotated: DDP rejects a hook whose annotations are not its own types (strings here).
def _allreduce_carrying(carrier, bucket):
    """DDP's gradient all-reduce, with the step's metrics (carrier.outgoing) appended to
    its last bucket: no collective of their own.

    The gradients are scaled as without a hook: the reducer, hookless, multiplies each
    gradient by 1 / world size as it copies it into the bucket (not a division: x / 3 and
    x * (1/3) differ in the last bit), then sums the bucket over ranks; so does this hook.

    At 3 or more ranks the sums may still differ from hookless DDP's in the last bits,
    because the appended values lengthen the buffer. Gloo's ring all-reduce cuts n
    elements into 2P segments of ceil(n / 2P), two per rank (chunk c, for rank c), and
    sums chunk c around the ring from rank c-1 back: x[c] + (x[c+1] + (... + x[c-1])).
    A longer buffer moves the chunk boundaries, so a few gradients near them change chunk
    and are summed in another order, which with 3 or more terms can round differently
    (float addition commutes but does not associate: 2 ranks, a + b, stay bit-identical).
    A Python model of that order reproduces Gloo's sums bit for bit (torch 2.13); e.g. a
    4099-element bucket with 7 values appended, 3 ranks: 3 gradients off, by at most 4
    ulps. The same holds for the carried metrics against an all-reduce of their own
    (tests/test_window.py), and NCCL too picks its algorithm and chunks by message size.

    Accepted: the layout depends only on the model, the world size and the number of
    metrics, so every run of a config at a world size sums alike, and a run with kills
    ends bit-identical to an undisturbed one (the promise); against hookless DDP it is
    another rounding of the same sum, like the one DDP's own re-bucketing would bring
    (see _internals.keep_initial_buckets). Making it vanish would take padding that keeps Gloo's boundaries,
    which no padding can once the appended values exceed the last segment's slack."""
    buffer = bucket.buffer()
    buffer.mul_(carrier.scale)
    extra = carrier.outgoing
    if not bucket.is_last() or extra is None:
        return carrier.all_reduce(buffer).then(lambda fut: fut.value()[0])
    carrier.stamp()  # every gradient is computed: this rank's compute time ends here
    if buffer.dtype != extra.dtype:  # half-precision gradients: the metrics keep float32, apart
        grads = carrier.all_reduce(buffer)
        metrics = carrier.all_reduce(extra)

        def both(fut: torch.futures.Future) -> torch.Tensor:
            reduced_grads, reduced_metrics = fut.value()
            carrier.reduced = reduced_metrics.value()[0]
            return reduced_grads.value()[0]

        return torch.futures.collect_all([grads, metrics]).then(both)
    size = buffer.numel()
    joined = torch.cat([buffer, extra])
    if joined.device.type == "cpu":
        # The last bucket's hook runs once every gradient is computed (DDP launches buckets
        # in order), so its all-reduce has nothing left to overlap, and the reducer waits for
        # it next. Waited for here, no callback runs on Gloo's thread (taking the GIL there
        # and handing a Python object back): a few percent of a small model's CPU step.
        carrier.group.allreduce([joined]).wait()
        carrier.reduced = joined[size:]
        done = torch.futures.Future()
        done.set_result(joined[:size])
        return done

    def split(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()[0]
        carrier.reduced = reduced[size:]
        return reduced[:size]

    return carrier.all_reduce(joined).then(split)


def build_strategy(cfg: TrainerConfig, most_workers: int, task: Any = None) -> Strategy:
    """`most_workers`: the largest world size the run may reach; `task`: for its shard hook."""
    return FSDP(cfg, task) if cfg.strategy == "fsdp" else DDP(cfg, most_workers)
