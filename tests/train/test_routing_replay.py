"""Routing replay (algo.routing_replay, agentrl.train.replay): the learner's MoE layers route to given top-k sets,
their gate weights recomputed from its own router logits. Tiny real Qwen3-MoE, Qwen2-MoE and Mixtral models."""

import math

import pytest
import torch
from fsdp_worker import fixed_batch  # this directory is on sys.path
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from agentrl.engine.base import SamplingParams
from agentrl.models.lora import LoraSettings, with_lora
from agentrl.models.tiny import tiny_model
from agentrl.train.config import AlgoConfig, OptimConfig, TrainerConfig
from agentrl.train.diagnostics import ScoredMinibatch, UpdateObserver
from agentrl.train.policy import causal_lm, checkpoint_activations
from agentrl.train.replay import SUPPORTED, gate_normalises, own_routing, position_routing, replay_gate
from agentrl.train.scoring import Scorer
from agentrl.train.trainer import Trainer

ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral"]
SMALL = dict(vocab_size=2048, pad_token_id=0, bos_token_id=1, eos_token_id=1)  # fixed_batch's ids are below 2000
PARAMS = SamplingParams(temperature=0.9)
ATOL = 1e-6


def moe(arch: str, *, seed: int = 0, experts: int = 4) -> PreTrainedModel:
    """A tiny model of `arch` in float32, in training mode. Qwen2-MoE, not among agentrl's tiny models, at their
    sizes, with its shared expert and its default un-normalised gate."""
    if arch != "qwen2_moe":
        count = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts"}[arch]
        return tiny_model(arch, seed=seed, **SMALL, **{count: experts}).train()
    config = AutoConfig.for_model(
        "qwen2_moe",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=experts,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        **SMALL,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def inputs(B: int = 3, L: int = 20, P: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that share their first P tokens, of lengths L, L − 3, L − 6."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 2000, (B, L), generator=g)
    ids[:, :P] = ids[0, :P]
    mask = (torch.arange(L)[None] < torch.tensor([L - 3 * i for i in range(B)])[:, None]).long()
    return ids * mask, mask


def learners_routing(scorer: Scorer, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, L, layers, k): the policy's own top-k sets, from a plain forward's router logits."""
    with torch.no_grad():
        _, _, router = scorer(ids, mask, PARAMS, router=True)
    return own_routing(router, mask, causal_lm(scorer.policy).config.num_experts_per_tok)


def other_routing(like: torch.Tensor, experts: int, prefix: int, seed: int = 1) -> torch.Tensor:
    """Random sets shaped like `like` (the same for every row over the first `prefix` positions, as an engine's
    prefix cache gives), with every fifth position unrecorded (-1) and -1 where `like` is."""
    g = torch.Generator().manual_seed(seed)
    B, L, layers, k = like.shape
    sets = torch.rand(B, L, layers, experts, generator=g).argsort(-1)[..., :k].to(torch.int16)
    sets[:, :prefix] = sets[:1, :prefix]
    sets[:, ::5] = -1
    return torch.where(like >= 0, sets, -1)


def scored(
    scorer: Scorer, ids: torch.Tensor, mask: torch.Tensor, routing: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """lp (B, L) and each parameter's gradient of Σ lp over the real positions."""
    scorer.policy.zero_grad(set_to_none=True)
    lp = scorer(ids, mask, PARAMS, routing=routing)[0]
    (lp * mask).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in scorer.policy.named_parameters() if p.grad is not None}


def assert_same(a: tuple[torch.Tensor, dict], b: tuple[torch.Tensor, dict]) -> None:
    torch.testing.assert_close(a[0], b[0], atol=ATOL, rtol=0)
    assert a[1].keys() == b[1].keys()
    for name, grad in a[1].items():
        torch.testing.assert_close(grad, b[1][name], atol=ATOL, rtol=0, msg=name)


def transcribed_gate(logits: list[list[float]], indices: list[list[int]], normalize: bool) -> list[list[float]]:
    """One row at a time: p_e = exp(l_e) / Σ_e' exp(l_e'), the chosen p_e, divided by their sum if normalised."""
    out = []
    for row, chosen in zip(logits, indices, strict=True):
        z = sum(math.exp(x) for x in row)
        p = [math.exp(row[e]) / z for e in chosen]
        out.append([x / sum(p) for x in p] if normalize else p)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_the_gate_is_its_transcription_and_on_the_router_s_own_set_the_router_s_output(arch):
    model = moe(arch)
    normalize = gate_normalises(model.config)
    assert normalize == (arch != "qwen2_moe")  # Qwen2-MoE's norm_topk_prob is off by default, Mixtral has none
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 4, generator=g, dtype=torch.float64).float() * 3
    indices = torch.rand(50, 4, generator=g).argsort(-1)[:, :2]
    for norm in (True, False):
        expected = torch.tensor(transcribed_gate(logits.tolist(), indices.tolist(), norm))
        torch.testing.assert_close(replay_gate(logits, indices, norm), expected, atol=1e-6, rtol=0)
    gate = model.model.layers[0].mlp.gate
    logits, scores, chosen = gate(torch.randn(50, 64, generator=g))
    assert torch.equal(replay_gate(logits, chosen, normalize).to(scores.dtype), scores)
    assert not torch.equal(replay_gate(logits, chosen, not normalize), scores)


def test_the_rule_follows_norm_topk_prob():
    for arch in ("qwen3_moe", "qwen2_moe"):
        assert {gate_normalises(AutoConfig.for_model(arch, norm_topk_prob=n)) for n in (True, False)} == {True, False}
    assert gate_normalises(AutoConfig.for_model("mixtral"))


def test_the_position_view_moves_each_record_to_the_position_that_predicted_its_token():
    routed = torch.tensor([[[[-1, -1]], [[0, 1]], [[2, 3]], [[-1, -1]]]], dtype=torch.int16)  # (1, 4, 1, 2)
    assert position_routing(routed)[0, :, 0].tolist() == [[0, 1], [2, 3], [-1, -1], [-1, -1]]


@pytest.mark.parametrize("arch", ARCHS)
def test_replaying_the_learner_s_own_routing_changes_nothing(arch):
    """Plain, with the shared prefix, and under activation checkpointing: lp and every gradient as without replay.
    A forward without a routing is the model's without replay installed, bit for bit."""
    ids, mask = inputs()
    model = moe(arch)
    without = scored(Scorer(moe(arch), min_shared_prefix=10**9), ids, mask)
    for shared in (10**9, 4):
        scorer = Scorer(model, replay=True, min_shared_prefix=shared)
        own = learners_routing(scorer, ids, mask)
        assert scorer._shared_prefix(ids, mask, own) == (0 if shared > 10 else 10)
        assert_same(scored(scorer, ids, mask, own), scored(scorer, ids, mask))
    unrouted = scored(Scorer(model, replay=True, min_shared_prefix=10**9), ids, mask)
    assert torch.equal(unrouted[0], without[0])
    assert all(torch.equal(g, without[1][n]) for n, g in unrouted[1].items())
    checkpoint_activations(model)
    scorer = Scorer(model, replay=True)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    assert_same(scored(scorer, ids, mask, learners_routing(scorer, ids, mask)), scored(scorer, ids, mask))


@pytest.mark.parametrize("arch", ARCHS)
def test_replaying_other_sets_is_the_same_plain_shared_and_checkpointed(arch):
    """Other sets than the learner's change lp; activation checkpointing (its recomputation routes as the forward
    did) gives the plain replay's lp and gradients, and the shared-prefix scorer (used: the rows' prefix routing
    agrees) too, to the summation order of the prefix's gradients (test_trainer's tolerance). Rows whose prefix
    routing differs are not shared."""
    ids, mask = inputs()
    plain, shared = (
        Scorer(moe(arch), replay=True, min_shared_prefix=10**9),
        Scorer(moe(arch), replay=True, min_shared_prefix=4),
    )
    routing = other_routing(learners_routing(plain, ids, mask), 4, prefix=10)
    assert shared._shared_prefix(ids, mask, routing) == 10
    expected = scored(plain, ids, mask, routing)
    assert (expected[0] - scored(plain, ids, mask)[0]).abs().max() > 1e-3
    lp, grads = scored(shared, ids, mask, routing)
    torch.testing.assert_close(lp, expected[0], atol=1e-5, rtol=0)
    assert grads.keys() == expected[1].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[1][name], atol=1e-4, rtol=1e-4, msg=name)
    checkpointed = moe(arch)
    checkpoint_activations(checkpointed)
    assert_same(scored(Scorer(checkpointed, replay=True), ids, mask, routing), expected)
    apart = routing.clone()
    apart[1, 3] = (apart[1, 3] + 1) % 4  # row 1 routes position 3 elsewhere: share positions 0..2 only
    assert shared._shared_prefix(ids, mask, apart) == 0  # below min_shared_prefix


@pytest.mark.parametrize("arch", ARCHS)
def test_only_the_recorded_experts_learn_from_a_position_and_the_router_still_learns(arch):
    """Two tokens: lp of token 1 is conditioned by position 0 alone. Replaying at position 0 the experts the
    learner would not choose there, in every layer: those experts get gradients, the others exactly none (also
    those position 1 routes to), and the router's weights get some."""
    model = moe(arch)
    scorer = Scorer(model, replay=True)
    ids, mask = torch.tensor([[17, 905]]), torch.ones(1, 2, dtype=torch.long)
    own = learners_routing(scorer, ids, mask)
    E = 4
    others = torch.tensor([[e for e in range(E) if e not in s] for s in own[0, 0].tolist()], dtype=torch.int16)
    routing = torch.full_like(own, -1)
    routing[0, 0] = others  # position 1 keeps its own routing
    lp, _ = scored(scorer, ids, mask, routing)
    assert abs(lp[0, 1] - scored(scorer, ids, mask)[0][0, 1]) > 1e-4
    scored(scorer, ids, mask, routing)
    for j, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        for e in range(E):
            learned = [float(p.grad[e].abs().sum()) for p in (experts.gate_up_proj, experts.down_proj)]
            if e in others[j].tolist():
                assert min(learned) > 0, (j, e)
            else:
                assert learned == [0.0, 0.0], (j, e)
        assert layer.mlp.gate.weight.grad.abs().sum() > 0
    assert set(own[0, 1].flatten().tolist()) - set(others.flatten().tolist())  # position 1 uses some of the others


def test_lora_with_expert_adapters_replays_and_its_adapters_learn():
    policy = with_lora(moe("qwen3_moe").eval(), LoraSettings(rank=4, experts=True)).train()
    scorer = Scorer(policy, replay=True, min_shared_prefix=4)
    ids, mask = inputs()
    own = learners_routing(scorer, ids, mask)
    plain = scored(scorer, ids, mask)
    assert_same(scored(scorer, ids, mask, own), plain)
    lp, grads = scored(scorer, ids, mask, other_routing(own, 4, prefix=10))
    assert (lp - plain[0]).abs().max() > 1e-3
    for kind in ("self_attn", "mlp.experts"):
        adapters = [g for n, g in grads.items() if kind in n and "lora_B" in n]
        assert adapters and all(g.abs().sum() > 0 for g in adapters), kind


def trainer(replay: str, minibatches: int, *, arch: str = "qwen3_moe", experts: int = 4, **algo) -> Trainer:
    cfg = TrainerConfig(
        algo=AlgoConfig(routing_replay=replay, **algo), optim=OptimConfig(lr=1e-2, minibatches=minibatches)
    )
    return Trainer(cfg, moe(arch, experts=experts).eval())


def params(t: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in t.policy.named_parameters()}


def token_record(routing: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The token-indexed record (`TrainBatch.routed_experts`) of position-indexed sets: at real token t ≥ 1 the sets
    of position t − 1, -1 elsewhere."""
    shifted = torch.cat([torch.full_like(routing[:, :1], -1), routing[:, :-1]], 1)
    return torch.where(mask.bool()[..., None, None], shifted, -1)


class AtMinibatch(UpdateObserver):
    """Calls `check` with minibatch m's scoring (after m steps)."""

    def __init__(self, m: int, check) -> None:
        self.m, self.check, self.calls = m, check, 0

    def minibatch(self, s: ScoredMinibatch, metrics) -> None:
        if s.index == self.m:
            self.check(s)
            self.calls += 1


def test_r3_on_the_learner_s_own_routing_is_the_plain_update():
    """The engine's record is the learner's own routing (an fp32 engine sharing its weights): R3 trains as none,
    and replays every real position but each row's last (it predicts nothing)."""
    batch = fixed_batch()
    plain, r3 = trainer("none", 1), trainer("R3", 1)
    batch.routed_experts = token_record(
        learners_routing(r3.scorer, batch.input_ids, batch.attention_mask), batch.attention_mask
    )
    plain.update(batch)
    metrics = r3.update(batch)
    after = params(plain)
    for name, value in params(r3).items():
        torch.testing.assert_close(value, after[name], atol=ATOL, rtol=0, msg=name)
    real = int(batch.attention_mask.sum())
    assert metrics["routing_replayed"] == pytest.approx((real - len(batch)) / real, rel=1e-12)


def test_r3_replays_the_engine_s_routing_in_the_proximal_pass_too():
    """Decoupled, M = 2: minibatch 1's lp_prox is scored before the first step with the engine's sets replayed, and
    its training forward replays them too."""
    batch = fixed_batch()
    t = trainer("R3", 2, behaviour_weight="truncate")
    before = Scorer(moe("qwen3_moe"), replay=True)  # the weights before the update
    own = learners_routing(before, batch.input_ids, batch.attention_mask)
    batch.routed_experts = token_record(other_routing(own, 4, prefix=36), batch.attention_mask)
    positions = position_routing(batch.routed_experts)

    def check(s: ScoredMinibatch) -> None:
        mb = batch.select(s.rows)
        mine = positions[s.rows, : mb.input_ids.shape[1]]
        with torch.no_grad():
            replayed = before(mb.input_ids, mb.attention_mask, mb.sampling, routing=mine)[0]
            unreplayed = before(mb.input_ids, mb.attention_mask, mb.sampling)[0]
            trained = t.scorer(mb.input_ids, mb.attention_mask, mb.sampling, routing=mine)[0]
        torch.testing.assert_close(s.old_logprobs, replayed, atol=ATOL, rtol=0)
        assert (s.old_logprobs - unreplayed).abs().max() > 1e-3
        torch.testing.assert_close(s.logprobs.detach(), trained, atol=ATOL, rtol=0)

    observer = AtMinibatch(1, check)
    t.update(batch, observer)
    assert observer.calls == 1


def test_r2_is_a_no_op_at_one_minibatch():
    plain, r2 = trainer("none", 1), trainer("R2", 1)
    plain.update(fixed_batch())
    metrics = r2.update(fixed_batch())
    after = params(plain)
    assert all(torch.equal(v, after[n]) for n, v in params(r2).items())
    assert metrics["routing_replayed"] == 0


def test_r2_routes_later_minibatches_as_the_learner_did_before_the_update():
    """M = 2: minibatch 1, scored after the first step, routes to the sets the learner chose before the update
    (recorded here beforehand), which the step changed for some positions."""
    batch = fixed_batch()
    t = trainer("R2", 2, experts=8)
    before = learners_routing(t.scorer, batch.input_ids, batch.attention_mask)

    def check(s: ScoredMinibatch) -> None:
        mb = batch.select(s.rows)
        L = mb.input_ids.shape[1]
        now = learners_routing(t.scorer, mb.input_ids, mb.attention_mask)
        assert (now != before[s.rows, :L]).any()  # the step moved some sets: replaying them changes something
        with torch.no_grad():
            replayed = t.scorer(mb.input_ids, mb.attention_mask, mb.sampling, routing=before[s.rows, :L])[0]
            unreplayed = t.scorer(mb.input_ids, mb.attention_mask, mb.sampling)[0]
        torch.testing.assert_close(s.logprobs.detach(), replayed, atol=ATOL, rtol=0)
        assert (s.logprobs.detach() - unreplayed).abs().max() > 1e-6

    observer = AtMinibatch(1, check)
    metrics = t.update(batch, observer)
    assert observer.calls == 1
    shares = t._minibatches(batch)
    real = [int(s.batch.attention_mask.sum()) for s in shares]
    assert metrics["routing_replayed"] == pytest.approx(real[1] / sum(real), rel=1e-12)  # minibatch 0: none


def test_what_cannot_be_replayed_is_refused():
    with pytest.raises(ValueError, match=r"engine\.record_routing: true"):
        trainer("R3", 2).update(fixed_batch())
    for dense in ("qwen3", "llama"):
        with pytest.raises(ValueError, match=", ".join(SUPPORTED)):
            Trainer(TrainerConfig(algo=AlgoConfig(routing_replay="R2")), tiny_model(dense, seed=0))
    ids, mask = inputs()
    with pytest.raises(ValueError, match="replay=True"):
        Scorer(moe("mixtral")).forward(ids, mask, PARAMS, routing=torch.zeros(3, 20, 2, 2, dtype=torch.int16))
    with pytest.raises(ValueError, match="3 layers"):
        Scorer(moe("mixtral"), replay=True)(ids, mask, PARAMS, routing=torch.zeros(3, 20, 3, 2, dtype=torch.int16))
