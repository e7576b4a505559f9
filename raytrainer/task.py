"""The user contract: what a task defines, and how workers build one.

A task says what to train; the library does the rest (DDP wrapping, sharding,
accumulation, reduction, checkpoints). Configs name the task by import path and
every worker constructs it itself, so nothing large is pickled from the driver.
A task (or a loop function, see raytrainer.train_loop) may also be passed as a
Python object: a class or function the workers can import is named by its path,
as if the config named it; anything else (defined in `__main__`, a notebook, an
exec'd namespace, an instance with its settings, a closure) is pickled with
cloudpickle once on the driver and unpickled on every worker, as Ray ships remote
functions.

    class MyTask(raytrainer.Task):
        def __init__(self, hidden=64): ...
        def build_model(self): ...
        def build_optimizer(self, model): ...
        def train_dataset(self): ...
        def train_step(self, model, batch): return {"loss": ...}
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import inspect
import sys
from typing import TYPE_CHECKING, Any, Callable

from .config.taskargs import annotations_of, typed_args
from .errors import ConfigError, TaskError

if TYPE_CHECKING:  # the driver never needs torch; only workers import it
    import torch


class Task:
    """Base class for tasks. Override the methods marked 'required'."""

    def build_model(self) -> torch.nn.Module:
        """Required. The model, on CPU; the library moves and wraps it."""
        raise NotImplementedError

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """Required. An optimizer over `model.parameters()`."""
        raise NotImplementedError

    def build_scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int):
        """Optional. An LR scheduler stepped once per optimizer step; `total_steps`
        is the number of optimizer steps the run will take."""
        return None

    def train_dataset(self) -> torch.utils.data.Dataset:
        """Required. A map-style dataset; items are tensors or tuples/dicts of tensors."""
        raise NotImplementedError

    def val_dataset(self) -> torch.utils.data.Dataset | None:
        """Optional. Validated every `trainer.val_every_n_steps` and at each epoch end."""
        return None

    def train_step(self, model: torch.nn.Module, batch: Any) -> dict[str, Any]:
        """Required. Forward one micro-batch; return metrics with a scalar tensor 'loss'
        (the library calls backward on it). Other values are logged, averaged over ranks."""
        raise NotImplementedError

    def val_step(self, model: torch.nn.Module, batch: Any) -> dict[str, Any]:
        """Optional. Metrics of one validation batch (run under no_grad), averaged over
        all validation samples; logged with a 'val_' prefix. Default: train_step's."""
        return self.train_step(model, batch)


    # Optional, for trainer.strategy=fsdp only: define
    #
    #     def shard(self, model, mesh): ...
    #
    # to shard the model yourself: apply torch.distributed.fsdp.fully_shard(unit, mesh=mesh)
    # to each unit, then to the model, and return it (or None). It replaces trainer.fsdp.


REQUIRED = ("build_model", "build_optimizer", "train_dataset", "train_step")


def import_object(target: str, key: str = "task.target") -> Any:
    """The object at `package.module:Name`; `key` names the config setting in errors."""
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{key}={target!r}: module {module_name!r} does not import ({exc}); "
            "check the path and that it is importable from the directory you launch in"
        ) from exc
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ConfigError(f"{key}={target!r}: module {module_name!r} has no {attr!r}") from None
    return obj


def build_task(task: Any, payload: bytes | None = None) -> Task | Callable[..., Any]:
    """On a worker: the Task to train (an instance), or for task.loop the loop function
    with its args bound. `task` is the config's task section; `payload` the pickled object
    when it was passed by value."""
    key = "task.loop" if task.is_loop else "task.target"
    obj = unpickle(payload, task.path) if payload is not None else import_object(task.path, key)
    if task.is_loop:
        if isinstance(obj, type) or not callable(obj):
            raise ConfigError(f"{key}={task.path!r} is not a function; a loop is a function fn(ctx)")
        args = typed_args(task.args, annotations_of(obj), task.annotated)
        _check_args(obj, args, key, task.path, first="ctx")
        return functools.partial(obj, **args) if args else obj
    cls = obj if isinstance(obj, type) else type(obj)
    missing = [
        m for m in REQUIRED
        if not callable(getattr(cls, m, None)) or getattr(cls, m) is getattr(Task, m)
    ]
    if missing:
        raise TaskError(f"task {task.path!r} must define {', '.join(missing)} (see raytrainer.Task)")
    if not isinstance(obj, type):  # an instance, passed by value: built already
        return obj
    # Again with the class itself: its annotations are those the driver read in its source,
    # or ones the source did not tell (an __init__ inherited from another module).
    args = typed_args(task.args, annotations_of(cls), task.annotated)
    _check_args(cls, args, key, task.path)
    return cls(**args)


def _check_args(fn: Any, args: dict[str, Any], key: str, path: str, first: str | None = None) -> None:
    try:
        inspect.signature(fn).bind(*([None] if first else []), **args)
    except TypeError as exc:
        takes = f" (it is called as fn({first}, **task.args))" if first else ""
        raise ConfigError(f"task.args do not fit {path!r}{takes}: {exc}") from None


# --------------------------------------------------------------------------- by value

def describe(obj: Any, args: dict[str, Any] | None = None) -> tuple[dict[str, Any], bytes | None]:
    """The config's task section for a task or loop passed as a Python object (a Task class
    or instance, or a loop function), and its pickle, or None where the workers import it
    by path. A ConfigError names the attribute that cannot be pickled."""
    loop = callable(obj) and not isinstance(obj, type) and not _is_task_instance(obj)
    key = "loop" if loop else "target"
    named = obj if isinstance(obj, type) or inspect.isfunction(obj) else None
    if named is not None and _importable(named):  # by reference, as if the config named it
        return {key: _path(named), "args": dict(args or {})}, None
    if args and not isinstance(obj, type) and not loop:
        raise ConfigError(f"task.args apply to a task class; {type(obj).__name__}(...) is an instance "
                          "already: pass its arguments when you make it")
    what = _what(obj, loop)
    data = dumps(obj, what)
    return {key: _path(obj if named is not None else _origin(obj)), "args": dict(args or {}),
            "by_value": f"{what}, cloudpickle, {len(data)} bytes"}, data


def dumps(obj: Any, what: str) -> bytes:
    """cloudpickle's bytes of `obj`, with the module it was defined in pickled by value when
    the workers could not import it by name (a notebook's, or one loaded from a path)."""
    import cloudpickle

    module = sys.modules.get(getattr(_origin(obj), "__module__", None) or "")
    by_value = module is not None and module.__name__ != "__main__" and not _findable(module.__name__)
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(obj)
    except Exception as exc:  # noqa: BLE001 - every pickling failure is the same config error
        part = _unpicklable_part(obj, what)
        raise ConfigError(
            f"{part} cannot be pickled to ship it to the workers ({type(exc).__name__}: {exc}); make it "
            "where it is used, on the workers (in build_model, train_dataset, ... or inside your loop), "
            "and keep only plain settings on the object you pass"
        ) from None
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)


def unpickle(payload: bytes, path: str) -> Any:
    """On a worker: the object passed by value."""
    import cloudpickle

    try:
        return cloudpickle.loads(payload)
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"the task {path!r} passed by value refers to module {exc.name!r}, which does not import on "
            "this worker; ship your code with the job (ray job submit --working-dir ., or a runtime_env "
            "with py_modules), install it on every node, or define what the task needs in the script "
            "you run"
        ) from None


def _is_task_instance(obj: Any) -> bool:
    return not isinstance(obj, type) and all(callable(getattr(obj, m, None)) for m in REQUIRED)


def _origin(obj: Any) -> Any:
    """The class or function that `obj` is, or is an instance (or a partial) of."""
    if isinstance(obj, functools.partial):
        return _origin(obj.func)
    return obj if isinstance(obj, type) or inspect.isfunction(obj) or inspect.ismethod(obj) else type(obj)


def _path(obj: Any) -> str:
    return f"{getattr(obj, '__module__', None) or '__main__'}:{getattr(obj, '__qualname__', type(obj).__name__)}"


def _what(obj: Any, loop: bool) -> str:
    origin = _origin(obj)
    where = getattr(origin, "__module__", None) or "__main__"
    if loop:
        kind = "partial of function" if isinstance(obj, functools.partial) else "function"
    else:
        kind = "class" if isinstance(obj, type) else "instance of"
    return f"{kind} {origin.__qualname__} from {where}"


def _importable(obj: Any) -> bool:
    """Whether the workers can import `obj` by its path: it is what its module's attribute
    of that name is, in a module the import system finds by name (not __main__, not a
    notebook's or an exec'd namespace, not a <locals> class or a lambda)."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    if module is None or module.__name__ in ("__main__", "__mp_main__") or "<" in obj.__qualname__:
        return False
    found: Any = module
    for part in obj.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is obj and _findable(module.__name__)


def _findable(name: str) -> bool:
    """Whether a fresh interpreter finds module `name` by its name (on sys.path, installed,
    or built in): not one made by exec or loaded from a file path."""
    if name in sys.builtin_module_names:
        return True
    top = name.partition(".")[0]
    if top in ("__main__", "__mp_main__", "builtins"):
        return False
    try:
        return importlib.machinery.PathFinder.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


def _unpicklable_part(obj: Any, what: str) -> str:
    """What in `obj` cannot be pickled, named as the user wrote it: the first attribute (or
    closure variable, or argument, or item) that fails, followed down a few levels."""
    name = _origin(obj).__name__
    suffix = _bad_part(obj)
    return f"{name}{suffix} (in the {what})" if suffix else f"the {what}"


def _bad_part(obj: Any, depth: int = 3) -> str:
    import cloudpickle

    for label, value in _parts(obj):
        try:
            cloudpickle.dumps(value)
        except Exception:  # noqa: BLE001
            return label + (_bad_part(value, depth - 1) if depth > 1 else "")
    return ""


def _parts(obj: Any) -> list[tuple[str, Any]]:
    """Labelled parts of `obj` that a pickle of it holds."""
    if isinstance(obj, functools.partial):
        return [(f"(arg {i})", a) for i, a in enumerate(obj.args)] + [(f"({k}=)", v) for k, v in obj.keywords.items()]
    if inspect.isfunction(obj):
        cells = zip(obj.__code__.co_freevars, obj.__closure__ or ())
        return [(f" (closure variable {name!r})", cell.cell_contents) for name, cell in cells]
    if isinstance(obj, dict):
        return [(f"[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    return [(f".{k}", v) for k, v in getattr(obj, "__dict__", {}).items()]
