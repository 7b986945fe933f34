"""The rollout controller on real Ray env workers, real Docker sandboxes and the hf engine."""

import asyncio
import itertools
import json

import pytest
import ray
import torch

import agentrl
from agentrl.engine import EngineConfig, EngineModel
from agentrl.engine.base import Generation, SamplingParams
from agentrl.engine.fleet import Fleet
from agentrl.engine.hf import HFEngine
from agentrl.engine.sampling import token_logprobs
from agentrl.models.tiny import save_tiny, tiny_model
from agentrl.models.tokenizer import load_tokenizer
from agentrl.rollout import (
    ChatFormat,
    ControllerState,
    RolloutConfig,
    RolloutController,
    Segment,
    Status,
    WorkerDied,
    WorkerError,
)
from agentrl.rollout.pool import RayEnvWorkerPool
from agentrl.sandbox import SandboxConfig

pytestmark = pytest.mark.docker


class Recording:
    """An engine that keeps every prompt it received and every generation it returned."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: dict[str, list[tuple[list[int], Generation]]] = {}

    async def generate(self, prompt_ids, params, *, request_id=None):
        gen = await super().generate(prompt_ids, params, request_id=request_id)
        self.calls.setdefault(request_id, []).append((list(prompt_ids), gen))
        return gen


class RecordingEngine(Recording, HFEngine):
    """The real hf engine, recording."""


class RecordingFleet(Recording, Fleet):
    """Real hf replicas (Ray actors) behind a fleet, recording."""


def config(**kw) -> RolloutConfig:
    base = dict(
        env="code_sandbox",
        env_kwargs={"max_turns": 3},
        group_size=2,
        groups_per_iteration=2,
        num_workers=2,
        sandboxes_per_worker=2,
        sampling=SamplingParams(max_tokens=24),
        max_episode_tokens=2000,
        partial=False,
    )
    return RolloutConfig(**{**base, **kw})


def chat() -> ChatFormat:
    return ChatFormat(load_tokenizer("qwen3"))


def assert_token_exact(engine: Recording, traj, model: torch.nn.Module | None = None) -> list[list[int]]:
    """The trajectory is every prompt the engine received and every token it produced, turn by turn,
    and its logprobs are the model's own (`model`, by default the engine's). Returns the observation deltas."""
    calls = engine.calls[traj.episode_id]
    assert len(calls) == len(traj.turns)  # one generation per turn
    rebuilt: list[int] = []
    deltas = []
    for k, (prompt, gen) in enumerate(calls):
        assert prompt[: len(rebuilt)] == rebuilt, f"turn {k}: the prompt does not extend the last one"
        if k:  # the env's reply, as a template delta
            assert set(traj.segments[len(rebuilt) : len(prompt)]) == {Segment.OBSERVATION}
            deltas.append(prompt[len(rebuilt) :])
        rebuilt = prompt + gen.token_ids
        t = traj.turns[k]
        assert (t.start, t.end) == (len(prompt), len(rebuilt))
        assert traj.logprobs[t.start : t.end] == gen.logprobs and traj.versions[t.start : t.end] == gen.versions
    assert traj.token_ids == rebuilt
    assert traj.loss_mask == [int(s is Segment.GENERATED) for s in traj.segments]
    assert traj.outcome_reward == pytest.approx(sum(t.reward for t in traj.turns))
    # the logprobs are the model's own, position by position (invariant 2 through the whole loop)
    with torch.no_grad():
        logits = (model or engine.model)(torch.tensor([traj.token_ids])).logits[0, :-1]
    lp = token_logprobs(logits, torch.tensor(traj.token_ids[1:]), traj.sampling)
    mask = torch.tensor(traj.loss_mask[1:]).bool()
    torch.testing.assert_close(lp[mask], torch.tensor(traj.logprobs[1:])[mask], atol=1e-4, rtol=0)
    assert traj.model_validate_json(traj.model_dump_json()) == traj  # serialisable
    return deltas


async def test_trajectories_are_token_exact(ray_local):
    engine = RecordingEngine(tiny_model("qwen3_moe", seed=0))
    async with engine, RolloutController(config(), engine, chat()) as ctl:
        batch = await ctl.run_iteration()
    assert batch.stats.groups_finished == 2 and batch.stats.failed == 0
    for traj in batch.trajectories:
        assert len(traj.turns) == 3  # max_turns
        for delta in assert_token_exact(engine, traj):
            assert "<|im_start|>" in chat().tokenizer.decode(delta)
        assert traj.truncated and traj.truncation == "env" and traj.status is Status.FINISHED


@pytest.mark.slow  # the fast tier samples through a fleet in tests/engine/test_fleet.py
async def test_trajectories_are_token_exact_through_a_fleet(ray_local, tmp_path):
    """Two replica actors sample the episodes (turns may land on either): the same invariants hold, with
    the logprobs of the model the replicas loaded."""
    path = save_tiny(tmp_path / "model", "qwen3_moe", seed=0)
    engine = RecordingFleet(EngineConfig(replicas=2), EngineModel(str(path)))
    async with engine, RolloutController(config(), engine, chat()) as ctl:
        batch = await ctl.run_iteration()
    assert batch.stats.groups_finished == 2 and batch.stats.failed == 0
    model = tiny_model("qwen3_moe", seed=0).eval()
    for traj in batch.trajectories:
        assert len(traj.turns) == 3
        assert_token_exact(engine, traj, model)
    assert all(r.requests for r in engine.fleet_stats().replicas), "both replicas sampled"


# A scripted episode: two runs in the sandbox, then a submission that is graded.
SCRIPT = [
    {"name": "run_python", "arguments": {"code": "print(6 * 7)"}},
    {"name": "run_python", "arguments": {"code": "import sys; print('py', sys.version_info[0])"}},
    {"name": "submit", "arguments": {"code": "def solution():\n    return 0"}},
]


@pytest.fixture(scope="module")
def tool_caller():
    """A tiny Qwen3-MoE taught, on two tasks, to answer each turn with the script's tool call.

    A random-init model almost never writes a well-formed call; this one does, so its episodes
    carry real sandbox output. The training contexts come from the real env and sandboxes, the
    way the controller builds them; greedy decoding then replays the script.
    """
    fmt = chat()
    im_end = fmt.tokenizer.convert_tokens_to_ids("<|im_end|>")
    actions = [[*fmt.encode(f"<tool_call>\n{json.dumps(c)}\n</tool_call>"), im_end] for c in SCRIPT]

    async def contexts() -> tuple[list[str], list[tuple[list[int], list[int]]]]:
        env = agentrl.make("code_sandbox", max_turns=len(SCRIPT))
        task_ids = [t.id for t in itertools.islice(env.task_set, 2)]
        out = []
        for task_id in task_ids:
            obs, info = await env.areset(seed=0, options={"task_id": task_id})
            ids = fmt.prompt_ids(obs, tools=info["tools"])
            for action in actions:
                out.append((list(ids), action))
                obs, _, terminated, _, _ = await env.astep(fmt.decode(action))
                ids += action + fmt.observation_ids(obs, last_token=action[-1])
            assert terminated, "the script's last call submits"
        await env.aclose()
        return task_ids, out

    task_ids, examples = asyncio.run(contexts())
    # A task's contexts nest (each is the one before, its action and the env's reply), so each task is one
    # row with every action labelled: the same (context, target) pairs and loss as a row per turn, a third
    # of the compute (a causal model's prediction at a position sees only what precedes it).
    rows: list[tuple[list[int], list[tuple[int, list[int]]]]] = []
    for c, a in examples:
        if rows and c[: len(rows[-1][0])] == rows[-1][0]:
            rows[-1] = (c + a, [*rows[-1][1], (len(c), a)])
        else:
            rows.append((c + a, [(len(c), a)]))
    assert len(rows) == len(task_ids)
    L = max(len(seq) for seq, _ in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    labels, attention = torch.full_like(ids, -100), torch.zeros_like(ids)
    for i, (seq, targets) in enumerate(rows):
        ids[i, : len(seq)] = torch.tensor(seq)
        for start, a in targets:
            labels[i, start : start + len(a)] = torch.tensor(a)
        attention[i, : len(seq)] = 1
    model = tiny_model("qwen3_moe", seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(300):
        out = model(input_ids=ids, attention_mask=attention, labels=labels)
        target = labels[:, 1:] != -100
        if out.loss.item() < 0.03 and (out.logits[:, :-1].argmax(-1)[target] == labels[:, 1:][target]).all():
            break
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    else:
        pytest.fail(f"the tiny model did not learn the script (loss {out.loss.item():.3f})")
    return model.eval(), task_ids


@pytest.mark.slow  # trains a tool caller first; test_trajectories_are_token_exact is the fast tier's
async def test_token_exact_over_real_tool_calls(ray_local, tool_caller):
    """Every turn calls a tool that runs in a Docker sandbox; the trajectory stays token-exact."""
    model, task_ids = tool_caller
    engine = RecordingEngine(model)
    cfg = config(sampling=SamplingParams(temperature=0.0, max_tokens=64), env_kwargs={"max_turns": len(SCRIPT)})
    async with engine, RolloutController(cfg, engine, chat()) as ctl:
        batch = await ctl.run_iteration(task_ids=task_ids)
    assert sorted(g.task_id for g in batch.groups) == sorted(task_ids)
    for traj in batch.trajectories:
        deltas = assert_token_exact(engine, traj)
        assert len(traj.turns) == len(SCRIPT) and traj.terminated and traj.status is Status.FINISHED
        text = [chat().tokenizer.decode(d) for d in deltas]
        assert "<tool_response>" in text[0] and "42" in text[0], text[0]  # the sandbox ran print(6 * 7)
        assert "py 3" in text[1], text[1]
        assert "tests_total" in traj.turns[-1].info, "the submission was graded"


# the engine's context: slow (7 s), the same cut as the episode's budget's, named otherwise
@pytest.mark.parametrize("bound", ["episode_tokens", pytest.param("context", marks=pytest.mark.slow)])
async def test_budgets_truncate_before_the_model(ray_local, bound):
    """The episode's budget (`max_episode_tokens`) or the engine's context, whichever is smaller, cuts the episode
    before the model sees too much, and names itself as the truncation."""
    episode, context = (900, None) if bound == "episode_tokens" else (2000, 900)
    engine = RecordingEngine(tiny_model("qwen3_moe", seed=0), max_context=context)
    cfg = config(max_episode_tokens=episode, env_kwargs={"max_turns": 8})
    async with engine, RolloutController(cfg, engine, chat()) as ctl:
        batch = await ctl.run_iteration()
    for traj in batch.trajectories:
        assert traj.status is Status.FINISHED and len(traj.token_ids) <= 900
        assert traj.truncation in (bound, "env")
        for prompt, gen in engine.calls[traj.episode_id]:
            assert len(prompt) + len(gen.token_ids) <= 900
    assert any(t.truncation == bound for t in batch.trajectories)


async def test_partial_rollouts_park_and_resume_under_the_new_version(ray_local):
    model = tiny_model("qwen3_moe", seed=1)
    engine = RecordingEngine(model, shared=True, record_routing=True)  # a learner changes it in place
    # the iteration's token budget ends it mid-flight: all six episodes are parked
    cfg = config(
        partial=True,
        groups_per_iteration=1,
        max_groups_in_flight=3,
        env_kwargs={"max_turns": 4},
        sampling=SamplingParams(max_tokens=64),
        iteration_token_budget=300,
    )
    async with engine, RolloutController(cfg, engine, chat()) as ctl:
        first = await ctl.run_iteration()
        assert first.stats.parked == 6 and first.stats.generated_tokens >= 300
        parked = {t.episode_id for t in ctl.parked}
        # a turn aborted after some of its tokens (one aborted before its first token has none of version 0)
        open_turns = sum(t.turn_open and t.turns[-1].end > t.turns[-1].start for t in ctl.parked)
        await engine.update_weights()  # the shared module "changed": version 1
        batches = [first]
        while ctl.parked or len(batches) < 2:
            batches.append(await ctl.run_iteration(drain=True))
    resumed = [t for b in batches[1:] for t in b.trajectories if t.episode_id in parked]
    assert resumed and all(t.status is Status.FINISHED for t in resumed)
    assert any(t.policy_versions == [0, 1] for t in resumed), "a resumed trajectory holds both versions"
    assert max(b.stats.max_staleness for b in batches) == 1
    # nothing lost: every episode started came back exactly once
    seen = [t.episode_id for b in batches for t in b.trajectories]
    assert len(seen) == len(set(seen)) == 3 * cfg.group_size
    if open_turns:  # aborted mid-turn: that turn's tokens span both versions
        assert any(len({t.versions[i] for i in range(turn.start, turn.end)}) == 2 for t in resumed for turn in t.turns)
    for t in resumed:  # routing replay's record: every token the engine predicted, across the pause, in place
        assert len(t.routed_experts) == len(t.token_ids) and t.routed_experts[0] is None
        assert all(e is not None for e in t.routed_experts[1 : t.turns[-1].end])


@pytest.mark.slow  # the fast tier parks and resumes above, with staleness allowed
@pytest.mark.parametrize("max_staleness, ahead", [(0, 0), (1, 1)])  # ahead: an asynchronous run's async_level
async def test_stale_parked_trajectories_are_dropped_and_counted(ray_local, max_staleness, ahead):
    """One version behind now, and `ahead` more before the batch is trained: beyond the bound, dropped."""
    engine = HFEngine(tiny_model("qwen3_moe", seed=1), shared=True)  # a learner changes it in place
    cfg = config(
        partial=True,
        groups_per_iteration=1,
        max_groups_in_flight=3,
        max_staleness=max_staleness,
        iteration_token_budget=300,
        env_kwargs={"max_turns": 4},
        sampling=SamplingParams(max_tokens=64),
    )
    async with engine, RolloutController(cfg, engine, chat()) as ctl:
        await ctl.run_iteration()
        waiting = [p.trajectory for eps in ctl.state().groups.values() for p in eps]  # parked, or finished
        n_stale = sum(bool(t.policy_versions) for t in waiting)  # with tokens of the version about to go
        assert any(t.status is Status.RUNNING for t in waiting)
        await engine.update_weights()
        batch = await ctl.run_iteration(drain=True, ahead=ahead)
    assert batch.stats.dropped_stale == n_stale > 0
    dropped = [t for t in batch.trajectories if t.status is Status.DROPPED]
    assert len(dropped) == n_stale and not any(t.trainable for t in dropped)


@pytest.mark.slow  # the fast tier parks and resumes in one controller (above) and in tests/runs/
async def test_parked_episodes_continue_in_a_new_controller(ray_local):
    """The partial-rollout buffer of a checkpoint: a fresh controller (another process, after a
    restart) rebuilds each parked episode's env by replay and finishes it; a record that the
    replay contradicts is dropped, not continued on a different env state."""
    model = tiny_model("qwen3_moe", seed=1)
    cfg = config(
        partial=True,
        groups_per_iteration=1,
        max_groups_in_flight=3,
        env_kwargs={"max_turns": 4},
        sampling=SamplingParams(max_tokens=48),
        iteration_token_budget=400,
    )

    def answered(state: ControllerState) -> list:  # parked episodes with a turn the env answered
        eps = [p.trajectory for eps in state.groups.values() for p in eps]
        return [t for t in eps if t.status is Status.RUNNING and len(t.turns) - t.turn_open >= 1]

    async with HFEngine(model) as engine, RolloutController(cfg, engine, chat()) as ctl:
        for _ in range(8):  # how far episodes get before the budget stops an iteration depends on timing
            await ctl.run_iteration()
            saved = ControllerState.model_validate_json(ctl.state().model_dump_json())  # as a checkpoint stores it
            if len(answered(saved)) >= 2:
                break
    running = [p.trajectory for eps in saved.groups.values() for p in eps if p.trajectory.status is Status.RUNNING]
    replied = answered(saved)
    assert len(replied) >= 2, "two parked episodes have a turn the env answered"
    victim = replied[0]
    first_obs = victim.turns[0].end
    victim.token_ids[first_obs] = (victim.token_ids[first_obs] + 1) % 2000  # a record the env contradicts
    async with HFEngine(model, version=1) as engine, RolloutController(cfg, engine, chat()) as ctl:
        assert await ctl.restore(saved) == 1
        assert ctl.iteration == saved.iteration
        batches = []
        while ctl.parked or not batches:
            batches.append(await ctl.run_iteration(drain=True))
    by_id = {t.episode_id: t for b in batches for t in b.trajectories}
    assert by_id[victim.episode_id].status is Status.DROPPED
    resumed = [by_id[t.episode_id] for t in running if t.episode_id != victim.episode_id]
    assert resumed and all(t.status is Status.FINISHED for t in resumed)
    assert any(t.policy_versions[0] == 0 and t.policy_versions[-1] == 1 for t in resumed), "continued on the new engine"


# 55 s: the fast tier kills a local env worker (tests/rollout/test_local_pool.py), through the same failure handling
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["mask", "retry"])
async def test_killing_an_env_worker_fails_only_its_episodes(ray_local, mode):
    engine = HFEngine(tiny_model("qwen3_moe", seed=0))
    # long episodes (12 turns), so the victim's are still running when the kill lands
    cfg = config(on_infra_failure=mode, groups_per_iteration=3, env_kwargs={"max_turns": 12})
    async with engine, RolloutController(cfg, engine, chat()) as ctl:
        victim = ctl.workers[0]
        task = asyncio.create_task(ctl.run_iteration())
        while not any(engine._rows):  # wait until episodes are generating
            await asyncio.sleep(0.05)
        ray.kill(victim.actor)
        batch = await asyncio.wait_for(task, 300)
        assert victim not in ctl.workers  # replaced
    trajs = batch.trajectories
    assert len(trajs) == 6 and batch.stats.groups_finished == 3
    failed = [t for t in trajs if t.status is Status.FAILED]
    if mode == "mask":
        # the killed worker held every other episode (round robin): those fail, the rest finish
        assert len(failed) == batch.stats.failed == 3
        assert all(t.failure == "infra_error" and t.error for t in failed)
        assert all(t.status is Status.FINISHED for t in trajs if t not in failed)
    else:
        assert not failed and batch.stats.retried == 3
        assert all(t.status is Status.FINISHED for t in trajs)


@pytest.mark.slow  # the fast tier kills a worker mid-iteration above
async def test_a_worker_killed_between_iterations_is_replaced(ray_local):
    """A worker that dies while idle has no episode to notice it: the next iteration (whose task
    sampling asks worker 0) replaces it and runs in full."""
    engine = HFEngine(tiny_model("qwen3_moe", seed=0))
    async with engine, RolloutController(config(num_workers=1), engine, chat()) as ctl:
        await ctl.run_iteration()
        victim = ctl.workers[0]
        ray.kill(victim.actor)
        batch = await asyncio.wait_for(ctl.run_iteration(), 300)
        assert victim not in ctl.workers
    assert batch.stats.groups_finished == config().groups_per_iteration
    assert all(t.status is Status.FINISHED for t in batch.trajectories)


def test_config_rejects_impossible_settings():
    with pytest.raises(ValueError, match="partial"):
        RolloutConfig(partial=False, iteration_token_budget=100)
    with pytest.raises(ValueError, match="max_groups_in_flight"):
        RolloutConfig(groups_per_iteration=4, max_groups_in_flight=2)
    with pytest.raises(ValueError, match="group_sise"):
        RolloutConfig(group_sise=4)


POOL_TASKS = {"tasks": "procedural:levels=1;families=lists"}


@pytest.mark.slow  # the fast tier kills a worker under the controller (test_killing_an_env_worker_fails...)
async def test_a_killed_worker_is_replaced_and_its_callers_see_worker_died(ray_local):
    """The env-worker pool's contract on real Ray actors: a failed call raises `WorkerError`, a dead worker's
    `WorkerDied` after the pool has replaced it in its slot (here, in the module of the controller that uses it,
    whose Ray it shares)."""
    pool = RayEnvWorkerPool(RolloutConfig(env="code_sandbox", env_kwargs=POOL_TASKS, num_workers=2), SandboxConfig())
    await pool.start()
    try:
        a, b = pool.workers
        assert [pool.pick() for _ in range(4)] == [a, b, a, b]  # round robin
        tasks, again = await asyncio.gather(a.sample_tasks(3, 7), b.sample_tasks(3, 7))
        assert tasks == again  # the same draw from any worker

        # the env raising in a live worker (no such episode) is a WorkerError, and nothing is replaced
        with pytest.raises(WorkerError) as err:
            await a.step("no-such-episode", "hi")
        assert not isinstance(err.value, WorkerDied) and "no-such-episode" in str(err.value)
        assert pool.workers == [a, b]

        # a worker that died idle: the pool's task sampling meets it first, replaces it and asks the new one
        ray.kill(a.actor)
        assert await pool.sample_tasks(3, 7) == tasks
        fresh = pool.workers[0]
        assert fresh is not a and pool.workers[1] is b  # its slot, a new actor
        # a call still holding the dead worker: WorkerDied, and it is not replaced twice
        with pytest.raises(WorkerDied):
            await a.step("no-such-episode", "hi")
        await a.close("no-such-episode")  # its envs went with it: closing one is a no-op
        assert pool.workers == [fresh, b]
    finally:
        await pool.close()
    assert pool.workers == []
    await pool.close()  # safe twice
