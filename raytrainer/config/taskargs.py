"""task.args checked against the annotations of the Task's __init__ (or the loop function).

YAML reads `lr: 3e-4` as a string (YAML 1.1 wants a dot in a float), and so does `--set
task.args.lr=1e-3`; passed on as it is, the string fails inside the task on a worker, after
the cluster has started. So an argument whose parameter is annotated with a type the config
knows (int, float, bool, str, None, Any, list[...], dict[str, ...], Optional/Union/|,
Literal) is coerced to it where a string spells it ("3e-4" for a float) and checked; any
other annotation, and an unannotated parameter, leaves the value as it is.

Where the annotations come from: on the driver the class is named by import path and its
module is not imported (it imports torch: see config/source.py), so they are read from
its source; a class passed by value is in the driver's hands (annotations_of); on the
worker, the imported class's (annotations_of), which also covers what the source could not
tell (an __init__ inherited from another module).
"""

from __future__ import annotations

import ast
import inspect
import types
import typing
from typing import Any, Literal, Optional, Union

from ..errors import ConfigError
from . import source
from .schema import checked, type_name

_NAMES: dict[str, Any] = {"int": int, "float": float, "bool": bool, "str": str, "Any": Any, "None": type(None),
                          "list": list, "List": list, "dict": dict, "Dict": dict}
_UNCHECKED = object()  # an annotation the config does not know: the value is left as it is


def annotations_from_source(path: str, loop: bool) -> dict[str, ast.expr] | None:
    """The parameter annotations of the class's own __init__ (or of the loop function) as
    its module's source writes them; None where the source does not tell."""
    node = source.definition(path)
    if isinstance(node, ast.ClassDef):
        node = None if loop else source.method(node, "__init__")
    elif loop is False:
        node = None  # a function where a class was named: the worker says so
    if node is None:
        return None
    a = node.args
    return {p.arg: p.annotation for p in a.posonlyargs + a.args + a.kwonlyargs if p.annotation is not None}


def annotations_of(obj: Any) -> dict[str, Any]:
    """The parameter annotations of a class's __init__, or of a function (objects, or the
    strings of a module with `from __future__ import annotations`)."""
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.annotation for p in params if p.annotation is not inspect.Parameter.empty}


def typed_args(args: dict[str, Any], annotations: dict[str, Any] | None, path: str) -> dict[str, Any]:
    """`args` with each annotated one coerced to its type; a ConfigError names the key
    (task.args.NAME), the value, the type expected and `path`, what annotates it."""
    if not annotations:
        return args
    out = dict(args)
    for name, value in args.items():
        tp = _type(annotations.get(name))
        if tp is not _UNCHECKED:
            out[name] = _coerced(value, tp, f"task.args.{name}", path)
    return out


def _coerced(value: Any, tp: Any, key: str, path: str) -> Any:
    try:
        return checked(value, tp, key)
    except ConfigError:
        pass
    try:
        return checked(_from_text(value, tp), tp, key)
    except ConfigError:
        quote = " (quoted, in YAML)" if tp is str else ""
        raise ConfigError(f"{key}={value!r} has the wrong type: {path} annotates it as {_name(tp)}; "
                          f"give a value of that type{quote}") from None


def _name(tp: Any) -> str:
    """As schema's type_name, with a list's items (list[int])."""
    origin = typing.get_origin(tp)
    if origin is Union:
        return " | ".join(_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_name(typing.get_args(tp)[0])}]"
    return type_name(tp)


def _from_text(value: Any, tp: Any) -> Any:
    """A string as the number or boolean that `tp` asks for, where it spells one; anything
    else unchanged (the check that follows says what is wrong)."""
    origin = typing.get_origin(tp)
    if origin is Union:
        for arm in typing.get_args(tp):
            found = _from_text(value, arm)
            if found is not value:
                return found
        return value
    if origin is list and isinstance(value, list):
        (item,) = typing.get_args(tp)
        return [_from_text(v, item) for v in value]
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        if tp is float:
            return float(text)
        if tp is int:
            return int(text)
    except ValueError:
        return value
    if tp is bool and text.lower() in ("true", "false"):
        return text.lower() == "true"
    return value


# --------------------------------------------------------------------------- annotations to types

def _type(annotation: Any) -> Any:
    """The annotation as a type schema.checked knows, or _UNCHECKED."""
    if annotation is None:
        return _UNCHECKED
    if isinstance(annotation, str):
        try:
            annotation = ast.parse(annotation, mode="eval").body
        except SyntaxError:
            return _UNCHECKED
    try:
        return _from_ast(annotation) if isinstance(annotation, ast.AST) else _from_object(annotation)
    except _Unknown:
        return _UNCHECKED


class _Unknown(Exception):
    """An annotation (or a part of one) the config does not check."""


def _from_ast(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant):
        if node.value is None:
            return type(None)
        if isinstance(node.value, str):  # a quoted annotation
            return _from_ast(ast.parse(node.value, mode="eval").body)
        raise _Unknown
    if isinstance(node, (ast.Name, ast.Attribute)):
        name = node.id if isinstance(node, ast.Name) else node.attr  # typing.Optional, t.List
        if name not in _NAMES:
            raise _Unknown
        return _NAMES[name]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return Union[_from_ast(node.left), _from_ast(node.right)]
    if isinstance(node, ast.Subscript):
        name = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", "")
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if name == "Literal":
            if not all(isinstance(i, ast.Constant) for i in items):
                raise _Unknown
            return Literal[tuple(i.value for i in items)]
        return _generic(name, [_from_ast(i) for i in items])
    raise _Unknown


def _from_object(tp: Any) -> Any:
    if tp is None:
        return type(None)
    if tp in _NAMES.values():
        return {list: list[Any], dict: dict[str, Any]}.get(tp, tp)
    origin = typing.get_origin(tp)
    if origin is Literal:
        return tp
    if origin in (Union, types.UnionType):
        return _generic("Union", [_from_object(a) for a in typing.get_args(tp)])
    if origin in (list, dict):
        return _generic(origin.__name__, [_from_object(a) for a in typing.get_args(tp)])
    raise _Unknown


def _generic(name: str, items: list[Any]) -> Any:
    if name in ("Optional",) and len(items) == 1:
        return Optional[items[0]]
    if name == "Union":
        return Union[tuple(items)]
    if name in ("list", "List") and len(items) == 1:
        return list[items[0]]
    if name in ("dict", "Dict") and len(items) == 2 and items[0] is str:
        return dict[str, items[1]]
    raise _Unknown
