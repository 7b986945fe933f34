"""The rollout controller on real Ray env workers, real Docker sandboxes and the hf engine."""

import asyncio

import pytest
import ray
import torch

from agentrl.engine.base import Generation, SamplingParams
from agentrl.engine.hf import HFEngine
from agentrl.engine.sampling import token_logprobs
from agentrl.models.tiny import tiny_model
from agentrl.models.tokenizer import load_tokenizer
from agentrl.rollout import ChatFormat, RolloutConfig, RolloutController, Segment, Status

pytestmark = pytest.mark.docker


class RecordingEngine(HFEngine):
    """The real hf engine, keeping every prompt it received and every generation it returned."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: dict[str, list[tuple[list[int], Generation]]] = {}

    async def generate(self, prompt_ids, params, *, request_id=None):
        gen = await super().generate(prompt_ids, params, request_id=request_id)
        self.calls.setdefault(request_id, []).append((list(prompt_ids), gen))
        return gen


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def config(**kw) -> RolloutConfig:
    base = dict(
        env="code_sandbox", env_kwargs={"max_turns": 3}, group_size=2, groups_per_iteration=2, num_workers=2,
        sandboxes_per_worker=2, sampling=SamplingParams(max_tokens=24), max_episode_tokens=2000, partial=False,
    )  # fmt: skip
    return RolloutConfig(**{**base, **kw})


def chat() -> ChatFormat:
    return ChatFormat(load_tokenizer("qwen3"))


async def test_trajectories_are_token_exact(ray_local):
    engine = RecordingEngine(tiny_model("qwen3_moe", seed=0))
    async with engine, RolloutController(config(), engine, chat()) as ctl:
        batch = await ctl.run_iteration()
    assert batch.stats.groups_finished == 2 and batch.stats.failed == 0
    for traj in batch.trajectories:
        calls = engine.calls[traj.episode_id]
        assert len(calls) == len(traj.turns) == 3  # max_turns, one generation per turn
        rebuilt: list[int] = []
        for k, (prompt, gen) in enumerate(calls):
            assert prompt[: len(rebuilt)] == rebuilt, f"turn {k}: the prompt does not extend the last one"
            obs = prompt[len(rebuilt) :]
            if k:  # the env's reply, as a template delta
                assert set(traj.segments[len(rebuilt) : len(prompt)]) == {Segment.OBSERVATION}
                assert "<|im_start|>" in chat().tokenizer.decode(obs)
            rebuilt = prompt + gen.token_ids
            t = traj.turns[k]
            assert (t.start, t.end) == (len(prompt), len(rebuilt))
            assert traj.logprobs[t.start : t.end] == gen.logprobs and traj.versions[t.start : t.end] == gen.versions
        assert traj.token_ids == rebuilt
        assert traj.loss_mask == [int(s is Segment.GENERATED) for s in traj.segments]
        assert traj.truncated and traj.truncation == "env" and traj.status is Status.FINISHED
        assert traj.outcome_reward == pytest.approx(sum(t.reward for t in traj.turns))
        # the logprobs are the model's own, position by position (invariant 2 through the whole loop)
        with torch.no_grad():
            logits = engine.model(torch.tensor([traj.token_ids])).logits[0, :-1]
        lp = token_logprobs(logits, torch.tensor(traj.token_ids[1:]), traj.sampling)
        mask = torch.tensor(traj.loss_mask[1:]).bool()
        torch.testing.assert_close(lp[mask], torch.tensor(traj.logprobs[1:])[mask], atol=1e-4, rtol=0)
    assert traj.model_validate_json(traj.model_dump_json()) == traj  # serialisable


async def test_budgets_truncate_before_the_model(ray_local):
    engine = RecordingEngine(tiny_model("qwen3_moe", seed=0))
    cfg = config(max_episode_tokens=900, env_kwargs={"max_turns": 8})
    async with engine, RolloutController(cfg, engine, chat()) as ctl:
        batch = await ctl.run_iteration()
    for traj in batch.trajectories:
        assert traj.status is Status.FINISHED and len(traj.token_ids) <= 900
        assert traj.truncation in ("episode_tokens", "env")
        for prompt, gen in engine.calls[traj.episode_id]:
            assert len(prompt) + len(gen.token_ids) <= 900
    assert any(t.truncation == "episode_tokens" for t in batch.trajectories)


async def test_partial_rollouts_park_and_resume_under_the_new_version(ray_local):
    model = tiny_model("qwen3_moe", seed=1)
    engine = RecordingEngine(model)
    # the iteration's token budget ends it mid-flight: all six episodes are parked
    cfg = config(partial=True, groups_per_iteration=1, max_groups_in_flight=3, env_kwargs={"max_turns": 4},
                 sampling=SamplingParams(max_tokens=64), iteration_token_budget=300)  # fmt: skip
    async with engine, RolloutController(cfg, engine, chat()) as ctl:
        first = await ctl.run_iteration()
        assert first.stats.parked == 6 and first.stats.generated_tokens >= 300
        parked = {t.episode_id for t in ctl.parked}
        open_turns = sum(t.turn_open for t in ctl.parked)
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


async def test_stale_parked_trajectories_are_dropped_and_counted(ray_local):
    engine = HFEngine(tiny_model("qwen3_moe", seed=1))
    cfg = config(partial=True, groups_per_iteration=1, max_groups_in_flight=3, max_staleness=0,
                 iteration_token_budget=300, env_kwargs={"max_turns": 4},
                 sampling=SamplingParams(max_tokens=64))  # fmt: skip
    async with engine, RolloutController(cfg, engine, chat()) as ctl:
        await ctl.run_iteration()
        n_parked = sum(bool(t.policy_versions) for t in ctl.parked)
        await engine.update_weights()
        batch = await ctl.run_iteration(drain=True)
    assert batch.stats.dropped_stale == n_parked > 0
    dropped = [t for t in batch.trajectories if t.status is Status.DROPPED]
    assert len(dropped) == n_parked and not any(t.trainable for t in dropped)


@pytest.mark.parametrize("mode", ["mask", "retry"])
async def test_killing_an_env_worker_fails_only_its_episodes(ray_local, mode):
    engine = HFEngine(tiny_model("qwen3_moe", seed=0))
    cfg = config(on_infra_failure=mode, groups_per_iteration=3, env_kwargs={"max_turns": 6})
    async with engine, RolloutController(cfg, engine, chat()) as ctl:
        victim = ctl.workers[0]
        task = asyncio.create_task(ctl.run_iteration())
        while engine.version == 0 and not any(engine._rows):  # wait until episodes are generating
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        ray.kill(victim)
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


def test_config_rejects_impossible_settings():
    with pytest.raises(ValueError, match="partial"):
        RolloutConfig(partial=False, iteration_token_budget=100)
    with pytest.raises(ValueError, match="max_groups_in_flight"):
        RolloutConfig(groups_per_iteration=4, max_groups_in_flight=2)
    with pytest.raises(ValueError, match="group_sise"):
        RolloutConfig(group_sise=4)
