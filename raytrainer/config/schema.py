"""YAML values checked against the sections' annotations: the key, what is allowed, the fix.

The config package's shared helpers: `build` a section from its mapping, `checked` a value
against an annotation (`type_name` names what it allows), a field's `yaml_key`, a config
back `to_dict`, and `copy_tree` of a loaded mapping."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

from ..errors import ConfigError


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is dict or dataclasses.is_dataclass(tp):
        return "mapping"
    if origin is list:
        return "list"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def checked(value: Any, tp: Any, key: str) -> Any:
    """Return `value` checked (and int->float widened) against annotation `tp`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        arms = typing.get_args(tp)
        if value is None and type(None) in arms:
            return None
        for arm in arms:
            if dataclasses.is_dataclass(arm):
                if isinstance(value, dict) or len(arms) == 1:  # a section: its own errors are the useful ones
                    return checked(value, arm, key)
                continue
            try:
                return checked(value, arm, key)
            except ConfigError:
                pass
    elif origin is Literal:
        if any(value == a and type(value) is type(a) for a in typing.get_args(tp)):
            return value
    elif dataclasses.is_dataclass(tp):
        return build(tp, {} if value is None else value, key)
    elif origin is list:
        if isinstance(value, list):
            (item_tp,) = typing.get_args(tp)
            return [checked(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, dict):
            _, value_tp = typing.get_args(tp)
            return {str(k): checked(v, value_tp, f"{key}.{k}") for k, v in value.items()}
    elif tp is Any:
        return value
    elif tp is type(None):
        if value is None:
            return None
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, tp):
        return value
    raise ConfigError(f"{key}={value!r} has the wrong type or value; allowed: {type_name(tp)}")


def build(cls: type, data: Any, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'the config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {yaml_key(f): f for f in _config_fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"section '{prefix}'" if prefix else "the top level"
        raise ConfigError(
            f"unknown key {', '.join(repr(_join(prefix, k)) for k in unknown)} in {where}; "
            f"allowed keys: {', '.join(fields)}"
        )
    kwargs = {}
    for name, f in fields.items():
        key = _join(prefix, name)
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"missing required key '{key}'")
            continue
        kwargs[f.name] = checked(data[name], hints[f.name], key)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        if getattr(cls, "IN_LISTS", False):  # a section used in lists: its messages need the key
            raise ConfigError(f"{prefix}.{exc}") from None
        raise


def yaml_key(f: dataclasses.Field) -> str:
    """The YAML key of a field (differs where the key is a Python keyword, e.g. async)."""
    return f.metadata.get("key", f.name)


def _config_fields(cls_or_obj: Any) -> list[dataclasses.Field]:
    """The fields that are config keys (not those the library sets for itself)."""
    return [f for f in dataclasses.fields(cls_or_obj) if not f.metadata.get("internal")]


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {yaml_key(f): to_dict(getattr(obj, f.name)) for f in _config_fields(obj)}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def copy_tree(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: copy_tree(v) for k, v in data.items()}
    if isinstance(data, list):
        return [copy_tree(v) for v in data]
    return data
