"""The layout is the design: the driver and worker packages meet only in the contract and
the shared modules, and the driver does not load torch."""

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import raytrainer
from raytrainer import contract

PACKAGE = Path(raytrainer.__file__).parent
SHARED = {"raytrainer", "raytrainer.config", "raytrainer.task", "raytrainer.errors", "raytrainer.callbacks",
          "raytrainer.checkpoint", "raytrainer.data", "raytrainer.contract"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every raytrainer module `path` imports, at the top or inside a function."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            out |= {f"{target}.{a.name}" for a in node.names}  # `from . import loop`
    return {m for m in out if m == "raytrainer" or m.startswith("raytrainer.")}


def _side(module: str) -> str:
    for side in ("driver", "worker", "bench"):
        if module == f"raytrainer.{side}" or module.startswith(f"raytrainer.{side}."):
            return side
    return "shared"


def test_driver_and_worker_meet_only_in_the_contract_and_shared_modules():
    crossings = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = _module_name(path)
        side = _side(here)
        for target in _imports(path):
            other = _side(target)
            # The package's own __init__ and __main__ are the public face: they re-export the API.
            entry = here in ("raytrainer", "raytrainer.__main__")
            if {side, other} == {"driver", "worker"} or (side == "shared" and other in ("driver", "worker")
                                                          and not entry):
                crossings.append(f"{here} imports {target}")
    assert crossings == [], "imports across the driver/worker line:\n" + "\n".join(crossings)


def test_the_shared_modules_are_the_ones_listed():
    shared = {_module_name(p) for p in PACKAGE.glob("*.py") if p.name != "__main__.py"}
    assert shared == SHARED, "a new top-level module: put it in driver/ or worker/, or list it as shared here"


def test_the_worker_actor_answers_every_call_of_the_contract():
    from raytrainer.task import import_object

    actor = import_object(contract.WORKER_ACTOR)
    calls = [n for n, v in vars(contract.WorkerActor).items() if callable(v) and not n.startswith("_")]
    assert len(calls) > 10
    for name in calls:
        assert callable(getattr(actor, name, None)), f"{contract.WORKER_ACTOR} has no {name}()"
        want = list(inspect.signature(getattr(contract.WorkerActor, name)).parameters)
        have = list(inspect.signature(getattr(actor, name)).parameters)
        assert have[: len(want)] == want, f"{name}{have} does not match the contract's {want}"


def test_the_driver_does_not_load_torch_or_the_worker_package():
    code = ("import sys, raytrainer, raytrainer.driver.api, raytrainer.driver.group, raytrainer.driver.cli, "
            "raytrainer.driver.loggers, raytrainer.driver.plot; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('raytrainer.worker')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
