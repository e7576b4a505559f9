"""The worker package's own layout: sub-packages by concern with one import direction
between them, no import cycle among its modules, and no module reaching into another
object's private members (see raytrainer/worker/__init__.py).

Every import counts: at the top, under TYPE_CHECKING, or inside a function."""

import ast
from pathlib import Path

import raytrainer

PACKAGE = Path(raytrainer.__file__).parent
WORKER = PACKAGE / "worker"
# Top to bottom: each may import those after it, never one before. "" is the base: the
# modules at worker/'s top level (_internals, dist, ...), which import no sub-package.
ORDER = ["process", "userloop", "loop", "input", "state", ""]
# input/ and state/ do not meet: neither imports the other.
APART = {("input", "state"), ("state", "input")}
# Underscored names that are public by the standard library's own documentation.
STDLIB = {"sys._current_frames", "os._exit", "threading._DummyThread"}


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_name(p): p for p in sorted(WORKER.rglob("*.py"))}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The worker modules `path` imports, wherever the import is."""
    name = _name(path)
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
            subs = {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules}
            out |= subs
            if len(subs) < len(node.names):
                out.add(target)
    return {m for m in out if m in modules and m != name and not name.startswith(m + ".")}


def _package(module: str) -> str:
    rest = module.removeprefix("raytrainer.worker").lstrip(".")
    head = rest.split(".")[0]
    return head if head in ORDER and "." in rest else ""


def test_the_sub_packages_import_only_downwards():
    modules = _modules()
    upward = []
    for name, path in modules.items():
        mine = _package(name)
        for target in _imports(path, modules):
            theirs = _package(target)
            if theirs == mine or name == "raytrainer.worker":
                continue
            if ORDER.index(theirs) < ORDER.index(mine) or (mine, theirs) in APART:
                upward.append(f"{name} ({mine or 'base'}) imports {target} ({theirs or 'base'})")
    assert upward == [], "imports against the worker's one direction:\n" + "\n".join(upward)


def test_no_import_cycle_in_the_worker():
    modules = _modules()
    graph = {m: _imports(p, modules) for m, p in modules.items()}
    cycles, index, low, stack, on, counter = [], {}, {}, [], set(), [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                cycles.append(sorted(part))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == [], "import cycles in the worker:\n" + "\n".join(map(str, cycles))


def _reach_ins(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                continue
            if ast.unparse(node) in STDLIB:
                continue
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom):
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")
                       and a.name != "_internals"]
            if private:
                found.append(f"{where}:{node.lineno}: from {'.' * node.level}{node.module or ''} import {private}")
    return found


def test_no_module_reaches_into_another_objects_private_members():
    """Not `loop._phase`, not `from .input import _PlanSampler`: what a module needs of
    another is on its public face, or handed to it. The gateway modules are the exception
    (worker/_internals.py: the private torch and Ray names, each with why)."""
    paths = [p for p in sorted(WORKER.rglob("*.py")) if p.name != "_internals.py"]
    paths += sorted((PACKAGE / "bench").rglob("*.py"))
    found = [use for p in paths for use in _reach_ins(p.read_text(), str(p.relative_to(PACKAGE.parent)))]
    assert found == [], "private members reached from outside their object:\n" + "\n".join(found)


def test_the_checks_find_what_they_must():
    assert _package("raytrainer.worker.loop.step") == "loop"
    assert _package("raytrainer.worker.dist") == ""
    assert _package("raytrainer.worker.process") == ""  # the package's own __init__: docs only
    assert sorted(_reach_ins("loop._phase('x')\nself._ok\nos._exit(1)\nfrom .m import _x\n", "m.py")) == [
        "m.py:1: loop._phase", "m.py:4: from .m import ['_x']"]
