"""Typed configs from YAML files and `--set key=value` overrides, rejected at load time when wrong.

Every setting lives in a pydantic model (its default and a docstring under each field);
this module only reads a YAML file, applies dotted overrides and turns validation errors
into messages that name the valid keys and choices, before anything starts.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, TypeVar, get_args

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A config that cannot run: unknown key, wrong type or incompatible settings (the message says which)."""


def parse_sets(sets: list[str]) -> dict[str, Any]:
    """`["algo.loss=grpo", "rollout.group_size=8"]` -> nested dict; values are YAML scalars or lists."""
    out: dict[str, Any] = {}
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--set takes key=value (dotted keys, e.g. algo.loss=grpo), got {item!r}")
        node = out
        *parents, leaf = key.strip().split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {p} is set to a value and used as a section")
        node[leaf] = yaml.safe_load(value) if value.strip() else ""
    return out


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, recursively for sections."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping of settings, got {type(data).__name__}")
    return data


def load(model: type[M], data: dict[str, Any], *, source: str = "config") -> M:
    """Validate `data` as `model`; ConfigError naming each wrong key with its valid alternatives."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"invalid {source}:\n" + "\n".join(_explain(model, err) for err in e.errors())) from None


def _explain(model: type[BaseModel], err: dict[str, Any]) -> str:
    loc = [str(p) for p in err["loc"]]
    where = ".".join(loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        valid = _fields_at(model, loc[:-1])
        hint = difflib.get_close_matches(loc[-1], valid, n=1)
        maybe = f" (did you mean {hint[0]!r}?)" if hint else ""
        return f"  {where}: unknown key{maybe}; valid keys here: {', '.join(valid)}"
    return f"  {where}: {err['msg']}"


def _fields_at(model: type[BaseModel], path: list[str]) -> list[str]:
    """The field names of the (nested) model at `path`, following Optional / union members."""
    cls: Any = model
    for name in path:
        field = getattr(cls, "model_fields", {}).get(name)
        if field is None:
            return []
        candidates = [field.annotation, *get_args(field.annotation)]
        cls = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if cls is None:
            return []
    return sorted(cls.model_fields)
