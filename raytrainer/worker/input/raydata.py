"""Ray Data as a training input: the only module of the worker side that imports ray.data.

A task's `train_dataset` may return a `ray.data.Dataset` (a lazy pipeline: read,
`map_batches`, ...). Every rank builds the task, and so the Dataset, itself; rank 0
alone starts it, as `streaming_split(world_size, equal=True)`: Ray Data's split
coordinator (an actor on rank 0's node) runs the pipeline, its read and map tasks on
the cluster's CPUs (any node, outside the training group's placement group), and hands
each split its blocks as they are ready. Rank 0 sends the split iterators (small:
the coordinator's handle and an index) to the other ranks over the process group, and
each rank re-chunks its split's rows into the plan's micro-batches: a dict of column
name to tensor. The loader processes of data.num_workers are not used: Ray Data already
reads and preprocesses ahead on Ray's workers (data.prefetch_factor blocks per rank).

Position and what is exact. A split yields its rows pass after pass (each pass is an
epoch of the Dataset; `equal=True` gives every split as many rows, so all ranks reach
a pass end at the same micro-batch); the position is the rows of the current pass each
rank has trained on, which follows from the steps. A resume, a recovery and a resize
start a new split and each rank skips that many rows of the pass (a resize: the pass's
rows so far over the new world size), so the run keeps its step count, schedule and
pass length. Which rows come after a restart is Ray Data's choice (it gives blocks to
splits as they are ready), so unlike a map-style dataset this is not sample-exact: a row
may be seen twice or not at all in the pass a restart falls in.
"""

from __future__ import annotations

from typing import Any, Iterator

from ...config import DataConfig
from ...data import BatchPlan
from ...errors import ConfigError, TaskError


class RayDataInput:
    def __init__(self, dataset: Any, cfg: DataConfig, *, rank: int, plan: BatchPlan):
        self.dataset, self.cfg = dataset, cfg
        self.rank, self.plan = rank, plan
        self._check(plan)
        # Rows of the current pass each rank had trained on at a step boundary.
        self.at = {"step": 0, "pass_rows": 0, "world_size": plan.world_size}
        self._boundaries: dict[int, int] = {}  # step -> pass rows then, for state_dict
        self._rows: _Rows | None = None
        self._next_step: int | None = None

    @staticmethod
    def _check(plan: BatchPlan) -> None:
        if plan.global_batch_size % plan.world_size:
            raise ConfigError(
                f"a Ray Data training dataset is split equally over the ranks, so every rank must "
                f"train on as many rows per step: trainer.global_batch_size={plan.global_batch_size} "
                f"must be a multiple of the world size {plan.world_size} (scaling.num_workers, and every "
                "size an elastic run may take)"
            )

    def batches(self, epoch: int, position: int, step: int) -> Iterator[Any]:
        if self._next_step != step:
            self._restart(step)
        sizes = self.plan.micro_batch_sizes(self.rank)
        for i, size in enumerate(sizes):
            batch = self._rows.take(size)
            if i + 1 == len(sizes):
                self._next_step = step + 1
                self._boundaries = {s: r for s, r in self._boundaries.items() if s >= step - 1}
                self._boundaries[step + 1] = self._rows.in_pass
            else:
                self._next_step = None
            yield batch

    def _restart(self, step: int) -> None:
        import torch.distributed as dist

        self.close()
        skip = self._pass_rows(step)
        its = None
        if self.rank == 0:
            _check_room(self.plan.world_size)
            its = self.dataset.streaming_split(self.plan.world_size, equal=True)
        if self.plan.world_size > 1 and dist.is_initialized():
            from ray import cloudpickle  # the iterators hold an actor handle: Ray's pickler

            box = [cloudpickle.dumps(its) if self.rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            its = cloudpickle.loads(box[0])
        self._splits = its  # rank 0's handles keep the coordinator alive
        self._rows = _Rows(its[self.rank], self.cfg.prefetch_factor, self.rank)
        self._rows.skip(skip)
        self._boundaries = {step: skip}
        self._next_step = step

    def _pass_rows(self, step: int) -> int:
        """Rows of the current pass each rank had trained on after `step` steps, at the
        current world size."""
        if step in self._boundaries:
            return self._boundaries[step]
        at = self.at
        return at["pass_rows"] * at["world_size"] // self.plan.world_size

    def regroup(self, plan: BatchPlan, rank: int, step: int) -> None:
        self._check(plan)
        self.at = {"step": step, "pass_rows": self._pass_rows(step), "world_size": self.plan.world_size}
        self._boundaries = {}
        self.plan, self.rank = plan, rank
        self.close()

    def reset(self) -> None:
        self.close()

    def state_dict(self, step: int) -> dict[str, Any]:
        return {"kind": "ray_data", "pass_rows": self._pass_rows(step), "world_size": self.plan.world_size}

    def load_state_dict(self, state: dict[str, Any] | None, step: int) -> None:
        if state is None or state.get("kind") != "ray_data":
            raise ConfigError("the checkpoint was not trained on a Ray Data dataset and this task's is one; "
                              "resume with the task the checkpoint was trained with")
        self.at = {"step": step, "pass_rows": state["pass_rows"], "world_size": state["world_size"]}
        self._boundaries = {}
        self.close()

    def close(self) -> None:
        self._rows, self._next_step, self._splits = None, None, None


def _check_room(world_size: int) -> None:
    """Ray Data's read and map tasks need CPU slots beside the training workers' own: on
    a cluster the workers fill (2 workers on a 2-CPU machine) they would wait forever."""
    import ray

    from ..dist import worker_cpus

    total = ray.cluster_resources().get("CPU", 0)
    held = world_size * worker_cpus()  # its slot's: the worker itself may hold none (actors.start_worker)
    if total - held < 1:
        raise ConfigError(
            f"the Ray Data training dataset needs CPUs for its read and map tasks, but the "
            f"{world_size} training workers hold {held:g} of the cluster's {total:g}; give each "
            "fewer (scaling.resources_per_worker: {CPU: 0.5}), use fewer workers, or add nodes"
        )


class _Rows:
    """One split's rows, pass after pass, taken in micro-batches of any size."""

    def __init__(self, split: Any, prefetch: int, rank: int):
        self.split, self.prefetch, self.rank = split, prefetch, rank
        self.blocks: Iterator[dict] | None = None
        self.buffer: dict | None = None
        self.in_pass = 0  # rows of the current pass taken
        self._pass_empty = True

    def _block(self) -> dict:
        while True:
            if self.blocks is None:
                self.blocks = iter(self.split.iter_batches(batch_size=None, batch_format="numpy",
                                                           prefetch_batches=self.prefetch))
                self._pass_empty = True
            try:
                block = next(self.blocks)
            except StopIteration:
                if self._pass_empty:
                    raise TaskError(
                        f"rank {self.rank}'s split of the Ray Data training dataset has no rows: the "
                        "dataset is empty, or has fewer rows than workers"
                    ) from None
                self.blocks, self.in_pass = None, 0  # the next pass
                continue
            if len(next(iter(block.values()), ())):
                self._pass_empty = False
                return block

    def take(self, size: int, keep: bool = True) -> dict | None:
        import numpy as np
        import torch

        parts, need = [], size
        while need:
            if self.buffer is None:
                self.buffer = self._block()
            n = len(next(iter(self.buffer.values())))
            k = min(n, need)
            parts.append({c: a[:k] for c, a in self.buffer.items()})
            self.buffer = {c: a[k:] for c, a in self.buffer.items()} if k < n else None
            need -= k
            self.in_pass += k
        if not keep:
            return None
        return {c: torch.as_tensor(np.concatenate([p[c] for p in parts])) for c in parts[0]}

    def skip(self, rows: int) -> None:
        while rows > 0:
            chunk = min(rows, 4096)
            self.take(chunk, keep=False)
            rows -= chunk
