"""The rollout controller: many episodes at once, token-exact, across policy versions.

Each episode is one asyncio task: reset on an env worker, then turns of
`generate -> env step -> append the observation delta` until the episode ends (or, with `rollout.thinking:
strip` or context folding, start a new token sequence of the episode: `agentrl.rollout.context`). Generation
is requested the moment an episode needs it, so the engine batches whichever episodes are
not waiting on a sandbox. One iteration (`run_iteration`):

1. drops trajectories of live groups (parked, or finished and waiting for the rest of their group)
   that would be more than `max_staleness` policy versions behind when trained (`ahead`: the
   versions the learner may move on before it trains this batch);
2. starts new groups (G episodes of one task) until `groups_in_flight` groups are live;
3. drives every live episode. With partial rollouts, once `groups_per_iteration` groups
   are complete (or `iteration_token_budget` tokens were generated) the rest stop: an
   episode mid-generation is aborted at a token boundary (its partial tokens are kept),
   one in an env step stops after it (a turn boundary). They stay parked, sandbox alive,
   and continue next iteration under the new policy version. Without partial rollouts the
   iteration waits for every episode it started;
4. returns the complete groups: every member finished, failed or dropped.

An infrastructure failure (the env reports infra_error, or a call to its worker fails:
`WorkerError`) never becomes a zero reward: the episode is restarted (`on_infra_failure="retry"`)
or marked failed, left out of the loss, and counted either way.

An env registered as an agent program (`agentrl.register(name, agent=...)`, `agentrl.env.agents`) is played by
the agent instead: each episode resets its host env on a worker, then runs the agent's `run` in this process with
a session of the controller's gateway (`agentrl.rollout.gateway`) as its model and the worker's workspace as its
sandbox; the session records the trajectory, and the host env grades what the agent left. Such episodes are never
parked: an iteration waits for them.

The env workers, where they run and their replacement are the pool's (`agentrl.rollout.pool`):
the controller asks it for a worker per episode and knows nothing of Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import math
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

import openai
from pydantic import BaseModel

from agentrl.cluster import EnvPlacement
from agentrl.engine.base import Generation, InferenceEngine
from agentrl.env.agents import AgentSandbox, AgentTask
from agentrl.env.base import FailureClass, Message
from agentrl.env.registry import agent_of, env_class
from agentrl.rollout.chat import ChatFormat
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.context import ContextLayout, Conversation, Plan
from agentrl.rollout.gateway import Gateway
from agentrl.rollout.placement import NodeWorkers
from agentrl.rollout.pool import EnvWorkerHandle, EnvWorkerPool, WorkerError, env_worker_pool
from agentrl.rollout.trajectory import Status, Trajectory
from agentrl.rollout.workers import env_name
from agentrl.sandbox import SandboxConfig

log = logging.getLogger(__name__)


class _InfraFailure(Exception):
    pass


@dataclass(eq=False)
class _Episode:
    traj: Trajectory
    seed: int
    attempt: int = 0
    worker: EnvWorkerHandle | None = None  # the worker holding its env
    generating: bool = False
    conv: Conversation | None = None  # its messages (None before reset)
    state_key: str | None = None  # the state its next turn acts in
    summarizing: bool = False  # its next turn is a summary (context folding)

    @property
    def final(self) -> bool:
        return self.traj.status is not Status.RUNNING


@dataclass
class Group:
    """G samples of one task. Training uses `trainable` (finished) members only."""

    group_id: str
    task_id: str
    trajectories: list[Trajectory]

    @property
    def trainable(self) -> list[Trajectory]:
        return [t for t in self.trajectories if t.trainable]


class RolloutStats(BaseModel):
    iteration: int
    policy_version: int
    wall_s: float
    generated_tokens: int
    tokens_per_s: float
    episodes_finished: int
    episodes_per_min: float
    groups_finished: int
    parked: int
    """episodes left unfinished at the end of the iteration, to continue in the next"""
    dropped_stale: int
    failed: int
    """episodes given up after infrastructure failures (masked out of the loss)"""
    retried: int
    """episode restarts after infrastructure failures"""
    truncated: int
    rewritten: int = 0
    """agent programs' episodes whose history the agent rewrote (each rewrite started a token sequence)"""
    max_staleness: int
    """most policy versions between the oldest and the newest token of a returned trajectory"""


class ParkedEpisode(BaseModel):
    trajectory: Trajectory
    seed: int
    attempt: int = 0


class ControllerState(BaseModel):
    """What a checkpoint keeps of the controller: the task cursor and every live group's members."""

    iteration: int
    """iterations run so far (new groups' tasks are drawn from a stream keyed on it)"""
    groups: dict[str, list[ParkedEpisode]] = {}
    """live groups by id: their finished members and the episodes parked mid-way"""


@dataclass
class RolloutBatch:
    groups: list[Group]
    stats: RolloutStats

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]


@dataclass
class _Counts:
    tokens: int = 0
    finished: int = 0
    dropped: int = 0
    failed: int = 0
    retried: int = 0
    truncated: int = 0
    rewritten: int = 0
    complete_groups: set[str] = field(default_factory=set)


class RolloutController:
    """Drives episodes on env workers with one inference engine. `async with` closes it.

    `placement` (a run on a Ray cluster): env workers on every alive node advertising
    `placement.node_resource`, `placement.workers_per_node` each (`rollout.num_workers` is then not used);
    None: `rollout.num_workers` workers, processes of this one (`env_workers: local`) or wherever Ray puts them
    (`agentrl.rollout.pool.env_worker_pool`). `sandbox`: the backend of every sandbox they make (Docker's by
    default)."""

    def __init__(
        self,
        cfg: RolloutConfig,
        engine: InferenceEngine,
        chat: ChatFormat,
        placement: EnvPlacement | None = None,
        sandbox: SandboxConfig | None = None,
    ) -> None:
        self.cfg = cfg
        self.engine = engine
        self.chat = chat
        self.agent = agent_of(env_name(cfg.env))
        """the agent program that plays this env's episodes (None: the controller's own loop)"""
        if self.agent is not None and not self.agent.host_class().hosts_agents:
            raise ValueError(
                f"{cfg.env} runs its agent on env {self.agent.env!r}, which does not host agent programs: name one "
                "that does (repo_fix), or none (the agent grades itself)"
            )
        host = env_class(self.agent.env if self.agent and self.agent.env else env_name(cfg.env))
        self.names_states = getattr(host, "names_states", False)  # an entry point may be a factory, not a class
        self.layout: ContextLayout | None = None  # knows the engine's context once it started
        self.iteration = 0
        self.pool: EnvWorkerPool = env_worker_pool(cfg, placement, sandbox)
        self._groups: dict[str, list[_Episode]] = {}  # live groups, in start order
        self._stopping = asyncio.Event()
        self._counts = _Counts()
        self._partial = cfg.partial
        self._background: set[asyncio.Task] = set()  # aborts, referenced until done
        self.gateway: Gateway | None = None
        self._http: Any = None  # the episodes' clients' connection pool (agent programs)

    async def start(self) -> RolloutController:
        await self.engine.start()  # a client learns its server's context length (idempotent)
        self.layout = ContextLayout(self.chat, self.cfg, self.engine.max_context)
        await self.pool.start()
        if self.agent is not None and self.gateway is None:
            self.gateway = Gateway(
                self.engine,
                self.chat,
                sampling=self.cfg.sampling,
                max_episode_tokens=min(self.cfg.max_episode_tokens, self.engine.max_context),
                host=self.cfg.gateway_host,
            )
            await self.gateway.start()
            # one connection pool for every episode's client: a client of its own costs ~50 ms of CPU (its TLS
            # context), each episode
            self._http = openai.DefaultAsyncHttpxClient()
        return self

    # -- where the workers are ------------------------------------------------------------

    @property
    def workers(self) -> list[EnvWorkerHandle]:
        """The pool's env workers, one per slot."""
        return self.pool.workers

    def nodes(self) -> list[NodeWorkers]:
        """With a placement: each Docker node with live env workers (id, IP, workers, how its image got there),
        following replacements; without one: [] (the workers are wherever Ray put them)."""
        return self.pool.nodes()

    def placement_metrics(self) -> dict[str, float]:
        """`rollout/nodes` (distinct nodes with env workers) and `rollout/env_workers`, with a placement; {} without."""
        return self.pool.placement_metrics()

    def describe_placement(self) -> str:
        """What to print at the start of a run: where the env workers are, one line per node."""
        return self.pool.describe_placement()

    async def __aenter__(self) -> RolloutController:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def parked(self) -> list[Trajectory]:
        return [ep.traj for eps in self._groups.values() for ep in eps if not ep.final]

    # -- checkpoints ------------------------------------------------------------------

    def state(self, pending: list[Group] = ()) -> ControllerState:
        """The task cursor and the partial-rollout buffer, between iterations. `pending`: complete groups
        returned by `run_iteration` but not trained yet (an asynchronous run's queue); a restored controller
        hands them out with its next iteration."""
        groups = {
            gid: [ParkedEpisode(trajectory=ep.traj, seed=ep.seed, attempt=ep.attempt) for ep in eps]
            for gid, eps in self._groups.items()
        }
        groups |= {
            g.group_id: [ParkedEpisode(trajectory=t, seed=0) for t in g.trajectories]  # final: never replayed
            for g in pending
        }
        return ControllerState(iteration=self.iteration, groups=groups)

    async def restore(self, state: ControllerState) -> int:
        """Continue from `state()` of an earlier process. A parked episode's env is rebuilt by
        replaying it: reset with the same seed, then the same messages stepped. An episode whose
        replay differs from its record (another observation or reward: the env is not
        deterministic there) is dropped. Returns how many were dropped."""
        self.iteration = state.iteration
        self._groups = {
            gid: [_Episode(p.trajectory, p.seed, p.attempt) for p in eps] for gid, eps in state.groups.items()
        }
        results = await asyncio.gather(*(self._replay(ep) for ep in self._live()))
        return results.count(False)

    async def _replay(self, ep: _Episode) -> bool:
        """Rebuild the episode's env, messages and token record from a replay of its env (the turns laid out as
        `_play` lays them out, from the recorded generations); keep it only if the record is the same."""
        traj = ep.traj
        if not traj.token_ids:
            return True  # not started: it resets like a new episode
        closed = traj.turns[:-1] if traj.turn_open else traj.turns  # the turns the env answered
        ep.worker = self.pool.pick()
        actions = [self.chat.decode(traj.generated_ids(t.index)) for t in closed if not t.info.get("summary")]
        try:
            obs, info, steps = await ep.worker.replay(traj.episode_id, traj.task_id, ep.seed, actions)
        except WorkerError as e:
            log.warning("episode %s: replay failed: %s", traj.episode_id, e)
            steps = []
        same = len(steps) == len(actions)
        if same:
            fresh = Trajectory(**{k: getattr(traj, k) for k in ("episode_id", "group_id", "task_id", "sampling")})
            copy = _Episode(fresh, ep.seed, worker=ep.worker)
            self._opened(copy, obs, info)
            replies = iter(steps)
            for turn in traj.turns:
                gen = Generation(
                    token_ids=traj.generated_ids(turn.index),
                    logprobs=traj.logprobs[turn.start : turn.end],
                    versions=traj.versions[turn.start : turn.end],
                    finish_reason=turn.finish_reason or "aborted",
                )
                copy.traj.append_generation(gen)
                if turn.finish_reason is None:
                    break
                self._generated(copy)
                if copy.summarizing:
                    plan = self._summarized(copy, gen)
                else:
                    o, reward, terminated, truncated, step_info = next(replies)
                    same = same and reward == turn.reward and not (terminated or truncated)
                    copy.traj.turns[-1].reward, copy.traj.turns[-1].state_key = reward, copy.state_key
                    plan = self._answered(copy, o, step_info)
                if plan.failure or plan.end or not same:
                    same = False
                    break
                self._apply(copy, plan)
            same = same and copy.traj.token_ids == traj.token_ids and copy.traj.sequences == traj.sequences
            if same:
                ep.conv, ep.state_key, ep.summarizing = copy.conv, copy.state_key, copy.summarizing
        if not same:
            log.warning("episode %s: its env did not replay as recorded; dropped", traj.episode_id)
            traj.status = Status.DROPPED
            traj.error = "not resumable: the env replayed differently"
            await self._close_env(ep)
        return same

    # -- one iteration ---------------------------------------------------------------

    async def run_iteration(
        self, task_ids: list[str] | None = None, *, drain: bool = False, ahead: int = 0
    ) -> RolloutBatch:
        """Run one iteration; `task_ids` (optional) chooses the tasks of the new groups.

        `drain=True` starts no new group and finishes every live episode (for shutdown or eval).
        `ahead`: how many weight updates may land before this batch is trained (an asynchronous run's
        `async_level`): a parked episode is continued only if its oldest token will still be within
        `max_staleness` then; new episodes start at the current version, within the bound when ahead <= it.
        """
        t0 = time.perf_counter()
        self._counts = _Counts()
        self._stopping = asyncio.Event()
        self._partial = self.cfg.partial and not drain
        version = self.engine.version
        waiting = (Status.RUNNING, Status.FINISHED)  # a finished member waiting for its group ages like a parked one
        for ep in (ep for eps in self._groups.values() for ep in eps if ep.traj.status in waiting):
            if ep.traj.staleness(version) + ahead <= self.cfg.max_staleness:
                continue
            if not ep.final:
                await self._close_env(ep)
            ep.traj.status = Status.DROPPED
            self._counts.dropped += 1
        n_new = 0 if drain else max(0, self.cfg.groups_in_flight - len(self._groups))
        requested = list(task_ids or [])[:n_new]
        if len(requested) < n_new:
            seed = zlib.crc32(f"{self.cfg.seed}/tasks/{self.iteration}".encode())
            requested += await self.pool.sample_tasks(n_new - len(requested), seed)
        for k, task_id in enumerate(requested):
            self._new_group(f"{self.iteration:05d}-{k:03d}", task_id)
        self._note_complete_groups()
        await asyncio.gather(*(self._drive(ep) for ep in self._live()))

        done = [gid for gid, eps in self._groups.items() if all(ep.final for ep in eps)]
        groups = []
        for gid in done:
            eps = self._groups.pop(gid)
            groups.append(Group(gid, eps[0].traj.task_id, [ep.traj for ep in eps]))
        wall = time.perf_counter() - t0
        c = self._counts
        stale = [t.policy_versions[-1] - t.oldest_version for g in groups for t in g.trajectories if t.policy_versions]
        stats = RolloutStats(
            iteration=self.iteration,
            policy_version=version,
            wall_s=wall,
            generated_tokens=c.tokens,
            tokens_per_s=c.tokens / wall,
            episodes_finished=c.finished,
            episodes_per_min=60 * c.finished / wall,
            groups_finished=len(groups),
            parked=len(self.parked),
            dropped_stale=c.dropped,
            failed=c.failed,
            retried=c.retried,
            truncated=c.truncated,
            rewritten=c.rewritten,
            max_staleness=max(stale, default=0),
        )
        self.iteration += 1
        return RolloutBatch(groups, stats)

    def _live(self) -> list[_Episode]:
        return [ep for eps in self._groups.values() for ep in eps if not ep.final]

    def _new_group(self, gid: str, task_id: str) -> None:
        """`gid` (iteration and index) seeds the group's sampling: a run is repeatable from its seed."""
        self._groups[gid] = [
            _Episode(self._new_traj(gid, task_id), seed=zlib.crc32(f"{self.cfg.seed}/{gid}/{i}".encode()))
            for i in range(self.cfg.group_size)
        ]

    def _new_traj(self, gid: str, task_id: str) -> Trajectory:
        return Trajectory(episode_id=uuid.uuid4().hex, group_id=gid, task_id=task_id, sampling=self.cfg.sampling)

    # -- the end of an iteration ------------------------------------------------------

    def _note_complete_groups(self) -> None:
        for gid, eps in self._groups.items():
            # a group left with nothing to train (every member dropped as stale, or failed) is returned, but
            # does not count toward the target: an iteration of such groups would have nothing to learn from
            if all(ep.final for ep in eps) and any(ep.traj.trainable for ep in eps):
                self._counts.complete_groups.add(gid)
        target = len(self._counts.complete_groups) >= self.cfg.groups_per_iteration
        budget = self.cfg.iteration_token_budget
        if self._partial and (target or (budget is not None and self._counts.tokens >= budget)):
            self.stop()

    def stop(self) -> None:
        """End the running iteration now: episodes mid-generation are aborted at a token boundary, those in an
        env step stop after it; all stay parked (sandbox alive) for the next iteration. Safe to call any time."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        for ep in self._live():
            if ep.generating:  # its generate returns the partial tokens, finish reason "aborted"
                task = asyncio.ensure_future(self.engine.abort(ep.traj.episode_id))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    # -- one episode ------------------------------------------------------------------

    async def _drive(self, ep: _Episode) -> None:
        while True:
            try:
                await (self._play(ep) if self.agent is None else self._play_agent(ep))
            except (WorkerError, _InfraFailure) as e:  # a dead worker is replaced already (WorkerDied)
                await self._close_env(ep)
                if self.cfg.on_infra_failure == "retry" and ep.attempt < self.cfg.max_retries:
                    log.warning("episode %s: infrastructure failure, retrying: %s", ep.traj.episode_id, e)
                    ep.attempt += 1
                    ep.traj = self._new_traj(ep.traj.group_id, ep.traj.task_id)
                    ep.worker = None
                    self._counts.retried += 1
                    continue
                log.warning("episode %s: infrastructure failure, masked out: %s", ep.traj.episode_id, e)
                self._fail(ep, FailureClass.INFRA, str(e).strip().splitlines()[0][:500] if str(e).strip() else "")
            finally:
                ep.generating = False
            self._note_complete_groups()
            return

    async def _play(self, ep: _Episode) -> None:
        traj, layout = ep.traj, self.layout
        if not traj.token_ids:
            ep.worker = self.pool.pick()
            obs, info = await ep.worker.reset(traj.episode_id, traj.task_id, ep.seed)
            self._opened(ep, obs, info)
        while not self._stopping.is_set():
            used = traj.turns[-1].end - traj.turns[-1].start if traj.turn_open else 0
            turn_tokens = self.cfg.context.summary_max_tokens if ep.summarizing else self.cfg.sampling.max_tokens
            room = {  # the truncation that names each bound (the episode's first: it names a tie)
                "episode_tokens": self.cfg.max_episode_tokens - traj.episode_tokens,
                "context": layout.limit - traj.context_length,
            }
            budget = min(turn_tokens - used, *room.values())
            if budget < 1 or (ep.summarizing and budget < turn_tokens - used):  # no room for a whole summary
                return await self._finish(ep, truncation=min(room, key=room.__getitem__))
            seed = zlib.crc32(f"{ep.seed}/{len(traj.token_ids)}".encode())
            params = self.cfg.sampling.model_copy(
                update={"max_tokens": budget, "stop_token_ids": self.chat.stop_token_ids, "seed": seed}
            )
            ep.generating = True
            gen = await self.engine.generate(traj.context_ids, params, request_id=traj.episode_id)
            ep.generating = False
            traj.append_generation(gen)
            self._counts.tokens += len(gen.token_ids)
            self._note_complete_groups()
            if gen.finish_reason == "aborted":
                return  # parked at a token boundary; the turn continues next iteration
            self._generated(ep)
            if ep.summarizing:
                plan = self._summarized(ep, gen)
            else:
                turn = traj.turns[-1]
                obs, reward, terminated, truncated, info = await ep.worker.step(
                    traj.episode_id, ep.conv.turns[-1][0]["content"]
                )
                turn.reward, turn.info, turn.state_key = reward, info, ep.state_key
                if info.get("failure") == FailureClass.INFRA:
                    raise _InfraFailure(info.get("error", "the environment reported an infrastructure failure"))
                if not math.isfinite(reward):  # an env's bug: it would turn its whole group's advantages to NaN
                    raise _InfraFailure(f"env {self.cfg.env} returned a reward of {reward!r}")
                if terminated or truncated:
                    return await self._finish(ep, terminated=terminated, truncation="env" if truncated else None)
                plan = self._answered(ep, obs, info)
            if plan.failure is not None:
                log.warning("episode %s: %s", traj.episode_id, plan.failure)
                await self._close_env(ep)
                return self._fail(ep, FailureClass.AGENT, plan.failure)
            if plan.end is not None:
                return await self._finish(ep, truncation=plan.end)
            if (full := self._apply(ep, plan)) is not None:  # an over-long context never reaches the model
                return await self._finish(ep, truncation=full)
        # stopping: parked at a turn boundary, its env (and sandbox) kept on the worker

    def _opened(self, ep: _Episode, obs: list[Message], info: dict[str, Any]) -> None:
        """The env was reset: the episode's messages, its first state and its prompt."""
        ep.conv = Conversation(obs, info.get("tools"))
        ep.state_key = self._state_key(obs, info)
        ep.traj.append_prompt(self.layout.opening(ep.conv))

    def _generated(self, ep: _Episode) -> None:
        """The episode's last turn is complete: the assistant's message, as the env will read it."""
        text = self.chat.decode(ep.traj.generated_ids(ep.traj.turns[-1].index))
        ep.conv.turns.append([{"role": "assistant", "content": text}])

    def _answered(self, ep: _Episode, obs: list[Message], info: dict[str, Any]) -> Plan:
        """The env answered the episode's last turn (recorded as taken in `ep.state_key`) without ending it: the
        next state, the next prompt."""
        key = self._state_key(obs, info)
        if key is None or ep.state_key is None:
            return Plan(failure=f"env {self.cfg.env} names its states (names_states) but gave no info['state_key']")
        ep.state_key = key
        return self.layout.after_turn(ep.traj, ep.conv, obs)

    def _summarized(self, ep: _Episode, gen: Generation) -> Plan:
        """The episode's summary turn ended (never sent to the env): the fold that follows it."""
        ep.summarizing = False
        ep.traj.turns[-1].info = {"summary": True}
        return self.layout.after_summary(ep.conv, gen.finish_reason)

    def _apply(self, ep: _Episode, plan: Plan) -> str | None:
        """The plan's ids appended or starting a sequence (None); or, nothing done, the truncation that ends the
        episode when the next turn would have no room: past the episode's bound ("episode_tokens") or the
        sequence's ("context": the engine's context, `context.max_tokens`)."""
        traj, new = ep.traj, plan.sequence is not None
        context = len(plan.ids) + (0 if new else traj.context_length)
        grown = traj.episode_tokens + (plan.new if new else len(plan.ids))
        if grown + 1 > self.cfg.max_episode_tokens:
            return "episode_tokens"
        if context + 1 > self.layout.limit:
            return "context"
        if new:
            traj.start_sequence(plan.ids, plan.sequence, plan.info, new=plan.new)
        else:
            traj.append_observation(plan.ids)
        ep.summarizing = plan.summarize
        return None

    def _state_key(self, obs: list[Message], info: dict[str, Any]) -> str | None:
        """The env's name for the state (`names_states`; None if it gave none) or a hash of the observation."""
        if self.names_states:
            key = info.get("state_key")
            return None if key is None else str(key)
        return hashlib.sha256(json.dumps(obs, sort_keys=True).encode()).hexdigest()[:32]

    async def _play_agent(self, ep: _Episode) -> None:
        """An agent program's episode (see the module doc): its failures (it raised, never called the model, ran
        past `agent_timeout_s`, or returned no number where it grades itself) fail the episode, never scored."""
        traj = ep.traj
        ep.worker = worker = self.pool.pick()
        obs, info = await worker.reset(traj.episode_id, traj.task_id, ep.seed)
        access = self.gateway.open(traj, seed=ep.seed)
        task = AgentTask(traj.task_id, obs, info.get("tools", []), info.get("metadata", {}))
        sandbox = AgentSandbox(functools.partial(worker.agent_run, traj.episode_id))
        limit = self.cfg.agent_timeout_s
        problem, returned = None, None
        client = openai.AsyncOpenAI(
            base_url=access.base_url, api_key=access.api_key, max_retries=2, timeout=limit, http_client=self._http
        )
        try:
            returned = await asyncio.wait_for(self.agent.load()(task, client, sandbox), limit)
        except TimeoutError:
            problem = f"the agent ran past rollout.agent_timeout_s={limit:g} s"
        except WorkerError:
            raise
        except Exception as e:  # the agent's own code: its episode fails, the run goes on
            problem = f"the agent raised {type(e).__name__}: {e}"
        finally:  # the client is not closed: its connection pool is the controller's
            session = await self.gateway.close_session(access.session_id)
            self._counts.tokens += traj.num_generated
        if problem is None and session.calls == 0:
            problem = "the agent never called the model"
        self._counts.rewritten += session.rewrites > 0
        if problem is None:
            reward, grading = await worker.agent_grade(traj.episode_id)
            if reward is None:  # no env grades: the agent did
                reward = _own_reward(returned)
                grading = {"outcome": reward}
                if reward is None:
                    problem = f"the agent grades itself (no env named) and returned {returned!r}, not a number"
        if problem is not None:
            log.warning("episode %s: %s", traj.episode_id, problem)
            await self._close_env(ep)
            return self._fail(ep, FailureClass.AGENT, problem)
        if not traj.turns:  # every call of a session records a turn; none recorded: the calls all failed
            await self._close_env(ep)
            return self._fail(ep, FailureClass.AGENT, "no call of the agent's was answered")
        traj.turns[-1].reward, traj.turns[-1].info = reward, grading
        await self._finish(ep, terminated=True)

    def _fail(self, ep: _Episode, failure: FailureClass, error: str) -> None:
        ep.traj.status, ep.traj.failure, ep.traj.error = Status.FAILED, failure, error or failure.value
        self._counts.failed += 1

    async def _finish(self, ep: _Episode, *, terminated: bool = False, truncation: str | None = None) -> None:
        t = ep.traj
        t.status = Status.FINISHED
        t.terminated, t.truncated, t.truncation = terminated, truncation is not None, truncation
        t.outcome_reward = sum(turn.reward for turn in t.turns)
        self._counts.finished += 1
        self._counts.truncated += t.truncated
        if truncation not in (None, "env"):  # the env did not end it: release its sandbox
            await self._close_env(ep)

    async def _close_env(self, ep: _Episode) -> None:
        if ep.worker is None:
            return
        with contextlib.suppress(WorkerError):
            await ep.worker.close(ep.traj.episode_id)

    async def close(self) -> None:
        """Close parked episodes' envs, then the pool: its workers stop and their sandboxes are removed."""
        for ep in self._live():
            await self._close_env(ep)
        self._groups.clear()
        if self.gateway is not None:
            await self.gateway.close()
            await self._http.aclose()
        await self.pool.close()


def _own_reward(returned: Any) -> float | None:
    """What a self-grading agent's `run` returned, as a reward (None: not a finite number)."""
    ok = isinstance(returned, int | float) and not isinstance(returned, bool) and math.isfinite(returned)
    return float(returned) if ok else None
