"""The rollout controller: many episodes at once, token-exact, across policy versions.

Each episode is one asyncio task: reset on an env worker, then turns of
`generate -> env step -> append the observation delta` until the episode ends. Generation
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

An infrastructure failure (the env reports infra_error, or its worker actor dies) never
becomes a zero reward: the episode is restarted (`on_infra_failure="retry"`) or marked
failed, left out of the loss, and counted either way.

Where the env workers run: without a placement, `rollout.num_workers` of them wherever Ray
puts them (a local run: this machine). With one (`cluster.envs` of a run on a Ray cluster),
`workers_per_node` on every Docker node, prepared first (orphans removed, the sandbox image
shipped where missing); a dead worker's replacement goes to a surviving Docker node
(`agentrl.rollout.placement`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import ray
import ray.exceptions
from pydantic import BaseModel

from agentrl.cluster import EnvPlacement
from agentrl.engine.base import InferenceEngine
from agentrl.env.base import FailureClass
from agentrl.rollout.chat import ChatFormat
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.placement import EnvPlacer, NodeWorkers, pinned
from agentrl.rollout.trajectory import Status, Trajectory
from agentrl.rollout.workers import RemoteEnvWorker

log = logging.getLogger(__name__)


class _InfraFailure(Exception):
    pass


def _reap_orphans() -> None:
    """Remove this host's sandbox containers whose owner process died (docker unreachable: left to the reaper)."""
    import docker.errors

    from agentrl.sandbox import SandboxError, reaper
    from agentrl.sandbox.docker_sandbox import docker_client

    try:
        removed = reaper.collect_orphans(docker_client())
    except (SandboxError, docker.errors.DockerException, OSError) as e:
        log.warning("could not remove a dead env worker's sandboxes now (%s); `agentrl sandbox gc` will", e)
        return
    if removed:
        log.warning("removed %d sandbox(es) of a dead env worker", len(removed))


@dataclass(eq=False)
class _Episode:
    traj: Trajectory
    seed: int
    attempt: int = 0
    worker: Any = None  # the EnvWorker actor holding its env
    generating: bool = False

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
    complete_groups: set[str] = field(default_factory=set)


# A worker is dead for the controller when a call to it raises one of these (a worker pinned to a node that died
# before it started is unschedulable: a RayError, but no RayActorError).
_WORKER_DEAD = (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError)


class RolloutController:
    """Drives episodes on env worker actors with one inference engine. `async with` closes it.

    `placement` (a run on a Ray cluster): env workers on every alive node advertising
    `placement.node_resource`, `placement.workers_per_node` each (`rollout.num_workers` is then not used);
    None: `rollout.num_workers` workers wherever Ray puts them."""

    def __init__(
        self, cfg: RolloutConfig, engine: InferenceEngine, chat: ChatFormat, placement: EnvPlacement | None = None
    ) -> None:
        self.cfg = cfg
        self.engine = engine
        self.chat = chat
        self.iteration = 0
        self.workers: list[Any] = []
        self._groups: dict[str, list[_Episode]] = {}  # live groups, in start order
        self._next_worker = 0
        self._stopping = asyncio.Event()
        self._counts = _Counts()
        self._partial = cfg.partial
        self._background: set[asyncio.Task] = set()  # aborts and reaps, referenced until done
        self._replaced_workers = 0
        self._started_ray = False
        self.placement = placement
        self._placer = EnvPlacer(placement) if placement is not None else None
        self._worker_nodes: list[str] = []  # with a placement: each worker's node id, parallel to `workers`
        self._dead: set[int] = set()  # id() of workers known dead, not replaced yet (placement only)
        self._replace_lock = asyncio.Lock()
        self._image = ""

    async def start(self) -> RolloutController:
        await self.engine.start()  # a client learns its server's context length (idempotent)
        if not ray.is_initialized():
            ray.init(address=self.cfg.ray_address, include_dashboard=False, logging_level=logging.WARNING)
            self._started_ray = True
        if self._placer is None:
            self.workers = [self._new_worker() for _ in range(self.cfg.num_workers)]
            return self
        from agentrl.sandbox.image import image_tag

        self._image = image_tag()
        try:
            self._worker_nodes = await asyncio.to_thread(self._placer.start, self._image)
        except BaseException:
            if self._started_ray:  # refused (no Docker node, no image): leave no Ray behind
                ray.shutdown()
                self._started_ray = False
            raise
        self.workers = [self._new_worker(node) for node in self._worker_nodes]
        log.info("%s", self.describe_placement())
        return self

    def _new_worker(self, node_id: str | None = None) -> Any:
        cls = RemoteEnvWorker if node_id is None else RemoteEnvWorker.options(scheduling_strategy=pinned(node_id))
        return cls.remote(self.cfg.env, self.cfg.env_kwargs, self.cfg.sandboxes_per_worker, self.cfg.sandbox_reuse)

    # -- where the workers are ------------------------------------------------------------

    def nodes(self) -> list[NodeWorkers]:
        """With a placement: each Docker node with live env workers (id, IP, workers, how its image got there),
        following replacements; without one: [] (the workers are wherever Ray put them)."""
        return self._placer.summary(self._worker_nodes) if self._placer is not None else []

    def placement_metrics(self) -> dict[str, float]:
        """`rollout/nodes` (distinct nodes with env workers) and `rollout/env_workers`, with a placement; {} without."""
        if self._placer is None:
            return {}
        return {"rollout/nodes": float(len(self.nodes())), "rollout/env_workers": float(len(self.workers))}

    def describe_placement(self) -> str:
        """What to print at the start of a run: where the env workers are, one line per node."""
        if self._placer is None:
            return f"env workers: {len(self.workers) or self.cfg.num_workers}, placed by Ray (no cluster placement)"
        nodes = self.nodes()
        p = self.placement
        lines = [
            f"env workers: {len(self.workers)} on {len(nodes)} node(s) with the {p.node_resource!r} resource "
            f"({p.workers_per_node} per node), sandbox image {self._image}"
        ]
        lines += [f"  {n.ip}  node {n.node_id}: {n.workers} worker(s), image {n.image}" for n in nodes]
        return "\n".join(lines)

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
        """Rebuild the episode's token record from a replay of its env; keep it only if it is the same."""
        traj = ep.traj
        if not traj.token_ids:
            return True  # not started: it resets like a new episode
        closed = traj.turns[:-1] if traj.turn_open else traj.turns  # the turns the env answered
        ep.worker = self._pick_worker()
        actions = [self.chat.decode(traj.generated_ids(t.index)) for t in closed]
        try:
            obs, info, steps = await ep.worker.replay.remote(traj.episode_id, traj.task_id, ep.seed, actions)
        except ray.exceptions.RayError as e:
            log.warning("episode %s: replay failed: %s", traj.episode_id, e)
            steps = []
        same = len(steps) == len(closed)
        if same:
            ids = self.chat.prompt_ids(obs, tools=info.get("tools"))
            for turn, (o, reward, terminated, truncated) in zip(closed, steps, strict=True):
                ids += traj.generated_ids(turn.index)
                ids += self.chat.observation_ids(o, last_token=ids[-1])
                same = same and reward == turn.reward and not (terminated or truncated)
            if traj.turn_open:
                ids += traj.generated_ids(traj.turns[-1].index)
            same = same and ids == traj.token_ids
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
            requested += await self._sample_tasks(n_new - len(requested), seed)
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
                await self._play(ep)
            except (ray.exceptions.RayError, _InfraFailure) as e:
                if isinstance(e, _WORKER_DEAD):
                    await self._replace_worker(ep.worker)
                await self._close_env(ep)
                if self.cfg.on_infra_failure == "retry" and ep.attempt < self.cfg.max_retries:
                    log.warning("episode %s: infrastructure failure, retrying: %s", ep.traj.episode_id, e)
                    ep.attempt += 1
                    ep.traj = self._new_traj(ep.traj.group_id, ep.traj.task_id)
                    ep.worker = None
                    self._counts.retried += 1
                    continue
                log.warning("episode %s: infrastructure failure, masked out: %s", ep.traj.episode_id, e)
                ep.traj.status = Status.FAILED
                ep.traj.failure = FailureClass.INFRA
                ep.traj.error = str(e).strip().splitlines()[0][:500] if str(e).strip() else type(e).__name__
                self._counts.failed += 1
            finally:
                ep.generating = False
            self._note_complete_groups()
            return

    async def _play(self, ep: _Episode) -> None:
        traj = ep.traj
        limit = min(self.cfg.max_episode_tokens, self.engine.max_context)
        if not traj.token_ids:
            ep.worker = self._pick_worker()
            obs, info = await ep.worker.reset.remote(traj.episode_id, traj.task_id, ep.seed)
            traj.append_prompt(self.chat.prompt_ids(obs, tools=info.get("tools")))
        while not self._stopping.is_set():
            used = traj.turns[-1].end - traj.turns[-1].start if traj.turn_open else 0
            budget = min(self.cfg.sampling.max_tokens - used, limit - len(traj.token_ids))
            if budget < 1:
                return await self._finish(ep, truncation="episode_tokens" if used == 0 else "context")
            seed = zlib.crc32(f"{ep.seed}/{len(traj.token_ids)}".encode())
            params = self.cfg.sampling.model_copy(
                update={"max_tokens": budget, "stop_token_ids": self.chat.stop_token_ids, "seed": seed}
            )
            ep.generating = True
            gen = await self.engine.generate(list(traj.token_ids), params, request_id=traj.episode_id)
            ep.generating = False
            traj.append_generation(gen)
            self._counts.tokens += len(gen.token_ids)
            self._note_complete_groups()
            if gen.finish_reason == "aborted":
                return  # parked at a token boundary; the turn continues next iteration
            turn = traj.turns[-1]
            obs, reward, terminated, truncated, info = await ep.worker.step.remote(
                traj.episode_id, self.chat.decode(traj.generated_ids(turn.index))
            )
            turn.reward, turn.info = reward, info
            if info.get("failure") == FailureClass.INFRA:
                raise _InfraFailure(info.get("error", "the environment reported an infrastructure failure"))
            if terminated or truncated:
                return await self._finish(ep, terminated=terminated, truncation="env" if truncated else None)
            delta = self.chat.observation_ids(obs, last_token=traj.token_ids[-1])
            if len(traj.token_ids) + len(delta) + 1 > limit:  # an over-long context never reaches the model
                return await self._finish(ep, truncation="episode_tokens")
            traj.append_observation(delta)
        # stopping: parked at a turn boundary, its env (and sandbox) kept on the worker

    async def _finish(self, ep: _Episode, *, terminated: bool = False, truncation: str | None = None) -> None:
        t = ep.traj
        t.status = Status.FINISHED
        t.terminated, t.truncated, t.truncation = terminated, truncation is not None, truncation
        t.outcome_reward = sum(turn.reward for turn in t.turns)
        self._counts.finished += 1
        self._counts.truncated += t.truncated
        if truncation not in (None, "env"):  # the env did not end it: release its sandbox
            await self._close_env(ep)

    # -- workers ----------------------------------------------------------------------

    def _pick_worker(self) -> Any:
        for _ in range(len(self.workers)):  # skip a worker known dead while its replacement is being placed
            w = self.workers[self._next_worker % len(self.workers)]
            self._next_worker += 1
            if id(w) not in self._dead:
                return w
        return w

    async def _sample_tasks(self, n: int, seed: int) -> list[str]:
        """Task ids from worker 0's env. A worker that died while idle (no episode of its own to
        notice) is replaced here, once: the fresh one answers or the error is real."""
        w = self.workers[0]
        try:
            return await w.sample_tasks.remote(n, seed)
        except _WORKER_DEAD:
            await self._replace_worker(w)
            return await self.workers[0].sample_tasks.remote(n, seed)

    async def _replace_worker(self, dead: Any) -> None:
        """A worker actor died: its episodes fail; a fresh one takes its place, and the dead one's
        sandboxes (whose owner process is gone) are removed now rather than at the next start."""
        if self._placer is not None:
            return await self._replace_placed(dead)
        for i, w in enumerate(self.workers):
            if w is dead:
                log.warning("env worker %d died; starting a replacement", i)
                self.workers[i] = self._new_worker()
                self._replaced_workers += 1
                task = asyncio.ensure_future(asyncio.to_thread(_reap_orphans))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def _replace_placed(self, dead: Any) -> None:
        """`_replace_worker` with a placement: the replacement goes to the alive Docker node with the fewest
        workers. If the dead worker's node is gone, every worker of that node is replaced now (their episodes
        fail on their own); if it is alive, the dead worker's sandboxes are removed there. A node's death also
        kills its workers' sandboxes' owner processes without atexit: their watchdogs remove the containers."""
        if not any(w is dead for w in self.workers):
            return  # replaced already
        self._dead.add(id(dead))
        async with self._replace_lock:
            slots = [i for i, w in enumerate(self.workers) if w is dead]
            if not slots:
                return
            node = self._worker_nodes[slots[0]]
            alive = await asyncio.to_thread(self._placer.alive)
            if node not in {x.node_id for x in alive}:  # the node is gone: so are its other workers
                slots = [i for i, n in enumerate(self._worker_nodes) if n == node]
                log.warning("env node %s is gone: replacing its %d worker(s) on the other nodes", node, len(slots))
            load = Counter(
                n
                for i, (n, w) in enumerate(zip(self._worker_nodes, self.workers, strict=True))
                if i not in slots and id(w) not in self._dead
            )
            targets = await asyncio.to_thread(self._placer.replacements, alive, load, len(slots), self._image)
            for i, target in zip(slots, targets, strict=True):
                old = self.workers[i]
                log.warning("env worker %d (node %s) died; starting a replacement on node %s", i, node, target)
                with contextlib.suppress(Exception):
                    ray.kill(old)  # it may be alive but unreachable: its sandboxes must not stay
                self.workers[i] = self._new_worker(target)
                self._worker_nodes[i] = target
                self._dead.discard(id(old))
                self._replaced_workers += 1
            if node in {x.node_id for x in alive}:
                task = asyncio.ensure_future(asyncio.to_thread(self._placer.reap, {node}))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def _close_env(self, ep: _Episode) -> None:
        if ep.worker is None:
            return
        with contextlib.suppress(ray.exceptions.RayError):  # a dead worker's sandboxes are reaped by owner pid
            await ep.worker.close.remote(ep.traj.episode_id)

    async def close(self) -> None:
        """Close parked episodes' envs and stop the workers (their sandbox pools close); with a placement, then
        remove orphaned sandboxes on every Docker node still alive."""
        for ep in self._live():
            await self._close_env(ep)
        self._groups.clear()
        if self._placer is None:
            for w in self.workers:
                with contextlib.suppress(ray.exceptions.RayError):
                    await w.shutdown.remote()
                ray.kill(w)
        else:
            await asyncio.gather(*(self._shutdown(w) for w in self.workers))
        self.workers = []
        self._worker_nodes = []
        if self._placer is not None and self._placer.nodes:
            await asyncio.gather(*self._background, return_exceptions=True)
            try:
                removed = await asyncio.to_thread(self._placer.reap)
            except Exception as e:  # a node's daemon that fails now: its next start removes them
                log.warning("could not remove orphaned sandboxes on the env nodes: %s", e)
            else:
                if removed:
                    log.warning("removed %d orphaned sandbox(es) on the env nodes", removed)
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
        if self._replaced_workers:
            # Reap again: the reap at a worker's death can run before its killed process is gone (its
            # containers still look owned), and that worker's sandboxes must not outlive the run.
            await asyncio.gather(*self._background, return_exceptions=True)
            if self._placer is None:
                await asyncio.to_thread(_reap_orphans)

    @staticmethod
    async def _shutdown(w: Any, timeout_s: float = 60.0) -> None:
        """Stop one worker: its pools close its sandboxes; one that does not answer (its node died) is killed,
        its watchdog removes them."""
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            await asyncio.wait_for(w.shutdown.remote(), timeout_s)
        with contextlib.suppress(Exception):
            ray.kill(w)
