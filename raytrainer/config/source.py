"""What the config can learn of the user's code without running it.

The driver loads the config and must not import torch (tests/test_layout.py), and a task's
module almost always does: so the config reads the module's source instead of importing
it. The module is found the way `import` would find it (sys.path), without executing any
package's __init__. What cannot be read this way (an extension module, a class defined in
another module and imported into this one, a base class elsewhere) is left to the worker,
which imports the real object.
"""

from __future__ import annotations

import ast
import importlib.machinery
from pathlib import Path


def module_found(module: str) -> bool | None:
    """Whether `import module` would find it: None where a package of its path is found
    but not searchable this way (a custom importer, a zip): unknown."""
    origin = _origin(module)
    return None if origin is _UNKNOWN else origin is not None


def definition(path: str) -> ast.FunctionDef | ast.ClassDef | None:
    """The def or class statement that `package.module:Name` (or `Outer.Inner`) names in
    its module's source, or None where it is not found there as one."""
    module, _, qualname = path.partition(":")
    tree = _tree(module)
    node: ast.AST | None = tree
    for part in qualname.split("."):
        node = _child(node, part) if node is not None else None
    return node if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None


def defines(path: str) -> bool | None:
    """Whether the module of `package.module:name` defines `name` at its top level (a def,
    a class, an assignment or an import of that name); None where its source is unread."""
    module, _, name = path.partition(":")
    name, tree = name.partition(".")[0], _tree(module)
    if tree is None or any(isinstance(s, ast.ImportFrom) and s.names[0].name == "*" for s in tree.body):
        return None
    return any(name in _bound_names(stmt) for stmt in tree.body)


def method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    """The class's own def of `name` (not an inherited one)."""
    found = _child(cls, name)
    return found if isinstance(found, ast.FunctionDef) else None


# --------------------------------------------------------------------------- finding it

_UNKNOWN = object()


def _origin(module: str):
    """The source file of `module` (a Path), None where no such module exists, _UNKNOWN
    where it cannot be told without importing."""
    parts = module.split(".")
    search = None  # sys.path
    spec = None
    for i in range(len(parts)):
        try:
            spec = importlib.machinery.PathFinder.find_spec(".".join(parts[: i + 1]), search)
        except (ImportError, ValueError):
            return _UNKNOWN
        if spec is None:
            return None if i == 0 or search else _UNKNOWN
        search = spec.submodule_search_locations
        if i + 1 < len(parts) and search is None:
            return None  # a module, not a package: it has no submodules
    origin = spec.origin if spec is not None else None
    return Path(origin) if origin and origin.endswith(".py") else _UNKNOWN


def _tree(module: str) -> ast.Module | None:
    origin = _origin(module)
    if not isinstance(origin, Path):
        return None
    try:
        return ast.parse(origin.read_text())
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None  # the import on the worker says what is wrong with it


def _child(node: ast.AST, name: str) -> ast.AST | None:
    """The last def or class named `name` in `node`'s body (the one that wins at run time)."""
    found = None
    for stmt in getattr(node, "body", ()):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == name:
            found = stmt
    return found


def _bound_names(stmt: ast.stmt) -> set[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {stmt.name}
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).partition(".")[0] for a in stmt.names}
    if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(stmt, (ast.If, ast.Try)):  # a def under `if TYPE_CHECKING` / try-except import
        inner = stmt.body + stmt.orelse + [s for h in getattr(stmt, "handlers", ()) for s in h.body]
        return set().union(*(_bound_names(s) for s in inner)) if inner else set()
    return set()
