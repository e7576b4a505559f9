"""A Task's training state built ahead, by a worker that will join a running group.

A warm spare, a lost worker's replacement and a newcomer of a grow all take a survivor's
state as they join. Before, each built the task's model and optimizer in its setup, inside
the pause of the recovery or the grow, only to overwrite them with that state: seconds
for a model of 2 GB of training state (the model's initialisation, its memory's page
faults). Such a worker builds them as it starts instead (a spare on its
background thread, while the group trains), gives a torch optimizer its state's memory,
and its setup adopts them where it loads a state: the state is copied into memory in use.
A warm worker holds a training state's worth of memory meanwhile.

The build is the one setup would do (state.TrainState.build seeds it from trainer.seed):
what is loaded over it makes it the survivor's state, so adopting it changes nothing but
the time. A setup that loads no state (a fresh start) builds anew, as does one for a GPU
(not built ahead: the device is decided at setup), for sharded state (sharded over the
group) and for your own loop (task.loop builds its own). A build that fails here (a task
that needs the process group to build) is left to setup, where its error is reported.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...config import Config
    from ..state.state import Prebuilt

log = logging.getLogger(__name__)


def prebuild(config: Config) -> Prebuilt | None:
    """The Task's training state on the CPU, or None where it is not built ahead."""
    if config.task.is_loop or config.trainer.strategy != "ddp" or config.scaling.use_gpu is True:
        return None
    import ray
    import torch

    if ray.is_initialized() and ray.get_gpu_ids():
        return None
    from ...task import build_task
    from ..dist import use_worker_cpus
    from ..loop.settings import LoopSettings
    from ..loop.sizing import Sizing
    from ..state.state import Prebuilt, TrainState
    from ..state.strategy import build_strategy

    try:
        use_worker_cpus(config.scaling.resources_per_worker)  # as setup does
        task = build_task(config.task, config.task.payload)
        most = Sizing.of(LoopSettings.of(config), config.scaling.num_workers).most_world_size
        strategy = build_strategy(config.trainer, most, task)
        train = TrainState.build(task, config.trainer, strategy, torch.device("cpu"))
        _hold_optimizer_state(train.optimizer)
        # Not state_dict(): a task's state-dict hooks are for states taken, not counted.
        tensors = [*train.module.parameters(), *train.module.buffers()]
        tensors += [t for state in train.optimizer.state.values() for t in state.values() if hasattr(t, "nbytes")]
        return Prebuilt(task, train, most, sum(t.nbytes for t in tensors))
    except Exception:  # setup builds it again, and reports what fails there
        log.debug("the training state could not be built ahead", exc_info=True)
        return None


def touch_object_store(prebuilt: Prebuilt) -> None:
    """Put, and free at once, an object of the training state's size in this node's object
    store: its memory is then in use, and the state handed over through it later (a put
    by a survivor here, or a fetch from another node) is copied into it instead of into
    fresh memory (several times slower than into memory in use). Not where it
    would take more than a third of the store (it could spill to disk)."""
    import numpy as np
    import ray

    nbytes = prebuilt.nbytes  # counted as it was built: a setup may be loading it by now
    if not ray.is_initialized() or nbytes < (64 << 20):
        return
    node = ray.get_runtime_context().get_node_id()
    store = next((n["Resources"].get("object_store_memory", 0) for n in ray.nodes() if n["NodeID"] == node), 0)
    if nbytes <= store / 3:
        try:
            ray.put(np.zeros(nbytes, np.uint8))  # its reference dropped: freed; zero pages read, none of ours
        except Exception:  # a full store, a node going: only a warm-up
            log.debug("the object store could not be warmed up", exc_info=True)


def _hold_optimizer_state(optimizer: Any) -> None:
    """Give a torch optimizer its per-parameter state (one step over zero gradients), so
    that the state loaded at setup is copied into memory in use (strategy.load_optimizer:
    a seventh of the time of fresh memory's page faults) instead of fresh memory. What the
    step changes is overwritten by that load; a prebuilt state is never used without one.
    Other optimizers (their step may need a closure, or a process group) are left as built."""
    import torch

    if not type(optimizer).__module__.startswith("torch.optim"):
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    finally:
        optimizer.zero_grad(set_to_none=True)


def adopt(prebuilt: Prebuilt | None, resume: Any, device: Any) -> Prebuilt | None:
    """`prebuilt` where the setup about to run can take it: a replicated state to load (a
    survivor's, packed, or a checkpoint's bytes), on the CPU; else None."""
    from ..state.transfer import Packed

    replicated = isinstance(resume, (Packed, bytes, dict))
    return prebuilt if replicated and getattr(device, "type", None) == "cpu" else None


def compile_ahead(prebuilt: Prebuilt | None, config: Config) -> None:
    """trainer.compile: run the task's training step once, forward and backward, on the
    prebuilt module compiled as the loop compiles it, so that this process holds dynamo's
    compiled code for the module's forward before it joins: the loop's compile over its
    DDP finds it (compiling.py), and the first step in the group traces nothing. The
    kernels come from the run's inductor cache where a peer on this node built them.

    The batch is the run's first micro-batch at scaling.num_workers workers (a group of
    another size, or another shape later, compiles in its step, as a new process would).
    What the step changes is dropped (the gradients) or overwritten by the state loaded at
    setup (the buffers); the task's train_step runs once more than the steps it trains."""
    if prebuilt is None or config.trainer.compile is None:
        return
    import torch

    from ..loop.compiling import compiled
    from ..input.input import collate_of
    from ..loop.settings import LoopSettings
    from ..loop.outputs import StepOutputs
    from ..loop.sizing import Sizing

    task, module = prebuilt.task, prebuilt.train.module
    try:
        settings, workers = LoopSettings.of(config), config.scaling.num_workers
        data = task.train_dataset()
        size = Sizing.of(settings, workers).plan(data, workers).micro_batch_sizes(0)[0]
        batch = collate_of(task, settings.data.collate_fn)([data[i] for i in range(size)])
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.trainer.precision)
        module.train()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            out = task.train_step(compiled(module, config.trainer.compile), batch)
        StepOutputs(task, torch.device("cpu")).loss(out).backward()
    except Exception:  # a stream, a step that needs the group: compiled in the first step instead
        log.debug("the model could not be compiled ahead", exc_info=True)
    finally:
        prebuilt.train.optimizer.zero_grad(set_to_none=True)
        module.zero_grad(set_to_none=True)
