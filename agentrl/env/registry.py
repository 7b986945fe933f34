"""Environment registry: Gymnasium's, under the `agentrl/` namespace, fed by three sources.

- built-ins (`agentrl/envs/`), registered when agentrl is imported;
- `agentrl.register(...)` calls at runtime;
- other installed packages, through the entry-point group `agentrl.envs`
  (`my_env = "my_pkg.env:MyEnv"` in their pyproject's `[project.entry-points."agentrl.envs"]`).

Registration stores the entry point as a string, as Gymnasium does, so nothing is imported
until an env is made or listed; a package whose env fails to import is reported by name
(`list_envs`, `make`) and does not stop the others. `gymnasium.make("agentrl/NAME-v0")`
works once `agentrl` is imported (or as `gymnasium.make("agentrl:agentrl/NAME-v0")`).
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Any

import gymnasium
from gymnasium.envs.registration import load_env_creator
from pydantic import BaseModel, ConfigDict

NAMESPACE = "agentrl"
ENTRY_POINT_GROUP = "agentrl.envs"
BUILTIN_SOURCE = "agentrl (built-in)"

BUILTINS = {
    "code_sandbox": "agentrl.envs.code_sandbox:CodeSandboxEnv",
    "tool_use": "agentrl.envs.tool_use:ToolUseEnv",
    "humaneval": "agentrl.envs.humaneval:HumanEvalEnv",
    "repo_fix": "agentrl.envs.repo_fix:RepoFixEnv",
}

_sources: dict[str, str] = {}  # env id -> where it came from
_broken: list[EnvInfo] = []  # advertised entry points that could not be registered


class EnvInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    id: str
    source: str
    entry_point: str
    description: str = ""
    error: str | None = None
    """why its entry point cannot be loaded, if it cannot"""


def env_id(name: str) -> str:
    """`code_sandbox` -> `agentrl/code_sandbox-v0`; a name with a version keeps it."""
    name = name.removeprefix(f"{NAMESPACE}/")
    return f"{NAMESPACE}/{name}" if re.search(r"-v\d+$", name) else f"{NAMESPACE}/{name}-v0"


def register(name: str, entry_point: Any, *, source: str = "registered at runtime", **defaults: Any) -> str:
    """Register an env under `agentrl/NAME-v0` with default keyword arguments; returns the id.

    entry_point: "package.module:Class" (imported when made) or a callable returning the env.
    """
    eid = env_id(name)
    gymnasium.register(id=eid, entry_point=entry_point, kwargs=defaults, disable_env_checker=True)
    _sources[eid] = source
    return eid


def _discover() -> None:
    """Register every env advertised in the `agentrl.envs` entry-point group, importing nothing.

    Entry points that cannot even be registered (a malformed value) go to `_broken`.
    """
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        source = ep.dist.name if ep.dist is not None else "unknown package"
        if env_id(ep.name) in gymnasium.registry:
            continue  # registered by an import already; the import wins
        try:
            register(ep.name, ep.value, source=source)
        except Exception as e:
            _broken.append(EnvInfo(name=ep.name, id=env_id(ep.name), source=source, entry_point=ep.value, error=str(e)))


def _register_builtins() -> None:
    for name, entry_point in BUILTINS.items():
        register(name, entry_point, source=BUILTIN_SOURCE)


def make(name: str, **kwargs: Any):
    """Make an agentrl env by name (`code_sandbox` or `agentrl/code_sandbox-v0`), unwrapped.

    The raw `TextEnv` keeps its async methods (Gymnasium's wrappers do not forward them)
    and enforces reset-before-step itself. An unknown name raises Gymnasium's error with
    its "Did you mean" suggestion; an env that fails to import says which package it is from.
    """
    eid = env_id(name)
    try:
        return gymnasium.make(eid, disable_env_checker=True, **kwargs).unwrapped
    except ImportError as e:
        raise ImportError(f"env {eid} (from {_sources.get(eid, 'unknown source')}) failed to import: {e}") from e


def list_envs() -> list[EnvInfo]:
    """Every agentrl env, importing each to read its description; failures are reported, not raised."""
    infos = list(_broken)
    for eid, spec in sorted(gymnasium.registry.items()):
        if spec.namespace != NAMESPACE:
            continue
        entry = spec.entry_point if isinstance(spec.entry_point, str) else repr(spec.entry_point)
        info = {"name": spec.name, "id": eid, "source": _sources.get(eid, "gymnasium.register"), "entry_point": entry}
        try:
            creator = load_env_creator(spec.entry_point) if isinstance(spec.entry_point, str) else spec.entry_point
            description = getattr(creator, "description", None) or (creator.__doc__ or "").strip().split("\n")[0]
            infos.append(EnvInfo(**info, description=description))
        except Exception as e:  # one broken package must not hide the others
            infos.append(EnvInfo(**info, error=f"{type(e).__name__}: {e}"))
    return infos


_register_builtins()
_discover()  # reads package metadata only; no plugin is imported until made or listed
