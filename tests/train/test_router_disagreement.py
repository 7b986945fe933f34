"""Router disagreement: the engine's recorded top-k expert sets against the learner's, on every update.

Real tiny Qwen3-MoE models, real hf engine generations (docs/design.md §3, §8 invariant 22)."""

import asyncio
from collections import defaultdict

import pytest
import torch
from fsdp_worker import fixed_batch  # this directory is on sys.path

from agentrl.engine.base import Generation, SamplingParams
from agentrl.engine.hf import HFEngine
from agentrl.models.tiny import tiny_model
from agentrl.models.tokenizer import load_tokenizer
from agentrl.rollout import Group, Status, Trajectory
from agentrl.train.batch import TrainBatch, build_batch
from agentrl.train.config import AlgoConfig, OptimConfig, TrainerConfig
from agentrl.train.diagnostics import (
    ROUTER_TURNS,
    Metrics,
    RouterDisagreement,
    RowRecorder,
    ScoredMinibatch,
    router_disagreement,
    routing_differs,
)
from agentrl.train.replay import position_routing
from agentrl.train.scoring import Scorer
from agentrl.train.trainer import Trainer

MOE = dict(num_experts=64, num_experts_per_tok=8, num_hidden_layers=4)
"""more experts and layers than the default tiny model's 4 and 2: more set boundaries a bf16 rounding can move a
token across (8 to 17 of 512 pairs for seeds 0 to 3; the default's 0 or 1 of 256)"""
SEED = 0


def moe_model():
    return tiny_model("qwen3_moe", seed=SEED, **MOE)


async def rollouts(engine: HFEngine, episodes: int = 4, turns: int = 2, tokens: int = 16) -> list[Group]:
    """Two groups of multi-turn episodes sampled together by `engine`: prompt, then per turn a generation and an
    observation (the next turn's prompt is the trajectory itself)."""
    tok = load_tokenizer()
    prompts = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. " * 2]
    trajs = []
    for i in range(episodes):
        g = i % len(prompts)
        t = Trajectory(episode_id=str(i), group_id=str(g), task_id=str(g), sampling=SamplingParams())
        t.append_prompt(tok.encode(prompts[g]))
        trajs.append(t)
    for k in range(turns):
        params = [SamplingParams(max_tokens=tokens, seed=10 * i + k) for i in range(episodes)]
        gens = await asyncio.gather(
            *(engine.generate(list(t.token_ids), p) for t, p in zip(trajs, params, strict=True))
        )
        for i, (t, gen) in enumerate(zip(trajs, gens, strict=True)):
            t.append_generation(gen)
            t.turns[-1].reward = float(i + k)
            if k < turns - 1:
                t.append_observation(tok.encode(f" observation {k}: ok"))
    for i, t in enumerate(trajs):
        t.status, t.outcome_reward = Status.FINISHED, float(i)
    return [Group(str(g), str(g), [t for t in trajs if t.group_id == str(g)]) for g in range(len(prompts))]


def engine_learner_counts(trainer: Trainer, batch: TrainBatch) -> dict[str, tuple[int, int]]:
    """The counts behind the metrics, with the learner's weights as they are."""
    with torch.no_grad():
        _, _, router = trainer.scorer(batch.input_ids, batch.attention_mask, batch.sampling, router=True)
    return router_disagreement(
        batch.routed_experts, router, batch.loss_mask, batch.token_turns, batch.token_versions, policy_version=0
    )


def check_layout(groups: list[Group], batch: TrainBatch) -> None:
    """Every token but the first carries the engine's record of the position before it, prompt and observation
    tokens too (every turn's request ran the whole context); padding does not."""
    assert batch.routed_experts is not None and batch.routed_experts.dtype == torch.int16
    recorded = batch.attention_mask.bool().clone()
    recorded[:, 0] = False
    assert torch.equal(batch.routed_experts[..., 0, 0] >= 0, recorded)
    trajs = [t for g in groups for t in g.trainable]
    for i, t in enumerate(trajs):
        assert len(t.routed_experts) == len(t.token_ids) and t.routed_experts[0] is None
        assert batch.routed_experts[i, 1 : len(t.token_ids)].tolist() == t.routed_experts[1:]
        assert batch.token_turns[i, : len(t.turn_index)].tolist() == t.turn_index


async def test_an_fp32_engine_sharing_the_learner_s_weights_disagrees_on_no_routing():
    policy = moe_model()
    async with HFEngine(policy, shared=True, record_routing=True) as engine:
        groups = await rollouts(engine)
    batch, _ = build_batch(groups, AlgoConfig())
    check_layout(groups, batch)
    trainer = Trainer(TrainerConfig(optim=OptimConfig(minibatches=1)), policy)
    counts = engine_learner_counts(trainer, batch)
    layers, tokens = policy.config.num_hidden_layers, int(batch.loss_mask.sum())
    assert counts["router_disagreement"] == (0, tokens * layers)  # every (generated token, layer): the same set
    assert counts["router_disagreement_tokens"] == (0, tokens)
    assert counts["router_disagreement_lag0"] == (0, tokens * layers)
    everywhere = (batch.routed_experts[..., 0, 0] >= 0).long()  # prompt and observation positions too
    counts = router_disagreement(
        batch.routed_experts,
        trainer.scorer(batch.input_ids, batch.attention_mask, batch.sampling, router=True)[2],
        everywhere,
    )
    assert counts["router_disagreement"] == (0, int(everywhere.sum()) * layers) and everywhere.sum() > tokens
    metrics = trainer.update(batch)
    for key in (
        "router_disagreement",
        "router_disagreement_tokens",
        "router_disagreement_turn0",
        "router_disagreement_turn1",
    ):
        assert metrics[key] == 0.0, key


async def test_a_bf16_weights_engine_disagrees_on_some_routing():
    policy = moe_model()
    async with HFEngine(moe_model(), record_routing=True, bf16_weights=True) as engine:
        groups = await rollouts(engine)
    batch, _ = build_batch(groups, AlgoConfig())
    check_layout(groups, batch)
    trainer = Trainer(TrainerConfig(optim=OptimConfig(minibatches=1)), policy)
    differ, compared = engine_learner_counts(trainer, batch)["router_disagreement"]
    assert differ > 0 and compared == int(batch.loss_mask.sum()) * policy.config.num_hidden_layers
    metrics = trainer.update(batch)
    assert metrics["router_disagreement"] == pytest.approx(differ / compared, rel=1e-12)
    assert 0 < metrics["router_disagreement"] <= metrics["router_disagreement_tokens"] <= 1


def transcribed(
    routed: list, logits: list, loss_mask: list, turns: list, versions: list, policy_version: int
) -> dict[str, tuple[int, int]]:
    """The metrics' counts, one token and one layer at a time: token t's recorded set against the learner's
    top-k at position t − 1, as sets."""
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    B, L, layers, k = len(routed), len(routed[0]), len(routed[0][0]), len(routed[0][0][0])
    for b in range(B):
        for t in range(1, L):
            if not loss_mask[b][t] or routed[b][t][0][0] < 0:
                continue
            turn = f"turn{turns[b][t]}" if turns[b][t] < ROUTER_TURNS else "turn_later"
            groups = ["", f"_{turn}", f"_lag{policy_version - versions[b][t]}"]
            any_differs = False
            for layer in range(layers):
                row = logits[layer][b * L + t - 1]
                learner = set(sorted(range(len(row)), key=lambda e: -row[e])[:k])
                differs = learner != set(routed[b][t][layer])
                any_differs |= differs
                for g in groups:
                    counts[f"router_disagreement{g}"][0] += differs
                    counts[f"router_disagreement{g}"][1] += 1
            counts["router_disagreement_tokens"][0] += any_differs
            counts["router_disagreement_tokens"][1] += 1
    return {key: (d, n) for key, (d, n) in counts.items()}


def test_the_metric_is_its_transcription():
    """A hand-made batch and router logits: the vectorised counts are the loops' exactly, and the observer logs
    their shares."""
    g = torch.Generator().manual_seed(0)
    B, L, layers, k, E = 3, 12, 3, 2, 5
    loss_mask = torch.zeros(B, L, dtype=torch.long)
    loss_mask[:, 3:7], loss_mask[:, 8:] = 1, 1  # prompt 0..2, turn 0, an observation at 7, turn 1...
    loss_mask[2, 10:] = 0  # ... and padding
    turns = torch.tensor([[0] * 8 + [1, 1, 5, 5], [0] * 8 + [1, 1, 2, 2], [0] * 8 + [1, 1, -1, -1]])
    versions = torch.where(loss_mask.bool(), torch.randint(3, 6, (B, L), generator=g), -1)
    logits = tuple(torch.randn(B * L, E, generator=g) for _ in range(layers))
    learner = torch.stack([r.view(B, L, E).topk(k, -1).indices for r in logits], 2)  # (B, L, layers, k)
    routed = torch.rand(B, L, layers, E, generator=g).argsort(-1)[..., :k]  # random sets...
    agree = torch.rand(B, L, layers, 1, generator=g) < 0.6
    routed[:, 1:] = torch.where(agree[:, 1:], learner[:, :-1].flip(-1), routed[:, 1:])  # ...most the learner's
    routed = torch.where(loss_mask.bool()[..., None, None], routed, -1).to(torch.int16)
    routed[1, 4:6] = -1  # tokens without a record

    counts = router_disagreement(routed, logits, loss_mask, turns, versions, policy_version=6)
    expected = transcribed(
        routed.tolist(), [r.tolist() for r in logits], loss_mask.tolist(), turns.tolist(), versions.tolist(), 6
    )
    assert counts == expected
    d, n = counts["router_disagreement"]
    assert 0 < d < n and "router_disagreement_turn_later" in counts and "router_disagreement_lag3" in counts

    batch = TrainBatch(
        input_ids=torch.ones(B, L, dtype=torch.long),
        attention_mask=torch.ones(B, L, dtype=torch.long),
        loss_mask=loss_mask,
        old_logprobs=torch.zeros(B, L),
        advantages=torch.zeros(B, L),
        sampling=SamplingParams(),
        token_versions=versions,
        token_turns=turns,
        routed_experts=routed,
    )
    metrics = Metrics()
    scored = ScoredMinibatch(0, batch, [0, 1, 2], B, torch.zeros(B, L), torch.zeros(B, L), logits, policy_version=6)
    RouterDisagreement(k).minibatch(scored, metrics)
    logged = metrics.reduce(1)
    assert logged == pytest.approx({key: d / n for key, (d, n) in expected.items()}, rel=1e-12)
    with pytest.raises(ValueError, match="experts per token"):
        RouterDisagreement(k + 1).minibatch(scored, Metrics())


def test_the_trainer_logs_router_disagreement_only_when_the_batch_carries_routing():
    policy = tiny_model("qwen3_moe", seed=0)
    cfg = policy.config
    batch = fixed_batch()
    B, L = batch.input_ids.shape
    g = torch.Generator().manual_seed(1)
    routed = torch.rand(B, L, cfg.num_hidden_layers, cfg.num_experts, generator=g).argsort(-1)
    routed = routed[..., : cfg.num_experts_per_tok]
    batch.routed_experts = torch.where(batch.loss_mask.bool()[..., None, None], routed, -1).to(torch.int16)
    batch.token_turns = torch.where(batch.attention_mask.bool(), (torch.arange(L) >= 44).long().expand(B, L), -1)
    trainer = Trainer(TrainerConfig(optim=OptimConfig(minibatches=1)), policy)
    with torch.no_grad():
        _, _, router = trainer.scorer(batch.input_ids, batch.attention_mask, batch.sampling, router=True)
    counts = router_disagreement(batch.routed_experts, router, batch.loss_mask, batch.token_turns)
    metrics = trainer.update(batch)
    logged = {k: v for k, v in metrics.items() if k.startswith("router_disagreement")}
    assert logged == pytest.approx({key: d / n for key, (d, n) in counts.items()}, rel=1e-12)
    assert set(logged) == {
        "router_disagreement",
        "router_disagreement_tokens",
        "router_disagreement_turn0",
        "router_disagreement_turn1",
    }
    assert 0 < logged["router_disagreement"] < 1  # random records: most sets differ, a few agree

    # the rows the run saves carry, per token, the share of layers the learner routed otherwise (viewer colours)
    recorder, batch.episode_ids = RowRecorder({0, 1}, AlgoConfig()), [f"e{i}" for i in range(B)]
    fresh = Trainer(TrainerConfig(optim=OptimConfig(minibatches=1)), tiny_model("qwen3_moe", seed=0))
    fresh.update(batch, recorder)
    here, differ = routing_differs(batch.routed_experts, router, batch.loss_mask)
    for i in (0, 1):
        got = torch.tensor(recorder.stats[i].router_differs)
        n = len(got)
        expected = torch.full((B, L), -1.0)
        expected[here] = differ.float().mean(-1)
        assert torch.equal(got, expected[i, :n]) and (got > 0).any() and (got == -1).any()
        assert recorder.views(batch)[batch.episode_ids[i]].router_differs == [round(x, 3) for x in got.tolist()]

    # M = 2: minibatch 0 alone, scored before any step (minibatch 1 comes after the update's first step)
    two = Trainer(TrainerConfig(optim=OptimConfig(minibatches=2)), tiny_model("qwen3_moe", seed=0))
    first = batch.select(two._minibatches(batch)[0].rows)
    with torch.no_grad():
        _, _, router = two.scorer(first.input_ids, first.attention_mask, first.sampling, router=True)
    d, n = router_disagreement(first.routed_experts, router, first.loss_mask, first.token_turns)["router_disagreement"]
    assert two.update(batch)["router_disagreement"] == pytest.approx(d / n, rel=1e-12)

    batch.routed_experts = None  # a batch from an engine that records no routing
    assert not any(k.startswith("router_disagreement") for k in trainer.update(batch))
    dense = Trainer(TrainerConfig(optim=OptimConfig(minibatches=1)), tiny_model("qwen3", seed=0))
    assert not any(isinstance(o, RouterDisagreement) for o in dense.diagnostics)


def test_trajectories_align_each_request_s_routing_with_their_tokens():
    """Turn 2's request resends the context: its prompt routing (the latest) replaces turn 1's record of the
    same positions; an aborted piece and its continuation fill the turn's tokens in order."""
    t = Trajectory(episode_id="0", group_id="g", task_id="g", sampling=SamplingParams())
    t.append_prompt([1, 2, 3])
    e = lambda *xs: [[[x, x + 1]] for x in xs]  # noqa: E731  one layer, top-2
    t.append_generation(Generation([10], [-0.5], [0], "aborted", 3, routed_experts=e(3), prompt_routing=e(1, 2)))
    t.append_generation(Generation([11], [-0.5], [0], "stop", 4, routed_experts=e(5), prompt_routing=e(1, 2, 4)))
    t.append_observation([7])
    t.append_generation(Generation([12], [-0.5], [0], "stop", 6, routed_experts=e(9), prompt_routing=e(1, 2, 6, 7, 8)))
    assert t.routed_experts == [None, *e(1, 2, 6, 7, 8, 9)]
    t.status = Status.FINISHED
    batch, _ = build_batch([Group("g", "g", [t])], AlgoConfig())
    assert batch.routed_experts[0, :, 0].tolist() == [[-1, -1], *([x, x + 1] for x in (1, 2, 6, 7, 8, 9))]


def test_build_batch_leaves_records_it_cannot_align_out():
    """No record anywhere: no field; an old-format record (one entry per generated token, saved before prompt
    routing was recorded) fills the generated tokens; a record of any other length: that row is -1."""
    recorded, unrecorded, partial = (
        Trajectory(episode_id=str(i), group_id="g", task_id="g", sampling=SamplingParams()) for i in range(3)
    )
    for t in (recorded, unrecorded, partial):
        t.append_prompt([1, 2, 3])
        t.append_generation(Generation([10, 11], [-0.5] * 2, [0] * 2, "stop"))
        t.append_observation([7])
        t.append_generation(Generation([12], [-0.5], [0], "stop"))
        t.status = Status.FINISHED
    recorded.routed_experts = [[[0, 1]], [[2, 3]], [[1, 3]]]
    partial.routed_experts = [[[0, 1]]]
    assert build_batch([Group("g", "g", [unrecorded])], AlgoConfig())[0].routed_experts is None
    batch, _ = build_batch([Group("g", "g", [recorded, unrecorded, partial])], AlgoConfig())
    assert batch.routed_experts[0, :, 0].tolist() == [[-1, -1]] * 3 + [[0, 1], [2, 3], [-1, -1], [1, 3]]
    assert (batch.routed_experts[1:] == -1).all()
    assert batch.token_turns[0].tolist() == [0, 0, 0, 0, 0, 0, 1]
    assert batch.select([0]).routed_experts.shape == (1, 7, 1, 2)


# -- routing replay against a real engine's record (docs/design.md §3) ---------------------------------------


def scores(policy, batch: TrainBatch, replay: bool) -> torch.Tensor:
    """lp_θ of the batch, with the engine's recorded routing replayed (R3) or not."""
    scorer = Scorer(policy, replay=True)
    routing = position_routing(batch.routed_experts) if replay else None
    with torch.no_grad():
        return scorer(batch.input_ids, batch.attention_mask, batch.sampling, routing=routing)[0]


def mismatch(lp: torch.Tensor, batch: TrainBatch) -> tuple[float, float]:
    """The first minibatch's engine/learner mismatch: the mean over sequences of the k3 sequence KL (as
    `Mismatch` logs it), and the p99 of |lp_θ − lp_b| over generated tokens."""
    on = batch.loss_mask.bool()
    d = torch.where(on, lp - batch.old_logprobs, 0.0)
    k3 = torch.where(on, d.exp() - d - 1, 0.0).sum(-1) / on.sum(-1)
    return float(k3.mean()), float(d.abs()[on].quantile(0.99))


async def test_r3_on_an_fp32_engine_sharing_the_weights_changes_no_logprob():
    policy = moe_model()
    async with HFEngine(policy, shared=True, record_routing=True) as engine:
        groups = await rollouts(engine)
    batch, _ = build_batch(groups, AlgoConfig())
    plain, replayed = scores(policy, batch, replay=False), scores(policy, batch, replay=True)
    real = batch.attention_mask.bool()
    assert (position_routing(batch.routed_experts)[..., 0, 0] >= 0).sum() == real.sum() - len(batch)
    assert (plain - replayed).abs()[real].max() <= 1e-6


async def test_r3_lowers_a_bf16_engine_s_mismatch():
    """A bf16 engine routes some positions elsewhere than the fp32 learner; replaying its record lowers both the
    sequence KL and the p99 of |lp_θ − lp_b| on the same batch, and the trainer logs the lower KL."""
    policy = moe_model()
    async with HFEngine(moe_model().to(torch.bfloat16), record_routing=True) as engine:
        groups = await rollouts(engine)
    batch, _ = build_batch(groups, AlgoConfig())
    everywhere = (batch.routed_experts[..., 0, 0] >= 0).long()
    with torch.no_grad():
        router = Scorer(policy)(batch.input_ids, batch.attention_mask, batch.sampling, router=True)[2]
    differ, compared = router_disagreement(batch.routed_experts, router, everywhere)["router_disagreement"]
    kl, p99 = mismatch(scores(policy, batch, replay=False), batch)
    kl_r3, p99_r3 = mismatch(scores(policy, batch, replay=True), batch)
    print(f"disagreement {differ}/{compared}; seq KL {kl:.3g} -> {kl_r3:.3g}; p99 |Δlp| {p99:.3g} -> {p99_r3:.3g}")
    assert differ > 0
    assert kl_r3 < kl and p99_r3 < p99
    logged = {}
    for mode in ("none", "R3"):
        cfg = TrainerConfig(algo=AlgoConfig(routing_replay=mode), optim=OptimConfig(minibatches=1))
        logged[mode] = Trainer(cfg, moe_model()).update(batch)["mismatch_seq_kl"]
    # the trainer scores with its own kernels (shared prefix, buckets): a KL of ~1e-6 agrees to float noise, far
    # below the gap that replay makes
    noise = (kl - kl_r3) / 20
    assert logged["R3"] == pytest.approx(kl_r3, abs=noise) and logged["none"] == pytest.approx(kl, abs=noise)
