"""The environment contract: Gymnasium's `Env`, with chat messages in and assistant text out.

Words: a *turn* is one `step` (the agent's message and the environment's reply); an
*episode* runs from `reset` to `terminated` or `truncated`; its *task* is what it is about.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
from collections.abc import Coroutine, Sequence
from typing import Any, ClassVar, NotRequired, TypedDict, TypeVar

import gymnasium
from gymnasium import spaces
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agentrl.env.sandboxes import DEFAULT_POOL_SIZE, SandboxSource
from agentrl.sandbox import ExecResult, Sandbox, SandboxError
from agentrl.tasks import Task, TaskSet
from agentrl.tasks.registry import load_tasks
from agentrl.tasks.solutions import PERFECT, Expert

log = logging.getLogger(__name__)
T = TypeVar("T")


class FailureClass(enum.StrEnum):
    """Whose fault a turn's trouble was. Training leaves infra-failed episodes out of the loss."""

    OK = "ok"
    """nothing went wrong (the agent's code may still have failed: that is its result, not a failure)"""
    AGENT = "agent_error"
    """the agent's message was malformed: bad tool-call JSON, an unknown tool, wrong arguments, no action"""
    INFRA = "infra_error"
    """the environment could not do its job: the sandbox died, the task is broken, a bug in the env"""
    TAMPERED = "tampered"
    """the agent's submission tampered with its grading (repo_fix on pytest: its diff reaches into the test
    framework, or the run's integrity check failed): scored 0, and kept in the loss as any 0 is"""


class Message(TypedDict):
    """One chat message, as `transformers` chat templates take them."""

    role: str
    content: str


class StepInfo(TypedDict):
    """The `info` of `step`. Environments may add their own keys."""

    turn: int
    """0-based index of the turn just played"""
    reward_breakdown: dict[str, float]
    """named terms that sum to the step's reward (e.g. outcome, malformed, public_tests)"""
    failure: FailureClass
    error: NotRequired[str]
    """what went wrong, when failure is not ok"""
    outcome: NotRequired[float]
    """on the step that ends a graded episode: the outcome reward (also in reward_breakdown)"""
    state_key: NotRequired[str | None]
    """`names_states` envs, on a step that does not end the episode: the state the next turn acts in"""


class ResetInfo(TypedDict):
    task_id: str
    tools: list[dict[str, Any]]
    """JSON schemas of the tools, ready for `tokenizer.apply_chat_template(tools=...)`"""
    metadata: dict[str, Any]
    state_key: NotRequired[str | None]
    """`names_states` envs: the state the first turn acts in"""


class ChatMessages(spaces.Space[list[Message]]):
    """Observation space: a list of chat messages `{"role": str, "content": str}`.

    `reset` returns the opening messages (system and user); `step` returns the messages
    that follow the agent's turn (tool results, feedback), to append to the conversation.
    """

    def __init__(self, roles: Sequence[str] = ("system", "user", "assistant", "tool"), seed: int | None = None):
        self.roles = tuple(roles)
        self._text = spaces.Text(max_length=64)
        super().__init__(seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def seed(self, seed: int | None = None) -> int | list[int]:
        seeds = super().seed(seed)
        self._text.seed(int(self.np_random.integers(2**31)))
        return seeds

    def sample(self, mask: Any = None, probability: Any = None) -> list[Message]:
        n = int(self.np_random.integers(1, 4))
        return [{"role": str(self.np_random.choice(self.roles)), "content": self._text.sample()} for _ in range(n)]

    def contains(self, x: Any) -> bool:
        return isinstance(x, list) and all(
            isinstance(m, dict) and m.get("role") in self.roles and isinstance(m.get("content"), str) for m in x
        )

    def __repr__(self) -> str:
        return f"ChatMessages(roles={self.roles})"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, ChatMessages) and other.roles == self.roles


class AssistantText(spaces.Text):
    """Action space: the assistant's message, any Unicode string up to `max_length` characters.

    `spaces.Text` only contains strings over its charset; a model's output is any text, so
    `contains` accepts every `str`. `sample` still draws alphanumerics (noise for tests).
    """

    def __init__(self, max_length: int = 1 << 20, seed: int | None = None):
        super().__init__(max_length=max_length, min_length=0, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length


class EnvConfig(BaseModel):
    """Settings every environment has. Subclasses add theirs (a docstring under each field)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    tasks: str = "procedural"
    """task set spec: a name (procedural, arithmetic, humaneval) or mbpp:PATH, lcb:PATH, hf:NAME"""
    split: str = "train"
    """train, test or all: which side of the task set's seeded split to draw from"""
    split_seed: int = 0
    """seed of the train/test split; train and test never share a task"""
    test_fraction: float = Field(0.2, gt=0, lt=1)
    """share of the task set held out as the test split"""
    max_turns: int = Field(4, ge=1)
    """turns before the episode is truncated"""

    @model_validator(mode="after")
    def _check(self) -> EnvConfig:
        # Here, not only in Field(...): a subclass that overrides a field's default drops its constraints.
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"test_fraction must be in (0, 1), got {self.test_fraction}")
        if self.split not in ("train", "test", "all"):
            raise ValueError(f"split must be train, test or all, got {self.split!r}")
        return self


class StepResult(BaseModel):
    """What a subclass's `_step` decides; the base turns it into Gymnasium's 5-tuple."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    observation: list[dict[str, str]] = Field(default_factory=list)
    reward_breakdown: dict[str, float] = Field(default_factory=dict)
    terminated: bool = False
    failure: FailureClass = FailureClass.OK
    error: str | None = None
    info: dict[str, Any] = Field(default_factory=dict)


class TextEnv(gymnasium.Env[list[Message], str]):
    """A multi-turn text environment.

    - `reset(seed=, options=)` -> (messages, info): draws a task (the same one for the same
      seed; `options={"task_id": ...}` or `{"task": Task}` picks one) and returns the opening
      chat messages. `info` is a `ResetInfo`: task_id, tool schemas, task metadata.
    - `step(text)` -> (messages, reward, terminated, truncated, info): `text` is the agent's
      whole message. `messages` are the replies to append. `info` is a `StepInfo`: the reward
      breakdown (summing to `reward`) and the failure class.
    - `terminated`: the episode ended inside the task (a submission was graded, an answer
      given). `truncated`: it was cut from outside: the turn limit, or an infrastructure
      failure (then `info["failure"]` is infra_error and the episode must not be scored).
    - `areset` / `astep` / `aclose` are the same as coroutines, so one event loop can drive
      many environments while each waits on its sandbox. Use one style per instance: the
      sync methods run the coroutines on a private event loop.
    - `close()` releases the sandbox; safe to call twice. `with` closes on exit.

    Nothing an agent writes makes `step` raise: malformed messages become observations
    (agent_error) and sandbox failures end the episode (infra_error).

    Set these in ALL subclasses: `description` (one line), `reward_doc` (how reward is made),
    `Config` (a pydantic model of the constructor's keyword arguments), and implement
    `_reset(task) -> messages` and `_step(text) -> StepResult`. A subclass that needs a
    sandbox calls `await self.sandbox()`: it is acquired on first use, released at reset/close.
    """

    description: ClassVar[str]
    reward_doc: ClassVar[str]
    Config: ClassVar[type[EnvConfig]] = EnvConfig
    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}
    names_states: ClassVar[bool] = False
    """the env names the state each turn acts in: `info["state_key"]` of `reset` and of every step that does not end
    the episode, equal for equal states (GiGPO's step groups, `algo.advantage: gigpo`); otherwise a state is known
    by a hash of its observation"""
    hosts_agents: ClassVar[bool] = False
    """the env can host an agent program (`agentrl.register(name, agent=..., env=THIS)`): after `reset`, the agent's
    commands run in the episode's workspace (`agent_run`), and `agent_grade` grades what it left there"""

    def __init__(self, *, sandboxes: SandboxSource | None = None, task_set: TaskSet | None = None, **kwargs: Any):
        self.cfg = make_config(self.Config, kwargs, type(self).__name__)
        self.observation_space = ChatMessages()
        self.action_space = AssistantText()
        self.task_set = task_set if task_set is not None else load_task_split(self.cfg)
        self._sandboxes = sandboxes
        self._sandbox: Sandbox | None = None
        self._runner: asyncio.Runner | None = None
        self.task: Task | None = None
        self.turn = 0
        self._done = True
        self.sandbox_s = 0.0
        """seconds the last step waited on its sandbox (acquiring it, calls); the rest is the env's own.
        Kept out of `info` so that equal seeds and actions give equal infos."""

    # ---- subclass hooks

    async def _reset(self, task: Task) -> list[Message]:
        raise NotImplementedError

    async def _step(self, action: str) -> StepResult:
        raise NotImplementedError

    def tool_schemas(self) -> list[dict[str, Any]]:
        return []

    async def agent_run(self, command: str) -> ExecResult:
        """Where `hosts_agents`: run a hosted agent's bash `command` in the episode's workspace."""
        raise NotImplementedError(f"{type(self).__name__} does not host agent programs (hosts_agents is False)")

    async def agent_grade(self) -> tuple[float | None, dict[str, Any]]:
        """Where `hosts_agents`: grade what the hosted agent left in the workspace, as the env's own loop grades a
        submission: (the outcome reward, the info of the step that would have ended the episode); None: the env
        grades nothing (the agent's `run` returns its reward). The episode ends."""
        raise NotImplementedError(f"{type(self).__name__} does not host agent programs (hosts_agents is False)")

    def demonstration(self, task: Task, rng: random.Random, *, expert: Expert = PERFECT) -> list[str]:
        """A scripted expert's messages for `task`, played in order from reset (supervised
        fine-tuning data, `agentrl.env.demos`). Override it where the env has an expert; the
        recorder keeps an episode only if the env terminates it without a failure. `expert`:
        how an imperfect expert errs, where the env can make its mistakes."""
        raise NotImplementedError(f"{type(self).__name__} has no scripted expert to demonstrate with")

    # ---- async API

    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], ResetInfo]:
        super().reset(seed=seed)
        await self._release_sandbox()
        options = options or {}
        if "task" in options:
            self.task = options["task"]
        elif "task_id" in options:
            self.task = self.task_set.get(options["task_id"])
        else:
            self.task = self.task_set.sample(self.np_random)
        self.turn = 0
        self._done = False
        obs = await self._reset(self.task)
        info: ResetInfo = {"task_id": self.task.id, "tools": self.tool_schemas(), "metadata": dict(self.task.metadata)}
        if self.names_states:
            info["state_key"] = await self._named_state()
        return obs, info

    async def astep(self, action: str) -> tuple[list[Message], float, bool, bool, StepInfo]:
        if self._done:
            raise gymnasium.error.ResetNeeded("call reset() before step(); the episode has ended or never began")
        if not isinstance(action, str):
            raise TypeError(f"an action is the assistant's message as str, got {type(action).__name__}")
        self.sandbox_s = 0.0
        try:
            result = await self._step(action)
        except SandboxError as e:
            result = StepResult(failure=FailureClass.INFRA, error=f"sandbox failed: {e}")
        except Exception as e:  # a bug in the environment must not end the run: fail this episode only
            log.exception("%s crashed in step", type(self).__name__)
            result = StepResult(failure=FailureClass.INFRA, error=f"environment error: {type(e).__name__}: {e}")
        turn, self.turn = self.turn, self.turn + 1
        infra = result.failure is FailureClass.INFRA
        terminated = result.terminated and not infra
        truncated = infra or (not terminated and self.turn >= self.cfg.max_turns)
        info: StepInfo = {
            "turn": turn,
            "reward_breakdown": dict(result.reward_breakdown),
            "failure": result.failure,
            **result.info,
        }
        if result.error is not None:
            info["error"] = result.error
        if self.names_states and not (terminated or truncated):
            info["state_key"] = await self._named_state()
        if terminated or truncated:
            self._done = True
            await self._release_sandbox()
        reward = 0.0 if infra else float(sum(result.reward_breakdown.values()))
        return result.observation, reward, terminated, truncated, info

    async def state_key(self) -> str:
        """`names_states` envs: the name of the state the next turn acts in (equal states, equal names)."""
        raise NotImplementedError(f"{type(self).__name__} declares names_states and names none")

    async def _named_state(self) -> str | None:
        """`state_key()`, or None when it cannot be had (the episode is then failed, counted, never scored)."""
        try:
            return await self.state_key()
        except Exception:
            log.exception("%s could not name its state", type(self).__name__)
            return None

    async def aclose(self) -> None:
        self._done = True
        await self._release_sandbox()
        if self._sandboxes is not None:
            await self._sandboxes.detach(self)

    # ---- sandbox access for subclasses

    async def sandbox(self) -> Sandbox:
        """This episode's sandbox, acquired on first use."""
        if self._sandbox is None:
            if self._sandboxes is None:  # a sync env's private loop needs one warm sandbox, not a pool
                self._sandboxes = SandboxSource.default(size=1 if self._runner else DEFAULT_POOL_SIZE)
            self._sandbox = await self.timed(self._sandboxes.acquire(self))
        return self._sandbox

    async def timed(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await a sandbox call and count its time in `self.sandbox_s`."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            return await coro
        finally:
            self.sandbox_s += loop.time() - t0

    async def _release_sandbox(self) -> None:
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            await self._sandboxes.release(sandbox)

    # ---- Gymnasium's sync API

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        return self._sync(self.areset(seed=seed, options=options))

    def step(self, action: str):
        return self._sync(self.astep(action))

    def close(self) -> None:
        if self._runner is not None:
            self._runner.run(self.aclose())
            self._runner.close()
            self._runner = None

    def _sync(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            coro.close()
            raise RuntimeError("an event loop is running in this thread: use `await env.areset()` / `env.astep()`")
        if self._runner is None:
            self._runner = asyncio.Runner()
        return self._runner.run(coro)

    def __enter__(self) -> TextEnv:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def make_config(model: type[BaseModel], kwargs: dict[str, Any], owner: str) -> Any:
    """Validate keyword arguments into a config; unknown keys name the valid ones."""
    unknown = sorted(set(kwargs) - set(model.model_fields))
    if unknown:
        raise ValueError(f"{owner}: unknown setting(s) {unknown}; valid settings: {sorted(model.model_fields)}")
    try:
        return model(**kwargs)
    except ValidationError as e:
        raise ValueError(f"{owner}: invalid settings:\n{e}") from None


def load_task_split(cfg: EnvConfig) -> TaskSet:
    tasks = load_tasks(cfg.tasks)
    if cfg.split == "all":
        return tasks
    return tasks.split(cfg.split, seed=cfg.split_seed, test_fraction=cfg.test_fraction)
