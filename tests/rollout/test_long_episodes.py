"""Long episodes on the real controller: a thinking policy (tests/thinking_policy.py, on the hf engine) plays
code_sandbox in local env workers with bwrap sandboxes, its context re-rendered without earlier thoughts
(`thinking: strip`) or folded (`rollout.context`); a parked multi-sequence episode resumes by replay; and repo_fix
with 40 turns under a context limit trains end to end."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
from cli import agentrl, sets
from test_controller import RecordingEngine
from thinking_policy import ANSWER, REPLY, THOUGHT, save_thinking_policy, thinking_policy

from agentrl.engine.base import SamplingParams
from agentrl.engine.hf import HFEngine
from agentrl.engine.sampling import token_logprobs
from agentrl.env.base import FailureClass
from agentrl.env.registry import make
from agentrl.models.tokenizer import load_tokenizer
from agentrl.rollout import ChatFormat, RolloutConfig, RolloutController, Segment, Status
from agentrl.rollout.config import ContextConfig
from agentrl.sandbox import SandboxConfig
from agentrl.train.batch import build_batch
from agentrl.train.config import AlgoConfig

CHAT = ChatFormat(load_tokenizer("qwen3"))
TESTS = Path(__file__).parents[1]
BWRAP = SandboxConfig(backend="bwrap")


def config(turns: int = 3, **kw) -> RolloutConfig:
    base = dict(
        env="code_sandbox",
        env_kwargs={"max_turns": turns},
        group_size=2,
        groups_per_iteration=1,
        num_workers=1,
        sandboxes_per_worker=2,
        sampling=SamplingParams(max_tokens=8),
        max_episode_tokens=8000,
        partial=False,
        env_workers="local",
    )
    return RolloutConfig(**{**base, **kw})


async def conversation(traj, turns: int):
    """The episode's messages, from a fresh env stepped with what the policy wrote (the env is deterministic)."""
    env = make("code_sandbox", max_turns=turns)
    obs, info = await env.areset(options={"task_id": traj.task_id})
    answers = []
    for t in traj.turns:
        text = CHAT.decode(traj.generated_ids(t.index))
        answers.append(text)
        if not t.info.get("summary"):
            o, *_ = await env.astep(text)
            answers.append(o)
    return obs, info.get("tools"), answers


def assert_scored_as_sampled(model, traj) -> None:
    """Every sequence's generated tokens have the logprobs a fresh forward of that sequence gives."""
    for a, b in traj.sequence_spans():
        ids = torch.tensor([traj.token_ids[a:b]])
        with torch.no_grad():
            lp = token_logprobs(model(ids).logits[0, :-1], ids[0, 1:], traj.sampling)
        mask = torch.tensor(traj.loss_mask[a + 1 : b]).bool()
        torch.testing.assert_close(lp[mask], torch.tensor(traj.logprobs[a + 1 : b])[mask], atol=1e-4, rtol=0)


async def test_strip_starts_a_sequence_per_thinking_turn_each_the_templates_own_rendering(bwrap_runtime):
    model = thinking_policy()
    engine = RecordingEngine(model)
    async with engine, RolloutController(config(thinking="strip"), engine, CHAT, sandbox=BWRAP) as ctl:
        batch = await ctl.run_iteration()
        kept = await ctl.run_iteration(drain=True)  # nothing live: an empty drain
    assert not kept.groups
    for traj in batch.trajectories:
        assert traj.status is Status.FINISHED and len(traj.turns) == 3
        assert [s.reason for s in traj.sequences] == ["rerender", "rerender"]  # K turns that think: K sequences
        opening, tools, answers = await conversation(traj, 3)
        messages = list(opening)
        calls = engine.calls[traj.episode_id]
        for k, ((a, b), turn) in enumerate(zip(traj.sequence_spans(), traj.turns, strict=True)):
            assert a <= turn.start < turn.end == b  # turn k is generated in sequence k, and ends it
            prompt = traj.token_ids[a : turn.start]
            assert prompt == CHAT.prompt_ids(messages, tools=tools)  # the template's own rendering, as served
            assert calls[k][0] == prompt and calls[k][1].token_ids == traj.generated_ids(k)  # what the engine saw
            assert CHAT.tokenizer.decode(prompt).count(THOUGHT) == 0  # no earlier thought in the context
            assert CHAT.decode(traj.generated_ids(k)) == REPLY
            messages += [{"role": "assistant", "content": answers[2 * k]}, *answers[2 * k + 1]]
        assert_scored_as_sampled(model, traj)
    # every turn records the state it acted in, the last included: the group's first turns share the opening's
    keys = [[t.state_key for t in traj.turns] for traj in batch.trajectories]
    assert all(all(k) for k in keys) and keys[0][0] == keys[1][0] and keys[0][0] != keys[0][1]
    rows, info = build_batch(batch.groups, AlgoConfig(advantage="turn"))
    assert info.sequences == 6 and len(rows) == 6 and torch.allclose(rows.row_weights, torch.full((6,), 1 / 3))
    # each generated token in exactly one loss mask: the row of the sequence it was generated in
    assert int(rows.loss_mask.sum()) == sum(t.num_generated for t in batch.trajectories)
    for i, (episode, a) in enumerate(zip(rows.episode_ids, rows.row_offsets, strict=True)):
        traj = next(t for t in batch.trajectories if t.episode_id == episode)
        n = int(rows.attention_mask[i].sum())
        assert rows.loss_mask[i, :n].tolist() == traj.loss_mask[a : a + n]


@pytest.mark.parametrize("policy", ["truncate", pytest.param("summarize", marks=pytest.mark.slow)])
async def test_folding_keeps_every_sequence_under_the_limit(bwrap_runtime, policy):
    model = thinking_policy()
    obs, info = await make("code_sandbox").areset(seed=0)
    opening = len(CHAT.prompt_ids(obs, tools=info.get("tools")))
    # the opening and about four turns fit (a turn and its reply: ~45 tokens); 9 turns do not
    extra = 120 if policy == "summarize" else 0
    context = ContextConfig(max_tokens=opening + 200 + extra, policy=policy, summary_max_tokens=16)
    cfg = config(turns=9, context=context, group_size=1)
    engine = RecordingEngine(model)
    async with engine, RolloutController(cfg, engine, CHAT, sandbox=BWRAP) as ctl:
        batch = await ctl.run_iteration([info["task_id"]])
    (traj,) = batch.trajectories
    assert traj.status is Status.FINISHED and traj.truncation == "env", traj.error
    assert traj.sequences and {s.reason for s in traj.sequences} == {"fold"}
    assert all(b - a <= context.max_tokens for a, b in traj.sequence_spans())
    summaries = [t for t in traj.turns if t.info.get("summary")]
    env_turns = len(traj.turns) - len(summaries)
    assert env_turns == 9  # a summary turn is the policy's, never the env's
    if policy == "summarize":
        assert len(summaries) == len(traj.sequences) and all(t.reward == 0 for t in summaries)
        for s in traj.sequences:  # each fold's context: the opening and the summary the policy wrote, trained
            assert ANSWER in CHAT.tokenizer.decode(traj.token_ids[s.start : s.start + s.prompt])
            assert s.info["policy"] == "summarize"
        assert all(traj.loss_mask[t.start : t.end] == [1] * (t.end - t.start) for t in summaries)
    else:
        opening_ids = traj.token_ids[: traj.turns[0].start]
        for s in traj.sequences:  # the opening kept, the first turns dropped
            assert traj.token_ids[s.start : s.start + len(opening_ids) - 3] == opening_ids[:-3]
            assert s.info["policy"] == "truncate" and s.info["dropped_turns"]
    assert_scored_as_sampled(model, traj)
    assert {Segment(x) for x in traj.segments} == {Segment.PROMPT, Segment.GENERATED, Segment.OBSERVATION}


@pytest.mark.slow  # the fast tier is over its budget; strip and truncate cover the layout
async def test_a_parked_episode_of_several_sequences_resumes_by_replay(bwrap_runtime):
    # the iteration stops after ~5 turns' tokens: 4 episodes parked in their second turn, or just before it
    cfg = config(turns=4, thinking="strip", partial=True, iteration_token_budget=30, max_groups_in_flight=2)
    async with RecordingEngine(thinking_policy()) as engine, RolloutController(cfg, engine, CHAT, sandbox=BWRAP) as ctl:
        await ctl.run_iteration()
        state = ctl.state()
    parked = [p.trajectory for eps in state.groups.values() for p in eps if p.trajectory.status is Status.RUNNING]
    assert parked and all(t.sequences for t in parked), "every episode parked after its first sequence"
    async with (
        RecordingEngine(thinking_policy()) as engine,
        RolloutController(cfg, engine, CHAT, sandbox=BWRAP) as again,
    ):
        assert await again.restore(state) == 0  # every parked episode replayed as recorded
        batch = await again.run_iteration(drain=True)
    resumed = {t.episode_id: t for t in batch.trajectories}
    for before in parked:
        after = resumed[before.episode_id]
        assert after.status is Status.FINISHED and after.token_ids[: len(before.token_ids)] == before.token_ids
        assert len(after.sequences) == len(after.turns) - 1 == 3


@pytest.mark.slow
async def test_an_env_that_names_no_state_fails_its_episodes_counted(bwrap_runtime, monkeypatch):
    """An env that declares names_states and then gives no state_key (tests/agent_programs.py's `forgetful`): each
    episode fails after its first turn, counted, never scored."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))  # the env workers import agent_programs
    cfg = config(env="agent_programs:forgetful", env_kwargs={})
    async with HFEngine(thinking_policy()) as engine, RolloutController(cfg, engine, CHAT, sandbox=BWRAP) as ctl:
        batch = await ctl.run_iteration()
    assert batch.stats.failed == 2 and not any(t.trainable for t in batch.trajectories)
    for t in batch.trajectories:
        assert t.failure is FailureClass.AGENT and "gave no info['state_key']" in t.error and len(t.turns) == 1


async def test_a_non_finite_reward_fails_its_episode_as_the_env_s_never_the_batch(bwrap_runtime, monkeypatch):
    """An env whose reward is NaN (tests/agent_programs.py's `nan_reward`): each episode fails as an infrastructure
    failure, counted, never scored (a NaN in a group would make every advantage of the group NaN)."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))  # the env workers import agent_programs
    cfg = config(env="agent_programs:nan_reward", env_kwargs={}, on_infra_failure="mask")
    async with HFEngine(thinking_policy()) as engine, RolloutController(cfg, engine, CHAT, sandbox=BWRAP) as ctl:
        batch = await ctl.run_iteration()
    assert batch.stats.failed == 2 and not any(t.trainable for t in batch.trajectories)
    for t in batch.trajectories:
        assert t.failure is FailureClass.INFRA and "returned a reward of nan" in t.error, t.error


@pytest.mark.slow
def test_repo_fix_with_40_turns_under_a_context_limit_trains(tmp_path, bwrap_runtime):
    save_thinking_policy(tmp_path / "model")
    out = agentrl(
        "train",
        "--env",
        "repo_fix",
        *sets(
            "model.path=model",
            "out=run",
            "iterations=1",
            "rollout.partial=false",
            "rollout.env_kwargs={max_turns: 40}",
            "rollout.group_size=2",
            "rollout.groups_per_iteration=1",
            "rollout.num_workers=1",
            "rollout.sandboxes_per_worker=2",
            "rollout.env_workers=local",
            "rollout.sampling.max_tokens=8",
            "rollout.context.max_tokens=2400",
            "rollout.max_episode_tokens=12000",
            "sandbox.backend=bwrap",
            "eval.tasks=0",
            "eval.benchmarks=[]",
            "checkpoint.export_final=false",
            "log.trajectories_per_iteration=2",
        ),
        cwd=tmp_path,
        timeout=600,
    )
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "train/loss" in m]
    assert len(trained) == 1, out.stdout
    assert all(m["rollout/folds"] > 0 and m["rollout/sequences"] > 1 for m in metrics)
    for path in (tmp_path / "run" / "trajectories").glob("iter-*.jsonl"):
        for line in path.read_text().splitlines():
            t = json.loads(line)
            assert len(t["turns"]) == 40 and t["sequences"]
            starts = [0, *(s["start"] for s in t["sequences"]), len(t["token_ids"])]
            assert max(b - a for a, b in itertools.pairwise(starts)) <= 2400
            assert t["trained"] and len(t["trained"]["sequence_ratios"]) == len(t["sequences"]) + 1
    shutil.rmtree(tmp_path / "run" / "checkpoints", ignore_errors=True)
