"""The layout is the design: the driver and worker packages meet only in the contract and
the shared modules, and the driver does not load torch."""

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import raytrainer
from raytrainer import contract

PACKAGE = Path(raytrainer.__file__).parent
SHARED = {"raytrainer", "raytrainer.config", "raytrainer.task", "raytrainer.errors", "raytrainer.callbacks",
          "raytrainer.checkpoint", "raytrainer.data", "raytrainer.contract", "raytrainer.filesystems"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, source: str | None = None) -> set[str]:
    """Every raytrainer module `path` imports, at the top, inside a function or under
    TYPE_CHECKING: `from . import loop` is loop, `from .loop import Loop` is loop. Its own
    packages are left out (Python imports a module's packages before the module)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            modules = {f"{target}.{a.name}" for a in node.names if _is_module(f"{target}.{a.name}")}
            out |= modules
            if len(modules) < len(node.names):  # names from `target` itself
                out.add(target)
    return {m for m in out if (m == "raytrainer" or m.startswith("raytrainer."))
            and m != name and not name.startswith(m + ".")}


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


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
    # A shared package counts as one module (config/: a module a section).
    shared |= {_module_name(p) for p in PACKAGE.glob("*/__init__.py")
               if p.parent.name not in ("driver", "worker", "bench", "integrations")}
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


# ---------------------------------------------------------------------------- private names

INTERNALS = {"raytrainer.worker._internals", "raytrainer.driver._internals"}
# Underscored but documented as public by the standard library, and threading's class of
# the threads it did not start (worker/process/keeping.py: Ray's own, told from a run's).
STDLIB = {"sys._current_frames", "os._exit", "threading._DummyThread"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_names(paths) -> set[str]:
    """Every name raytrainer itself defines (functions, classes, attributes, variables)."""
    out = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                out.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                out.add(node.attr)
            elif isinstance(node, ast.arg):
                out.add(node.arg)
    return out


def _foreign_roots(tree) -> set[str]:
    """The local names bound to torch or Ray modules by the imports of a module."""
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {(a.asname or a.name).split(".")[0] for a in node.names
                      if a.name.split(".")[0] in ("torch", "ray")}
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in ("torch", "ray"):
            roots |= {a.asname or a.name for a in node.names}
    return roots


def _private_uses(source: str, where: str, ours: set[str]) -> list[str]:
    """Private torch and Ray names used in `path`: imported (`torch._dynamo`, `from x import
    _y`), reached from a torch or Ray name (`dist.distributed_c10d._world`), read off an
    object where raytrainer defines no such name (`scaler._device`), or named as a string
    (`getattr(it, "_shutdown_workers")`, `("torch.serialization", "_get_layout")`)."""
    tree = ast.parse(source)
    roots = _foreign_roots(tree)
    found = []
    for node in ast.walk(tree):
        hit = None
        if isinstance(node, ast.Import):
            hit = next((a.name for a in node.names if any(map(_private, a.name.split(".")))), None)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            module = node.module or ""
            if any(map(_private, module.split("."))) or any(_private(a.name) for a in node.names):
                hit = f"from {module} import {', '.join(a.name for a in node.names)}"
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            from_foreign = isinstance(base, ast.Name) and base.id in roots
            if (from_foreign or node.attr not in ours) and ast.unparse(node) not in STDLIB:
                hit = ast.unparse(node)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and node.args[1].value not in ours):
            hit = ast.unparse(node)
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            strings = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if (any(s.split(".")[0] in ("torch", "ray") for s in strings)
                    and any(_private(part) for s in strings for part in s.split("."))):
                hit = ast.unparse(node)
        if hit:
            found.append(f"{where}:{node.lineno}: {hit}")
    return sorted(found, key=lambda use: int(use.split(":")[1]))


def test_private_torch_and_ray_names_are_used_only_in_the_internals_modules():
    paths = sorted(PACKAGE.rglob("*.py"))
    ours = _defined_names(p for p in paths if _module_name(p) not in INTERNALS)
    found = [use for p in paths if _module_name(p) not in INTERNALS
             for use in _private_uses(p.read_text(), str(p.relative_to(PACKAGE.parent)), ours)]
    assert found == [], ("private torch or Ray names outside worker/_internals.py and driver/_internals.py "
                         "(move each behind a function there, with why, the versions checked, and what "
                         "happens without it, and a check in tests/test_internals.py):\n" + "\n".join(found))


def test_no_class_overrides_a_private_torch_or_ray_method_outside_the_internals_modules():
    import importlib

    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        if name in INTERNALS or path.name == "__main__.py":
            continue
        module = importlib.import_module(name)
        for cls in [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == name]:
            foreign = [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] in ("torch", "ray")]
            methods = [attr for attr, v in vars(cls).items() if _private(attr) and (
                inspect.isfunction(v) or isinstance(v, (property, staticmethod, classmethod)))]
            found += [f"{name}.{cls.__name__}.{attr} overrides {base.__module__}.{base.__name__}.{attr}"
                      for attr in methods for base in foreign if attr in vars(base)]
    assert found == [], "private torch or Ray methods overridden outside the _internals modules:\n" + "\n".join(found)


def test_the_private_name_check_finds_what_it_must():
    """The check above, on code that uses each kind of private name."""
    code = ("import torch\nimport torch.distributed as dist\nfrom torch.nn.modules.batchnorm import _BatchNorm\n"
            "import torch._dynamo\nfrom ray._private import state\n"
            "dist.distributed_c10d._world.group_count = 0\nscaler._device\ngetattr(it, '_shutdown_workers')\n"
            "ALLOWED = {('torch.serialization', '_get_layout')}\nself._ours\nsys._current_frames()\n")
    found = [use.split(": ", 1)[1] for use in _private_uses(code, "probe.py", {"_ours"})]
    assert found == ["from torch.nn.modules.batchnorm import _BatchNorm", "torch._dynamo",
                     "from ray._private import state", "dist.distributed_c10d._world", "scaler._device",
                     "getattr(it, '_shutdown_workers')", "('torch.serialization', '_get_layout')"], found


# ---------------------------------------------------------------------------- rooms and their doors

def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle():
    """TYPE_CHECKING imports and imports inside functions included: a cycle hidden from the
    interpreter is still two modules that cannot be read, changed or tested apart."""
    cycles = _cycles(_graph())
    assert cycles == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_what_it_must():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    code = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .loop import Loop\n"
            "def f():\n    from . import step\n    from ..checkpoint import Checkpoints\n")
    assert _imports(PACKAGE / "worker" / "probe.py", code) >= {"raytrainer.checkpoint"}


# The worker's sub-packages, top to bottom (docs/design.md, "The import graph"): each imports
# only those after it. "" is the base, the modules at worker/'s top level (_internals, dist,
# ...). input/ and state/ do not meet.
WORKER_ORDER = ["process", "userloop", "loop", "input", "state", ""]
WORKER_APART = {("input", "state"), ("state", "input")}


def _worker_package(module: str) -> str | None:
    """The sub-package of a worker module ("" for the base); None outside the worker."""
    if not module.startswith("raytrainer.worker."):
        return None
    rest = module.removeprefix("raytrainer.worker.")
    head = rest.split(".")[0]
    return head if head in WORKER_ORDER and "." in rest else ""


def _against_the_direction(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for name, targets in sorted(graph.items()):
        mine = _worker_package(name)
        for target in sorted(targets):
            theirs = _worker_package(target)
            if mine is None or theirs is None or theirs == mine:
                continue
            if WORKER_ORDER.index(theirs) < WORKER_ORDER.index(mine) or (mine, theirs) in WORKER_APART:
                wrong.append(f"{name} ({mine or 'base'}) imports {target} ({theirs or 'base'})")
    return wrong


def test_the_workers_sub_packages_import_only_downwards():
    wrong = _against_the_direction(_graph())
    assert wrong == [], "imports against the worker's one direction:\n" + "\n".join(wrong)


def test_the_direction_check_finds_what_it_must():
    graph = {"raytrainer.worker.state.saver": {"raytrainer.worker.loop.loop", "raytrainer.worker.dist"},
             "raytrainer.worker.input.input": {"raytrainer.worker.state.state"},
             "raytrainer.worker.dist": {"raytrainer.worker.pids"},
             "raytrainer.worker.process.actor": {"raytrainer.worker.loop.loop"}}
    assert _against_the_direction(graph) == [
        "raytrainer.worker.input.input (input) imports raytrainer.worker.state.state (state)",
        "raytrainer.worker.state.saver (state) imports raytrainer.worker.loop.loop (loop)"]


def test_the_controller_drives_the_group_through_the_contract_only():
    """The controller and what it is built of know the group by contract.WorkerGroup (the
    fake group of test_controller.py is another one), never driver/group/, which api.py
    builds and hands over."""
    graph = _graph()
    controller = ["controller", "recovery", "resizing", "formation", "recorder", "watchdog", "drainwatch",
                  "stragglers", "policy"]
    found = [f"driver.{m} imports {t}" for m in controller for t in graph[f"raytrainer.driver.{m}"]
             if t.startswith("raytrainer.driver.group")]
    assert found == []


# Reaching another object's private members, or importing another module's private name,
# is allowed only for the gateways themselves (`from . import _internals`) and for names
# the standard library documents as public.
GATEWAYS = {"_internals"}


def _reach_ins(source: str, where: str) -> list[str]:
    """`x._name` where x is not self, cls or super(); `from .m import _name`;
    `getattr(x, "_name")` where x is not self."""
    found = []
    for node in ast.walk(ast.parse(source)):
        hit = None
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            own = (isinstance(base, ast.Name) and base.id in ("self", "cls")) or (
                isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super")
            if not own and ast.unparse(node) not in STDLIB:
                hit = ast.unparse(node)
        elif isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names if _private(a.name) and a.name not in GATEWAYS]
            if names:
                hit = f"from {'.' * node.level}{node.module or ''} import {', '.join(names)}"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)
              and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))):
            hit = ast.unparse(node)
        if hit:
            found.append(f"{where}:{node.lineno}: {hit}")
    return sorted(found, key=lambda use: int(use.split(":")[1]))


def test_no_module_reaches_into_another_objects_private_members():
    """A satellite that needs its owner's state gets a narrow collaborator or arguments; the
    private torch and Ray names the project needs live in the two _internals modules."""
    found = [use for p in sorted(PACKAGE.rglob("*.py")) if _module_name(p) not in INTERNALS
             for use in _reach_ins(p.read_text(), str(p.relative_to(PACKAGE.parent)))]
    assert found == [], "reach-ins (make the member public, or hand the satellite what it needs):\n" + \
        "\n".join(found)


def test_the_reach_in_check_finds_what_it_must():
    code = ("from . import _internals\nfrom .schema import _build, key\nself._mine\ncls._mine\n"
            "super()._mine\nloop._phase\nself.loop._row\ngetattr(worker, '_outbox')\nos._exit(1)\n")
    found = [use.split(": ", 1)[1] for use in _reach_ins(code, "probe.py")]
    assert found == ["from .schema import _build", "loop._phase", "self.loop._row",
                     "getattr(worker, '_outbox')"], found


MAX_MODULE_LINES = 650
MAX_CLASS_LINES = 400


def test_no_module_or_class_outgrows_one_concern():
    """Limits that a room of one concern stays well inside; a split to meet them goes along
    the class's seams (docs/contributing.md)."""
    modules, classes = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        modules.append((len(text.splitlines()), _module_name(path)))
        classes += [(n.end_lineno - n.lineno + 1, f"{_module_name(path)}.{n.name}")
                    for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef)]
    assert [m for m in modules if m[0] > MAX_MODULE_LINES] == []
    assert [c for c in classes if c[0] > MAX_CLASS_LINES] == []


# ---------------------------------------------------------------------------- the docs say what the code does

def test_the_readme_lists_every_event_the_code_writes():
    import re

    code = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    kinds = set(re.findall(r'"event": "([a-z_]+)"', code)) | set(re.findall(r'events\.log\("([a-z_]+)"', code))
    readme = (PACKAGE.parent / "README.md").read_text()
    listed = readme[readme.index("- `events.jsonl`"):readme.index("([their fields]")]
    assert len(kinds) > 20 and sorted(k for k in kinds if f"`{k}`" not in listed) == []


def test_the_readme_task_runs_its_model_once_a_step_and_train_keeps_the_local_ray():
    readme = (PACKAGE.parent / "README.md").read_text()
    step = readme[readme.index("    def train_step(self, model, batch):"):]
    step = step[: step.index("```")]
    assert step.count("model(") == 1, step
    doc = " ".join(raytrainer.train.__doc__.split())
    assert "left up after the run" in doc and "stops it after" not in doc.replace("stopped after it", "")


def test_the_readme_is_a_guide_of_at_most_450_lines():
    assert len((PACKAGE.parent / "README.md").read_text().splitlines()) <= 450


def dated_lines(path: Path) -> list[str]:
    """The lines of a Markdown file that name a day, links to a dated results file aside."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        bare = re.sub(r"\[[^\]]*\]\([^)]*results/[^)]*\)", "", line)
        if re.search(r"\b20\d\d-\d\d-\d\d\b", bare):
            out.append(f"{path.name}:{n}: {line}")
    return out


def test_the_guides_name_no_day_a_dated_measurement_lives_in_docs_results():
    """A figure in a guide is the current one, linked to its run in docs/results/ (the date
    in the file's name), so a guide does not grow into a lab notebook."""
    root = PACKAGE.parent
    paths = [root / "README.md", root / "cluster" / "README.md"] + sorted(
        p for p in (root / "docs").rglob("*.md") if "results" not in p.relative_to(root / "docs").parts)
    found = [line for p in paths for line in dated_lines(p)]
    assert found == [], "\n".join(found)


def test_the_dated_line_check_finds_what_it_must(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("measured on 2026-11-24 here\n[runs](results/2026-11-24-bench.md)\nno date\n")
    assert [line.split(":", 2)[1] for line in dated_lines(page)] == ["1"]


# ---------------------------------------------------------------------------- the docs' links

def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6} (.*)", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """Every relative Markdown link in `path` whose file is missing, or whose #anchor no
    heading of that file slugs to."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{path.relative_to(PACKAGE.parent)}: {target} (no such file)")
        elif anchor and (dest.is_dir() or anchor not in _anchors(dest)):
            broken.append(f"{path.relative_to(PACKAGE.parent)}: {target} (no such heading)")
    return broken


def test_every_relative_link_in_the_docs_points_to_a_file_and_heading_that_exist():
    root = PACKAGE.parent
    paths = [root / "README.md", root / "cluster" / "README.md"] + sorted((root / "docs").rglob("*.md"))
    broken = [b for p in paths for b in broken_links(p)]
    assert broken == [], "broken links:\n" + "\n".join(broken)


def test_the_link_check_slugs_headings_as_github_does():
    assert _slug("On a GPU: `bash .ci/gpu.sh`") == "on-a-gpu-bash-cigpush"
    assert _slug("The kept Ray's start, a third time: the minimal agent late too (2026-11-30)") == \
        "the-kept-rays-start-a-third-time-the-minimal-agent-late-too-2026-11-30"
    assert _slug("FSDP: the fast path beside exact, at ~100 MB of state (2026-11-26)") == \
        "fsdp-the-fast-path-beside-exact-at-100-mb-of-state-2026-11-26"
