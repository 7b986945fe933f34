"""Typed configs from YAML files and `--set key=value` overrides, rejected at load time when wrong.

Every setting lives in a pydantic model (its default and a docstring under each field);
this module only reads a YAML file, applies dotted overrides and turns validation errors
into messages that name the valid keys and choices, before anything starts.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A config that cannot run: unknown key, wrong type or incompatible settings (the message says which)."""


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key said twice in one mapping (PyYAML keeps the last: a recipe's second
    `optim:` section would silently drop the first's settings)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`, whose keys the mapping may override
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):  # the safe loader refuses it itself
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _SetLoader(_Loader):
    """A `--set` value: also `1e-5` is a float (YAML 1.2; PyYAML's YAML 1.1 wants a dot, `1.0e-5`, and reads it as a
    string, which an untyped setting such as env_kwargs then keeps). Not for files: a saved string "1e5" is
    written unquoted, and must read back as a string."""


_SetLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def parse_sets(sets: list[str]) -> dict[str, Any]:
    """`["algo.loss=grpo", "rollout.group_size=8"]` -> nested dict; values are YAML scalars, lists or mappings (a
    mapping is the whole value: `{}` empties a recipe's, where `key.sub=...` changes one entry of it)."""
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
        node[leaf] = _set_value(item, value)
    return out


def _set_value(item: str, value: str) -> Any:
    if not value.strip():
        return ""
    try:
        return yaml.load(value, Loader=_SetLoader)  # a SafeLoader
    except yaml.YAMLError as e:
        raise ConfigError(
            f"--set {item!r}: the value is not YAML ({_problem(e, line=False)}); quote text meant as it stands: "
            "--set 'key=\"text\"'"
        ) from None


def _problem(e: yaml.YAMLError, *, line: bool = True) -> str:
    """A YAML error in one line (PyYAML's own message spans several, quoting the text)."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    return problem if mark is None or not line else f"{problem}, line {mark.line + 1}"


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, recursively for sections; an empty mapping replaces (it has nothing to merge, so
    merging would leave `base` as it was)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and v and isinstance(out.get(k), dict) else v
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        data = yaml.load(Path(path).read_text(), Loader=_Loader) or {}  # a SafeLoader
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"cannot read config {path}: {_problem(e)}") from None
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
    """The field names of the (nested) model at `path`, following Optional / union members and the entries of
    lists and dicts of models (`eval.benchmarks.0`)."""
    cls: Any = model
    entry = False  # the next name is an index into a list (or a key of a dict), not a field
    for name in path:
        if entry:
            entry = False
            continue
        field = getattr(cls, "model_fields", {}).get(name)
        if field is None:
            return []
        cls, entry = _model_in(field.annotation)
        if cls is None:
            return []
    return sorted(cls.model_fields)


def _model_in(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model a field's annotation holds, and whether it holds it in a container (list, tuple, dict)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    for arg in get_args(annotation):
        cls, inside = _model_in(arg)
        if cls is not None:
            return cls, inside or get_origin(annotation) in (list, tuple, set, frozenset, dict)
    return None, False
