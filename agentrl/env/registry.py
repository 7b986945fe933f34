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

import importlib
import importlib.metadata
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import gymnasium
from gymnasium.envs.registration import load_env_creator
from pydantic import BaseModel, ConfigDict

from agentrl.env.agents import SELF_GRADED, AgentRun

if TYPE_CHECKING:
    from agentrl.env.base import TextEnv

NAMESPACE = "agentrl"
ENTRY_POINT_GROUP = "agentrl.envs"
BUILTIN_SOURCE = "agentrl (built-in)"

BUILTINS = {
    "code_sandbox": "agentrl.envs.code_sandbox:CodeSandboxEnv",
    "tool_use": "agentrl.envs.tool_use:ToolUseEnv",
    "humaneval": "agentrl.envs.humaneval:HumanEvalEnv",
    "repo_fix": "agentrl.envs.repo_fix:RepoFixEnv",
    "workspace": "agentrl.envs.workspace:WorkspaceEnv",
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


def same_env(a: str, b: str) -> bool:
    """Whether two names of envs (`code_sandbox`, `agentrl/code_sandbox-v0`, Gymnasium's `module:name`) name one."""
    return env_id(a.rpartition(":")[2]) == env_id(b.rpartition(":")[2])


def register(
    name: str,
    entry_point: Any = None,
    *,
    agent: str | Callable[..., Any] | None = None,
    env: str | None = None,
    source: str = "registered at runtime",
    **defaults: Any,
) -> str:
    """Register an env under `agentrl/NAME-v0` with default keyword arguments; returns the id.

    entry_point: "package.module:Class" (imported when made) or a callable returning the env.
    agent: instead of an entry point, an agent program ("package.module:function" or the coroutine function) run
        on `env` (its tasks, sandboxes and grading; None: it grades itself), `defaults` that env's settings
        (`agentrl.env.agents`).
    """
    if (entry_point is None) == (agent is None):
        raise ValueError(f"register {name!r}: give an entry point (an env) or agent= (an agent program), not both")
    if env is not None and agent is None:
        raise ValueError(f"register {name!r}: env= names the env an agent program runs on; it needs agent=")
    if agent is not None:
        entry_point, defaults = Agent(agent, env=env, **defaults), {}
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
    its "Did you mean" suggestion and the names of all; an env that fails to import says which package it is from.
    """
    eid = env_id(name)
    try:
        return gymnasium.make(eid, disable_env_checker=True, **kwargs).unwrapped
    except ImportError as e:
        raise ImportError(f"env {eid} (from {_sources.get(eid, 'unknown source')}) failed to import: {e}") from e
    except gymnasium.error.NameNotFound as e:  # Gymnasium names the valid envs only when one is close
        names = sorted(s.name for s in gymnasium.registry.values() if s.namespace == NAMESPACE)
        raise gymnasium.error.NameNotFound(f"{e} The agentrl envs: {', '.join(names)}") from None


def env_class(name: str) -> Any:
    """What `make(name)` calls: the env's class (imported, nothing made), or an `Agent`."""
    spec = gymnasium.spec(env_id(name))
    return load_env_creator(spec.entry_point) if isinstance(spec.entry_point, str) else spec.entry_point


def agent_of(name: str) -> Any:
    """The `Agent` registered under `name` (an agent program), or None for an env; loads a string entry point
    (an `agentrl.envs` entry point naming an `Agent`). An unknown name raises as `make` does."""
    creator = env_class(name)
    return creator if isinstance(creator, Agent) else None


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


class Agent:
    """An agent program declared as an environment (see the module doc).

    run: the coroutine function, or "package.module:function" (imported on first use, in the driver).
    env: the env whose tasks, sandboxes and grading apply (it must host agents: `TextEnv.hosts_agents`); None:
        `workspace` (a task and a bare sandbox; `run` returns the reward).
    env_settings: that env's settings (its Config), as `rollout.env_kwargs` would give them.
    """

    def __init__(self, run: str | AgentRun, *, env: str | None = None, description: str = "", **env_settings: Any):
        self.target, self.env = run, env or SELF_GRADED
        self.env_settings = env_settings
        self.description = (
            description or f"an agent program ({run if isinstance(run, str) else run.__qualname__}) on {self.env}"
        )

    @property
    def graded_by_env(self) -> bool:
        return self.env != SELF_GRADED

    def host_class(self) -> type[TextEnv]:
        """The class of the env it runs on (imported, not made)."""
        return env_class(self.env)

    def load(self) -> AgentRun:
        """The `run` coroutine function."""
        if not isinstance(self.target, str):
            return self.target
        module, _, name = self.target.partition(":")
        if not name:
            raise ValueError(f"agent {self.target!r}: give it as package.module:function")
        return getattr(importlib.import_module(module), name)

    def __call__(self, **kwargs: Any) -> TextEnv:
        """The host env of one worker (what `agentrl.make` of this agent's name makes): checked to host agents."""
        env = make(self.env, **(self.env_settings | kwargs))
        if not type(env).hosts_agents:
            raise ValueError(
                f"env {self.env!r} does not host agent programs (its hosts_agents is False): name one that does, "
                "e.g. repo_fix, or none (the agent grades itself)"
            )
        return env


_register_builtins()
_discover()  # reads package metadata only; no plugin is imported until made or listed
