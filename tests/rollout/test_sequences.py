"""Trajectories of several token sequences: the record, the batch rows and their weights, the loss over them,
and the layouts that start sequences (thinking: strip, context folding). No env, no engine: the real chat format
and the real batch and loss code on hand-made records."""

from __future__ import annotations

import pytest
import torch

from agentrl.algo import policy_loss
from agentrl.engine.base import Generation, SamplingParams
from agentrl.env.grading import extract_code
from agentrl.env.parsers import HermesParser, without_thoughts
from agentrl.models.tokenizer import load_tokenizer
from agentrl.rollout import ChatFormat, Group, RolloutConfig, Segment, Status, Trajectory
from agentrl.rollout.chat import TemplatePrefixError
from agentrl.rollout.context import ContextLayout, Conversation
from agentrl.rollout.trajectory import SequenceReason
from agentrl.train.batch import build_batch
from agentrl.train.config import AlgoConfig

CHAT = ChatFormat(load_tokenizer("qwen3"))
OPENING = [{"role": "system", "content": "You solve tasks."}, {"role": "user", "content": "Add 2 and 3."}]


def gen(ids: list[int], lp: float = -0.5, finish: str = "stop") -> Generation:
    return Generation(token_ids=ids, logprobs=[lp] * len(ids), versions=[0] * len(ids), finish_reason=finish)


def record(episode: str, group: str, turns: list[tuple[int, float]], rerender_after: set[int] = frozenset()):
    """A finished trajectory: a 4-token prompt, then per turn (n generated tokens, reward) and a 2-token observation,
    or (after a turn in `rerender_after`) a new sequence whose 6-token prompt repeats context."""
    t = Trajectory(episode_id=episode, group_id=group, task_id=group, sampling=SamplingParams())
    t.append_prompt([1, 2, 3, 4])
    for k, (n, reward) in enumerate(turns):
        t.append_generation(gen(list(range(10 + 10 * k, 10 + 10 * k + n))))
        t.turns[-1].reward = reward
        if k + 1 < len(turns):
            if k in rerender_after:
                t.start_sequence([1, 2, 3, 4, 7, 7], SequenceReason.RERENDER)
            else:
                t.append_observation([5, 6])
    t.status, t.outcome_reward = Status.FINISHED, sum(r for _, r in turns)
    return t


def test_a_sequence_starts_after_a_finished_turn_and_its_prompt_is_context():
    t = record("e", "g", [(3, 0.0), (2, 1.0), (2, 0.0)], rerender_after={0})
    assert t.sequence_spans() == [(0, 7), (7, 19)] and t.context_start == 7
    assert t.context_ids == t.token_ids[7:] and t.context_ids[:6] == [1, 2, 3, 4, 7, 7]
    assert t.segments[7:13] == [Segment.PROMPT] * 6 and t.turn_index[7:13] == [1] * 6 and not any(t.loss_mask[7:13])
    assert t.episode_tokens == len(t.token_ids) - 6 and t.num_generated == 7
    # saved and read back, and a line saved before sequences existed (no key) reads as one sequence
    assert Trajectory.model_validate_json(t.model_dump_json()) == t
    old = t.model_dump(mode="json", exclude={"sequences"})
    assert Trajectory.model_validate(old).sequence_spans() == [(0, len(t.token_ids))]
    fresh = Trajectory(episode_id="x", group_id="g", task_id="g", sampling=SamplingParams())
    fresh.append_prompt([1])
    with pytest.raises(Exception, match="after a finished turn"):
        fresh.start_sequence([1], SequenceReason.FOLD)


def test_rows_per_sequence_each_generated_token_in_one_loss_mask_and_an_episode_weighs_one():
    two = record("two", "g", [(3, 0.0), (2, 1.0)], rerender_after={0})
    one = record("one", "g", [(4, 0.0), (2, 0.0)])
    batch, info = build_batch([Group("g", "g", [two, one])], AlgoConfig(advantage="turn"))
    assert (info.trajectories, info.sequences, len(batch)) == (2, 3, 3)
    assert batch.episode_ids == ["two", "two", "one"] and batch.row_offsets == [0, 7, 0]
    assert batch.row_weights.tolist() == [0.5, 0.5, 1.0]
    rows = [batch.input_ids[i, : batch.attention_mask[i].sum()].tolist() for i in range(3)]
    assert rows[0] + rows[1] == two.token_ids and rows[2] == one.token_ids
    assert int(batch.loss_mask[:2].sum()) == two.num_generated and int(batch.loss_mask[2].sum()) == one.num_generated
    # turn 1 of "two" (return 1) is trained in its own row only, with its turn's advantage
    on = batch.loss_mask[1].bool()
    assert batch.token_turns[1][on].eq(1).all() and batch.advantages[1][on].gt(0).all()
    # one-sequence episodes: no weights, and the rows are the trajectories exactly as before sequences existed
    b = record("b", "g", [(2, 1.0)])
    plain, _ = build_batch([Group("g", "g", [one, b])], AlgoConfig(advantage="turn"))
    assert plain.row_weights is None and plain.row_offsets == [0, 0]
    T = len(one.token_ids)
    for name, values, dtype in [
        ("input_ids", [one.token_ids, b.token_ids], torch.long),
        ("loss_mask", [one.loss_mask, b.loss_mask], torch.long),
        ("old_logprobs", [one.logprobs, b.logprobs], torch.float32),
        ("token_turns", [one.turn_index, b.turn_index], torch.long),
    ]:  # each trajectory one row, padded as it was before sequences existed
        fill = -1 if name == "token_turns" else 0
        expected = torch.stack([torch.tensor(v + [fill] * (T - len(v)), dtype=dtype) for v in values])
        assert torch.equal(getattr(plain, name), expected), name


def test_the_loss_weighs_an_episode_of_k_sequences_as_one_and_is_unchanged_without_weights():
    torch.manual_seed(0)
    lp, old = torch.randn(3, 5) * 0.01, torch.randn(3, 5) * 0.01
    mask, A = torch.ones(3, 5), torch.tensor([[1.0] * 5, [1.0] * 5, [-2.0] * 5])
    per_row = [
        policy_loss(lp[i : i + 1], old[i : i + 1], A[i : i + 1], mask[i : i + 1], mode="gspo_token")[0]
        for i in range(3)
    ]
    weighted, _ = policy_loss(lp, old, A, mask, mode="gspo_token", sequence_weights=torch.tensor([0.5, 0.5, 1.0]))
    torch.testing.assert_close(weighted, ((per_row[0] + per_row[1]) / 2 + per_row[2]) / 2)
    plain, _ = policy_loss(lp, old, A, mask, mode="gspo_token")
    ones, _ = policy_loss(lp, old, A, mask, mode="gspo_token", sequence_weights=None)
    assert torch.equal(plain, ones)
    torch.testing.assert_close(plain, torch.stack(per_row).mean())
    with pytest.raises(ValueError, match="sequence_weights"):
        policy_loss(lp, old, A, mask, mode="gspo_token", sequence_weights=torch.tensor([1.0, 0.0, 1.0]))


def test_thoughts_are_never_actions():
    text = '<think>maybe <tool_call>{"name": "submit", "arguments": {}}</tool_call>\n```python\nrm()\n```</think>ok'
    assert without_thoughts(text) == "ok" and not HermesParser().parse(text).calls and extract_code(text) is None
    after = text + '<tool_call>{"name": "run", "arguments": {}}</tool_call>'
    assert [c.name for c in HermesParser().parse(after).calls] == ["run"]
    assert without_thoughts("opened in the prompt</think>ok") == "ok" and without_thoughts("a<think>cut") == "a"


def test_a_template_that_renders_differently_each_time_is_refused():
    tok = load_tokenizer("qwen3")
    tok.chat_template = tok.chat_template + "{{ strftime_now('%f') }}"
    with pytest.raises(TemplatePrefixError, match="deterministic"):
        ChatFormat(tok)


def conversation(turns: int, says: str = "step {k}") -> tuple[Trajectory, Conversation]:
    """An episode of `turns` turns (the policy `says`, the env answers "result k") laid out as the controller lays
    it out (one sequence), the last one not answered yet."""
    conv = Conversation([*OPENING])
    t = Trajectory(episode_id="e", group_id="g", task_id="g", sampling=SamplingParams())
    t.append_prompt(CHAT.prompt_ids(conv.opening))
    for k in range(turns):
        t.append_generation(gen([*CHAT.encode(says.format(k=k)), CHAT.turn_end_id]))
        conv.turns.append([{"role": "assistant", "content": says.format(k=k)}])
        if k + 1 < turns:
            obs = [{"role": "user", "content": f"result {k}"}]
            conv.turns[-1] += obs
            t.append_observation(CHAT.observation_ids(obs, last_token=t.token_ids[-1]))
    return t, conv


def layout(**context) -> ContextLayout:
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=16), context=context)
    return ContextLayout(CHAT, cfg, max_context=4096)


def test_truncate_keeps_the_opening_and_the_last_turns_that_fit():
    t, conv = conversation(6)
    size = len(t.token_ids)
    lay = layout(max_tokens=size + 16, policy="truncate")  # the next observation pushes past fold_at
    plan = lay.after_turn(t, conv, [{"role": "user", "content": "result 5 " + "x " * 20}])
    assert plan.sequence is SequenceReason.FOLD and len(plan.ids) <= lay.fold_at
    kept = conv.first
    assert plan.info["dropped_turns"] == list(range(kept)) and 0 < kept <= 5
    assert plan.ids == CHAT.prompt_ids([*OPENING, *[m for turn in conv.turns[kept:] for m in turn]])
    one_more = CHAT.prompt_ids([*OPENING, *[m for turn in conv.turns[kept - 1 :] for m in turn]])
    assert len(one_more) > lay.fold_at  # the turn before the kept ones would not have fitted


def test_an_observation_larger_than_the_limit_is_cut_and_marked():
    t, conv = conversation(2)
    lay = layout(max_tokens=256, policy="truncate")
    plan = lay.after_turn(t, conv, [{"role": "user", "content": "line\n" * 2000}])
    assert plan.sequence is SequenceReason.FOLD and len(plan.ids) <= lay.fold_at and plan.info["cut_tokens"] > 1000
    assert "tokens cut to fit the context]" in CHAT.tokenizer.decode(plan.ids)
    assert "tokens cut" in conv.turns[-1][1]["content"]  # what later renderings show too


def test_summarize_asks_then_folds_and_refuses_an_empty_or_cut_summary():
    t, conv = conversation(3)
    lay = layout(max_tokens=len(t.token_ids) + 200, policy="summarize", summary_max_tokens=40)
    plan = lay.after_turn(t, conv, [{"role": "user", "content": "result 2 " + "x " * 200}])
    assert plan.summarize and plan.sequence is None and conv.turns[-1][-1]["content"] == lay.fold.summary_prompt
    t.append_observation(plan.ids)
    assert len(t.context_ids) + lay.fold.summary_max_tokens <= lay.limit  # the summary fits in this sequence
    conv.turns.append([{"role": "assistant", "content": "<think>hm</think>"}])
    assert lay.after_summary(conv, "stop").failure == "the summary turn was empty"
    conv.turns[-1] = [{"role": "assistant", "content": "I added numbers"}]
    assert "summary_max_tokens=40" in lay.after_summary(conv, "length").failure
    fold = lay.after_summary(conv, "stop")
    assert fold.sequence is SequenceReason.FOLD and fold.info["summarised_turns"] == [0, 1, 2, 3]
    assert "I added numbers" in CHAT.tokenizer.decode(fold.ids) and "step 0" not in CHAT.tokenizer.decode(fold.ids)


def test_strip_renders_as_served_and_keep_appends():
    t, conv = conversation(1, says="<think>plan</think>step {k}")
    obs = [{"role": "user", "content": "result 0"}]
    assert layout().after_turn(t, conv, obs).sequence is None  # keep: the record extended
    conv.turns[-1] = conv.turns[-1][:1]
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=16), thinking="strip")
    plan = ContextLayout(CHAT, cfg, 4096).after_turn(t, conv, obs)
    assert plan.sequence is SequenceReason.RERENDER and "plan" not in CHAT.tokenizer.decode(plan.ids)
    assert plan.ids == CHAT.prompt_ids([*OPENING, {"role": "assistant", "content": "<think>plan</think>step 0"}, *obs])


def test_folding_settings_are_checked_at_load():
    with pytest.raises(ValueError, match=r"raise context\.max_tokens to at least 1056"):
        RolloutConfig(sampling=SamplingParams(max_tokens=16), context={"max_tokens": 300, "policy": "summarize"})
    with pytest.raises(ValueError, match=r"Extra inputs"):
        RolloutConfig(context={"max_token": 300})


@pytest.mark.parametrize("advantage", ["outcome", "turn", "gigpo"])
def test_a_batch_of_episodes_that_ended_before_their_first_turn_has_nothing_to_learn(advantage):
    """An opening longer than `max_episode_tokens` (or the context) ends its episode, finished, before any turn: a
    batch of only such episodes is refused as nothing to learn from (the driver skips the update), never an index
    error that ends the run."""
    empty = []
    for e in ("a", "b"):
        t = Trajectory(episode_id=e, group_id="g", task_id="g", sampling=SamplingParams())
        t.append_prompt([1, 2, 3, 4])
        t.status, t.truncated, t.truncation = Status.FINISHED, True, "episode_tokens"
        empty.append(t)
    with pytest.raises(ValueError, match="generated a token"):
        build_batch([Group("g", "g", empty)], AlgoConfig(advantage=advantage))
    # beside an episode that took a turn, they stay in the batch (rows with nothing to train)
    batch, info = build_batch(
        [Group("g", "g", [*empty, record("c", "g", [(2, 1.0)])])], AlgoConfig(advantage=advantage)
    )
    assert info.trajectories == 3 and batch.loss_mask.sum(-1).tolist() == [0, 0, 2]


def test_strip_drops_a_thought_the_template_kept_once_a_user_message_follows():
    """Qwen3's template keeps the thoughts of turns after the last user message (a tool's reply does not count): a
    thought shown after a tool message must go from the context when the env next speaks as the user, even after a
    turn that did not think."""
    t, conv = conversation(0)
    lay = ContextLayout(CHAT, RolloutConfig(sampling=SamplingParams(max_tokens=16), thinking="strip"), 4096)
    for says, obs in [("<think>plan</think>call", "tool"), ("call", "tool"), ("done", "user")]:
        t.append_generation(gen([*CHAT.encode(says), CHAT.turn_end_id]))
        conv.turns.append([{"role": "assistant", "content": says}])
        plan = lay.after_turn(t, conv, [{"role": obs, "content": "5"}])
        if plan.sequence is None:
            t.append_observation(plan.ids)
        else:
            t.start_sequence(plan.ids, plan.sequence, new=plan.new)
        assert t.context_ids == CHAT.prompt_ids(conv.context())  # the context is the template's own rendering
    assert "plan" not in CHAT.tokenizer.decode(t.context_ids)


def test_a_sequence_after_a_turn_cut_by_length_counts_the_token_that_closes_it():
    """A turn cut by length is closed by the delta's end-of-turn token, new to the episode: `episode_tokens` counts
    it in a re-rendered sequence as it would in the record extended."""
    t, conv = conversation(0)
    says = "<think>plan</think>5 is"
    t.append_generation(gen(CHAT.encode(says), finish="length"))
    conv.turns.append([{"role": "assistant", "content": says}])
    obs = [{"role": "user", "content": "go on"}]
    extended = len(t.token_ids) + len(CHAT.observation_ids(obs, last_token=t.token_ids[-1]))
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=16), thinking="strip")
    plan = ContextLayout(CHAT, cfg, 4096).after_turn(t, conv, obs)
    assert plan.sequence is SequenceReason.RERENDER
    t.start_sequence(plan.ids, plan.sequence, new=plan.new)
    assert t.episode_tokens == extended
