"""Frameworks inside your own loop (raytrainer.train_loop): one import each.

- `raytrainer.integrations.hf`: a Hugging Face `Trainer` (extra `[hf]`);
- `raytrainer.integrations.lightning`: a PyTorch Lightning `Trainer` (extra `[lightning]`).

accelerate needs nothing of its own: an `Accelerator()` made inside the loop function takes
the process group raytrainer formed (README, "Your own loop").

Each module imports its framework when it is imported, never from `raytrainer` itself, so a
run that does not use a framework does not load it.
"""

from __future__ import annotations

from typing import Any

AUTO = "auto"


def state_every_checked(state_every: int | str) -> int | str:
    """A callback's `state_every`: a whole number of steps >= 1, or "auto"."""
    if state_every != AUTO and (not isinstance(state_every, int) or isinstance(state_every, bool) or state_every < 1):
        raise ValueError(f"RaytrainerCallback(state_every={state_every!r}): give a whole number of steps >= 1, "
                         "or 'auto'")
    return state_every


def state_due(ctx: Any, state_every: int | str, step: int) -> bool:
    """Whether the report of `step` carries the state: every `state_every` steps, or with
    "auto" where copying it costs about 2% of the time (ctx.state_due: measured in the run,
    the same answer on every rank). Every copy is the whole state to host memory: at every
    step it can cost more than the step (a large model's optimizer state)."""
    return ctx.state_due(step) if state_every == AUTO else step % state_every == 0
