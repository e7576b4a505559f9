"""Training state between worker processes at the speed of the medium.

A recovery or a grow hands a survivor's state to a worker that lacks it. It used to go as
torch.save'd bytes: serialised into a buffer, copied into Ray's object store, copied out
of it, unpickled into fresh tensors, then copied into the model and optimizer: five passes
over the state (docs/fault-tolerance.md#the-state-transfer-timeline). Here the state is
`pack`ed instead: its structure (the dicts, the loop's counters) in a small skeleton, each
tensor as a flat uint8 numpy view of its own memory. Ray serialises numpy arrays out of
band (pickle protocol 5): `ray.put` or a task's return value copies each tensor's bytes
once, straight into the object store, one object for the whole state, and a reader on the
same node maps that object without a copy; on another node Ray's object manager moves it
in large contiguous chunks. `unpack` then copies each buffer once into tensors of the
worker's own (the object store's memory is read-only, and the optimizer steps its state
in place), or, for a loader that copies them where they go (a Task's model and optimizer:
strategy.load_optimizer), leaves them views of the buffers. A torch tensor given to Ray as
such would be pickled in band, not zero-copy: hence the numpy views.

GPU tensors go through host memory (`.cpu()`); a GPU-direct path (NCCL broadcast of the
flattened state) is not built, and this module has not run on a GPU.

Plain torch and numpy; no Ray.
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class _Slot:
    """Where a tensor was: its buffer's index, dtype and shape."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class Packed:
    """A training state as a skeleton (tensors replaced by `_Slot`s) and one flat uint8
    numpy buffer per tensor."""

    __slots__ = ("skeleton", "buffers")

    def __init__(self, skeleton: Any, buffers: list[np.ndarray]):
        self.skeleton, self.buffers = skeleton, buffers

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def __reduce__(self):  # __slots__ without __dict__: spelled out for pickle
        return Packed, (self.skeleton, self.buffers)


def pack(state: Any) -> Packed:
    """`state` (nested dicts, lists and tuples holding tensors) as a Packed whose buffers
    are views of the tensors' own memory (CPU, contiguous) or of a host copy: pack it just
    before it is handed on, and change no tensor until then."""
    buffers: list[np.ndarray] = []

    def walk(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            flat = obj.detach().cpu().contiguous().reshape(-1)
            buffers.append(flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8))
            return _Slot(len(buffers) - 1, obj.dtype, tuple(obj.shape))
        if isinstance(obj, dict):
            return _same_kind(obj, {k: walk(v) for k, v in obj.items()})
        if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
            return type(obj)(walk(v) for v in obj)
        return obj

    return Packed(walk(state), buffers)


def unpack(packed: Packed, views: Collection[str] = ()) -> Any:
    """The state, every tensor copied once out of `packed`'s buffers into memory of its own,
    but for the tensors under the top-level keys in `views`: those are views of the
    buffers, read-only where the buffers are (the object store's), for a caller that
    copies them where they go (a module's load_state_dict). A copy into fresh memory is
    mostly page faults (several times a copy into memory in use):
    the weights are copied once, into the parameters, instead of twice."""

    def walk(obj: Any, view: bool) -> Any:
        if isinstance(obj, _Slot):
            if view:
                return _view_of(packed.buffers[obj.index], obj.dtype, obj.shape)
            return tensor_of(packed.buffers[obj.index], obj.dtype, obj.shape)
        if isinstance(obj, dict):
            return _same_kind(obj, {k: walk(v, view) for k, v in obj.items()})
        if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
            return type(obj)(walk(v, view) for v in obj)
        return obj

    skeleton = packed.skeleton
    if views and isinstance(skeleton, dict):
        return _same_kind(skeleton, {k: walk(v, k in views) for k, v in skeleton.items()})
    return walk(skeleton, False)


def _same_kind(original: dict, items: dict) -> dict:
    return OrderedDict(items) if isinstance(original, OrderedDict) else items  # a module's state_dict


def _view_of(buffer: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not buffer.nbytes:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # a read-only buffer: torch warns that writes would be undefined
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(np.asarray(buffer, dtype=np.uint8))
    view = flat.view(dtype).reshape(shape)
    _VIEWS[id(view)] = weakref.ref(view, lambda _, key=id(view): _VIEWS.pop(key, None))  # see is_view
    return view


# unpack's views, by id while each lives (a weak reference, dropped with the view): not an
# attribute set on the tensor, and not a WeakSet (its lookups compare tensors with ==).
_VIEWS: dict[int, weakref.ref] = {}


def is_view(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is one of unpack's views (memory the loader must copy out of)."""
    ref = _VIEWS.get(id(tensor))
    return ref is not None and ref() is tensor


def tensor_of(buffer: np.ndarray | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A new tensor of `dtype` and `shape` holding a copy of `buffer`'s bytes."""
    out = torch.empty(int(np.prod(shape, dtype=np.int64)), dtype=dtype)
    if out.numel():
        out.view(torch.uint8).numpy()[:] = np.frombuffer(buffer, dtype=np.uint8)
    return out.reshape(shape)
