"""The trainer in one process: batches from trajectories, updates, and weight sync to a real hf engine."""

import dataclasses
import math
from collections import Counter

import pytest
import torch
from fsdp_worker import fixed_batch  # the same fixed batch the FSDP test uses (this directory is on sys.path)
from pydantic import ValidationError

from agentrl.engine.base import Generation, SamplingParams
from agentrl.engine.hf import HFEngine
from agentrl.models.lora import LoraSettings, with_lora
from agentrl.models.tiny import tiny_model
from agentrl.rollout import Group, Status, Trajectory
from agentrl.train.batch import build_batch
from agentrl.train.config import AlgoConfig, ModelConfig, OptimConfig, TrainerConfig
from agentrl.train.learner import LocalLearner
from agentrl.train.trainer import Trainer
from agentrl.train.weight_sync import LoraAdapter, SharedModule, weight_sync

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def rescored(trainer: Trainer, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        lp, _, _ = trainer.scorer(ids, torch.ones_like(ids), GREEDY)
    return lp[0, len(prompt) :]


async def test_lora_update_reaches_a_separate_engine():
    """The engine (own model copy, as in another process) samples with the trained adapter after sync."""
    lora = LoraSettings(rank=4)
    trainer = Trainer(
        TrainerConfig(model=ModelConfig(lora=lora), optim=OptimConfig(lr=3e-2, minibatches=1)),
        with_lora(tiny_model("qwen3_moe", seed=0), lora),
    )
    prompt = fixed_batch().input_ids[0, :12].tolist()
    async with HFEngine(with_lora(tiny_model("qwen3_moe", seed=0), lora)) as engine:
        before = await engine.generate(prompt, GREEDY)
        sync = weight_sync(LocalLearner(trainer, in_thread=False), engine)
        assert type(sync) is LoraAdapter
        trainer.update(fixed_batch())
        assert await sync.push() == 1
        after = await engine.generate(prompt, GREEDY)
    assert set(after.versions) == {1}
    torch.testing.assert_close(
        torch.tensor(after.logprobs), rescored(trainer, prompt, after.token_ids), atol=1e-4, rtol=0
    )
    # the adapter changed the model: an engine that ignored it would still report the old logprobs
    moved = (rescored(trainer, prompt, before.token_ids) - torch.tensor(before.logprobs)).abs().max()
    assert moved > 1e-2


async def test_shared_module_needs_no_copy():
    policy = tiny_model("qwen3_moe", seed=0)
    trainer = Trainer(TrainerConfig(optim=OptimConfig(lr=1e-2, minibatches=2)), policy)
    prompt = fixed_batch().input_ids[1, :12].tolist()
    async with HFEngine(policy, shared=True) as engine:
        before = await engine.generate(prompt, GREEDY)
        sync = weight_sync(LocalLearner(trainer, in_thread=False), engine)
        assert type(sync) is SharedModule
        with sync.updating():  # no decode step sees half-updated weights
            trainer.update(fixed_batch())
        assert await sync.push() == 1
        after = await engine.generate(prompt, GREEDY)
    assert engine.model is policy and set(after.versions) == {1}
    torch.testing.assert_close(
        torch.tensor(after.logprobs), rescored(trainer, prompt, after.token_ids), atol=1e-4, rtol=0
    )
    assert (rescored(trainer, prompt, before.token_ids) - torch.tensor(before.logprobs)).abs().max() > 1e-3


def trajectory(group: str, turns: list[tuple[int, float]], *, status=Status.FINISHED, temperature=1.0) -> Trajectory:
    """A prompt of 3 tokens, then per turn n generated tokens and a 2-token observation."""
    t = Trajectory(
        episode_id=f"{group}-{len(turns)}",
        group_id=group,
        task_id=group,
        sampling=SamplingParams(temperature=temperature),
    )
    t.append_prompt([1, 2, 3])
    for k, (n, reward) in enumerate(turns):
        t.append_generation(Generation([10 + k] * n, [-0.5] * n, [0] * n, "stop"))
        t.turns[-1].reward = reward
        if k < len(turns) - 1:
            t.append_observation([7, 8])
    t.status = status
    t.outcome_reward = sum(r for _, r in turns)
    return t


def test_build_batch_gives_each_turn_its_advantage_and_leaves_failures_out():
    groups = [
        Group(
            "a",
            "a",
            [
                trajectory("a", [(2, 0.0), (3, 1.0)]),
                trajectory("a", [(4, 0.0)]),
                trajectory("a", [(5, 9.0)], status=Status.FAILED),
            ],
        ),
        Group("b", "b", [trajectory("b", [(2, 0.5)]), trajectory("b", [(3, 0.5)])]),  # equal returns
    ]
    batch, info = build_batch(groups, AlgoConfig(advantage="turn"))
    assert len(batch) == 4 and (info.groups, info.degenerate_groups, info.filtered_groups) == (2, 1, 0)
    # group a pools returns-to-go of real turns: 1.0, 1.0 (first member), 0.0 (second)
    mu, sigma = 2 / 3, (2 / 9) ** 0.5
    hi, lo = (1 - mu) / (sigma + 1e-6), (0 - mu) / (sigma + 1e-6)
    gen = batch.loss_mask[0].bool()
    torch.testing.assert_close(batch.advantages[0][gen], torch.full((5,), hi))
    torch.testing.assert_close(batch.advantages[1][batch.loss_mask[1].bool()], torch.full((4,), lo))
    assert (batch.advantages[2:] == 0).all() and (batch.advantages[~batch.loss_mask.bool()] == 0).all()
    assert batch.old_logprobs[batch.loss_mask.bool()].eq(-0.5).all()
    filtered, info = build_batch(groups, AlgoConfig(advantage="turn", filter_degenerate_groups=True))
    assert len(filtered) == 2 and info.filtered_groups == 1
    with pytest.raises(ValueError, match="one sampling distribution"):
        build_batch(
            [Group("c", "c", [trajectory("c", [(2, 1.0)]), trajectory("c", [(2, 0.0)], temperature=0.7)])], AlgoConfig()
        )


def test_config_refuses_incompatible_settings_before_starting():
    with pytest.raises(ValidationError, match="gspo_token"):
        AlgoConfig(loss="gspo", advantage="turn")
    with pytest.raises(ValidationError, match="recompute"):
        AlgoConfig(tis_cap=2.0)
    with pytest.raises(ValidationError, match="set only the new keys"):
        AlgoConfig(old_logprobs="recompute", behaviour_weight="mask")
    with pytest.raises(ValidationError, match="greater than 0"):
        AlgoConfig(behaviour_weight="truncate", behaviour_cap=0)
    with pytest.raises(ValidationError, match="minibatchs"):
        OptimConfig(minibatchs=4)
    with pytest.raises(ValueError, match="reference"):
        Trainer(TrainerConfig(algo=AlgoConfig(kl_coef=0.1)), tiny_model("qwen3", seed=0))


def test_turning_off_the_router_aux_loss_is_refused_on_a_dense_model():
    """A dense model has no router to balance: model.router_aux_loss=false would do nothing there."""
    off = TrainerConfig(model=ModelConfig(router_aux_loss=False), optim=OptimConfig(minibatches=1))
    with pytest.raises(ValueError, match="router_aux_loss=false does nothing on a dense model"):
        Trainer(off, tiny_model("qwen3", seed=0))
    metrics = Trainer(off, tiny_model("qwen3_moe", seed=0)).update(fixed_batch())
    assert "router_aux_loss" not in metrics and "expert_flip_rate" in metrics


def test_kl_to_the_starting_weights_holds_full_fine_tuning_back():
    """Full fine-tuning with a KL penalty: the frozen reference is the starting weights (KL 0 before the
    first step, then > 0), stays untouched, and the penalty keeps the policy closer to it."""
    optim = OptimConfig(lr=1e-2, minibatches=1)
    free = Trainer(TrainerConfig(optim=optim), tiny_model("qwen3_moe", seed=0))
    reference = tiny_model("qwen3_moe", seed=0)
    start = {k: v.clone() for k, v in reference.state_dict().items()}
    held = Trainer(TrainerConfig(algo=AlgoConfig(kl_coef=1.0), optim=optim), tiny_model("qwen3_moe", seed=0), reference)
    kls = [held.update(fixed_batch())["kl_ref"] for _ in range(6)]
    for _ in range(6):
        free.update(fixed_batch())
    assert kls[0] == pytest.approx(0.0, abs=1e-9) and kls[1] > 0
    assert all(torch.equal(v, start[k]) for k, v in reference.state_dict().items())

    def kl_to_start(trainer: Trainer) -> float:
        b = fixed_batch()
        with torch.no_grad():
            lp = trainer.scorer(b.input_ids, b.attention_mask, b.sampling)[0]
        diff = (held._reference_logprobs(b.input_ids, b.attention_mask, b.sampling) - lp)[b.loss_mask.bool()]
        return float((diff.exp() - diff - 1).mean())

    assert kl_to_start(held) < 0.5 * kl_to_start(free)


def test_configs_saved_with_old_logprobs_and_tis_cap_load_as_a_behaviour_weight():
    """The keys before behaviour_weight: 'engine' is 'none', 'recompute' is 'truncate' (at tis_cap, or the
    default cap); a config loaded and saved again has only the new keys."""
    cases = [
        ({"old_logprobs": "engine", "tis_cap": None}, ("none", 2.0)),
        ({"old_logprobs": "recompute", "tis_cap": 1.5}, ("truncate", 1.5)),
        ({"old_logprobs": "recompute"}, ("truncate", 2.0)),
    ]
    for old, (weight, cap) in cases:
        cfg = AlgoConfig(loss="grpo", **old)
        assert (cfg.loss, cfg.behaviour_weight, cfg.behaviour_cap) == ("grpo", weight, cap)
        assert AlgoConfig(**cfg.model_dump()) == cfg and not {"old_logprobs", "tis_cap"} & cfg.model_dump().keys()
    with pytest.raises(ValidationError, match="'engine' or 'recompute'"):
        AlgoConfig(old_logprobs="trainer")


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen3", "llama"])
@pytest.mark.parametrize("weight", ["none", "truncate"])
def test_update_on_moe_and_dense_models(tmp_path, arch, weight):
    """From a saved Hugging Face folder; MoE models report routing diagnostics, dense ones do not."""
    from agentrl.models.tiny import save_tiny
    from agentrl.train.policy import load_policy

    policy = load_policy(ModelConfig(path=str(save_tiny(tmp_path / arch, arch))))
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    trainer = Trainer(TrainerConfig(algo=AlgoConfig(behaviour_weight=weight), optim=OptimConfig(lr=1e-3)), policy)
    metrics = trainer.update(fixed_batch())
    moe = arch in ("qwen3_moe", "mixtral")
    assert ("expert_flip_rate" in metrics) == moe and ("router_aux_loss" in metrics) == moe
    assert 0 <= metrics.get("expert_flip_rate", 0) <= 1 and metrics["grad_norm"] > 0
    # the fixed batch's fake engine logprobs are far from the model's: a large mismatch either way
    assert metrics["mismatch_abs_logprob_diff"] > 0.5
    if weight == "truncate":  # the ratio is against the learner's own lp_prox: it stays near 1; w carries the mismatch
        assert metrics["abs_logprob_diff"] < 0.1 * metrics["mismatch_abs_logprob_diff"]
        # the learner's logprobs lie far below the fake engine's: ŵ = exp(mean(lp_prox − lp_b)) ≪ 1, never capped
        assert -math.log(metrics["behaviour_weight_p50"]) == pytest.approx(
            metrics["mismatch_abs_logprob_diff"], rel=0.2
        )
        assert metrics["behaviour_truncated_fraction"] == 0
    else:  # the ratio is against the engine's lp_b: it carries the mismatch
        assert metrics["abs_logprob_diff"] == pytest.approx(metrics["mismatch_abs_logprob_diff"], rel=0.2)
    assert any(not torch.equal(v, before[k]) for k, v in policy.state_dict().items())


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen3", "llama"])
def test_shared_prefix_and_length_buckets_score_as_plain(arch):
    """Rows that start alike run their common prefix once, and rows are scored in length-sorted chunks;
    neither changes lp, entropy, router logits or gradients."""
    from agentrl.train.scoring import Scorer

    model = tiny_model(arch, seed=0).train()
    B, L, P = 5, 80, 40
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 2000, (B, L), generator=g)
    ids[:, :P] = ids[0, :P]
    attention = torch.ones(B, L, dtype=torch.long)
    attention[1, 70:], attention[3, P + 2 :], attention[4, 60:] = 0, 0, 0  # right padding, one row barely past P
    ids = ids * attention
    moe = arch in ("qwen3_moe", "mixtral")
    results = []
    # plain; the prefix shared by all five; chunks of two rows (by length: 80 80 | 70 60 | 42), sharing inside
    for min_shared, chunk_tokens in ((L + 1, 10**6), (32, 10**6), (32, 2 * L)):
        scorer = Scorer(model, min_shared_prefix=min_shared, chunk_tokens=chunk_tokens)
        model.zero_grad()
        lp, entropy, router = scorer(
            ids, attention, SamplingParams(temperature=0.8, top_p=0.9), entropy=True, router=moe
        )
        (torch.where(attention.bool(), lp, 0.0) * torch.linspace(0.5, 1.5, L)).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((lp.detach(), entropy, router, grads))
    assert Scorer(model)._shared_prefix(ids, attention) == P
    on = attention.bool()
    plain = results[0]
    for lp, entropy, router, grads in results[1:]:
        torch.testing.assert_close(lp[on], plain[0][on], atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy[on], plain[1][on], atol=1e-4, rtol=0)
        torch.testing.assert_close(grads, plain[3], atol=1e-4, rtol=1e-4)
        if moe:
            for a, b in zip(router, plain[2], strict=True):
                torch.testing.assert_close(a[on.reshape(-1)], b[on.reshape(-1)], atol=1e-5, rtol=0)


def test_one_process_keeps_checkpointing_and_refuses_fsdp_only_settings():
    """Without torch.distributed, activation checkpointing still applies (and changes no number);
    bf16 mixed precision and CPU offload, FSDP2's policies, are refused instead of silently dropped."""
    from agentrl.train.policy import decoder_layers

    def count(calls: Counter, key: str):
        return lambda *_: calls.update([key])

    results = []
    for checkpointing in (False, True):
        policy = tiny_model("qwen3_moe", seed=0)
        layer, calls = decoder_layers(policy)[0], Counter()  # a recompute in backward runs the layer's insides only
        layer.register_forward_hook(count(calls, "layer"))
        layer.self_attn.register_forward_hook(count(calls, "attention"))
        cfg = TrainerConfig(model=ModelConfig(activation_checkpointing=checkpointing), optim=OptimConfig(minibatches=1))
        metrics = Trainer(cfg, policy).update(fixed_batch())
        assert (calls["attention"] > calls["layer"]) == checkpointing, calls
        results.append((metrics, {n: p.grad for n, p in policy.named_parameters()}))  # the one step's gradients
    (plain, plain_grads), (ckpt, ckpt_grads) = results
    assert ckpt["loss"] == pytest.approx(plain["loss"], abs=1e-7)
    assert ckpt["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, atol=1e-7, rtol=1e-5, msg=name)
    for setting in ({"dtype": "bfloat16"}, {"cpu_offload": True}):
        with pytest.raises(ValueError, match=r"initialise torch\.distributed"):
            Trainer(TrainerConfig(model=ModelConfig(**setting)), tiny_model("qwen3_moe", seed=0))


def test_expert_flip_rate_counts_changed_expert_choices():
    """No flips when the weights barely move; many when a large step reshapes the routers."""
    rates = {}
    for lr in (1e-9, 1e-1):
        trainer = Trainer(TrainerConfig(optim=OptimConfig(lr=lr, minibatches=2)), tiny_model("qwen3_moe", seed=0))
        rates[lr] = trainer.update(fixed_batch())["expert_flip_rate"]
    assert rates[1e-9] == 0
    assert 0.05 < rates[1e-1] <= 1


def test_router_aux_loss_is_transformers_load_balancing_loss():
    """The trainer's router aux loss over the real tokens equals transformers' own, padding masked."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from agentrl.train.trainer import router_aux_loss

    model = tiny_model("qwen3_moe", seed=0)
    batch = fixed_batch()  # right-padded rows of different lengths
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_router_logits=True)
    cfg = model.config
    ours = router_aux_loss(out.router_logits, cfg.num_experts_per_tok, batch.attention_mask)
    theirs = load_balancing_loss_func(out.router_logits, cfg.num_experts, cfg.num_experts_per_tok, batch.attention_mask)
    torch.testing.assert_close(ours, theirs.float(), atol=1e-6, rtol=1e-6)
    unmasked = router_aux_loss(out.router_logits, cfg.num_experts_per_tok, torch.ones_like(batch.attention_mask))
    assert not torch.isclose(unmasked, ours), "padding should not count"


def test_gradients_are_clipped_to_max_grad_norm():
    """grad_norm reports the norm before clipping; the step uses gradients of norm max_grad_norm."""
    policy = tiny_model("qwen3_moe", seed=0)
    cfg = TrainerConfig(optim=OptimConfig(minibatches=1, max_grad_norm=1e-4))
    metrics = Trainer(cfg, policy).update(fixed_batch())
    after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in policy.parameters() if p.grad is not None]))
    assert metrics["grad_norm"] > 1e-3
    assert float(after) == pytest.approx(1e-4, rel=1e-3)


async def test_the_run_config_turns_routing_records_on(tmp_path):
    """engine.record_routing: the run's hf engine returns each generated token's experts per layer."""
    from agentrl.config import load
    from agentrl.engine import EngineModel, build_engine
    from agentrl.models.tiny import save_tiny
    from agentrl.train.policy import load_policy
    from agentrl.train.run_config import RunConfig

    path = str(save_tiny(tmp_path / "m", "qwen3_moe"))
    for record in (False, True):
        cfg = load(RunConfig, {"model": {"path": path}, "engine": {"record_routing": record}})
        trainer = Trainer(cfg.trainer(), load_policy(cfg.model))
        async with build_engine(cfg.engine, EngineModel(path, module=trainer.policy)) as engine:
            assert engine.capabilities.records_routing == record and engine.capabilities.shares_module
            gen = await engine.generate([5, 6, 7], SamplingParams(max_tokens=3))
        if record:
            layers, top_k = trainer.policy.config.num_hidden_layers, trainer.policy.config.num_experts_per_tok
            assert [[len(e) for e in token] for token in gen.routed_experts] == [[top_k] * layers] * 3
        else:
            assert gen.routed_experts is None


def test_rows_of_equal_weight_below_one_update_as_unweighted_rows():
    """Equal row weights below 1 (an episode's K sequences weigh 1/K each) give the update of unweighted rows: J is
    a weighted mean, and a minibatch's (and a rank's) share of it counts weight, not rows."""
    batch = fixed_batch()
    cfg = TrainerConfig(optim=OptimConfig(minibatches=2))
    plain = Trainer(cfg, tiny_model("qwen3_moe", seed=0)).update(batch)
    weighted = dataclasses.replace(batch, row_weights=torch.full((len(batch),), 1 / 16))  # 0.25 a minibatch
    got = Trainer(cfg, tiny_model("qwen3_moe", seed=0)).update(weighted)
    assert got["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    assert got["loss"] == pytest.approx(plain["loss"], rel=1e-5)


def params_after(cfg: TrainerConfig, arch: str, batch) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    policy = tiny_model(arch, seed=0)
    metrics = Trainer(cfg, policy).update(batch)
    return metrics, {n: p.detach().clone() for n, p in policy.named_parameters()}


@pytest.mark.parametrize(
    ("arch", "algo"),
    [("qwen3", AlgoConfig()), ("qwen3", AlgoConfig(behaviour_weight="truncate")), ("qwen3_moe", AlgoConfig())],
    ids=["dense", "decoupled", "moe"],
)
def test_micro_batches_update_as_the_whole_minibatch(arch, algo):
    """A token budget splits each minibatch into micro-batches whose gradients sum into its one step: the same
    update to rounding (Adam's step magnifies the gradients' rounding where they are small: 1e-6 of a 2e-3 move),
    and the same metrics: the loss (a mean of the micro-batches' means weighted by their sequences), every mean by
    its own units, the ratio's quantiles over all its values. MoE: the router's balancing loss is per micro-batch,
    weighted by tokens, so it is left out here."""
    batch = fixed_batch()
    model = ModelConfig(router_aux_loss=False) if arch == "qwen3_moe" else ModelConfig()
    whole = TrainerConfig(model=model, algo=algo, optim=OptimConfig(lr=1e-3, minibatches=2))
    micro = whole.model_copy(update={"optim": OptimConfig(lr=1e-3, minibatches=2, microbatch_tokens=100)})
    trainer = Trainer(micro, tiny_model(arch, seed=0))
    parts = [len(trainer._micro_batches(rows, batch.attention_mask.sum(-1))) for rows in torch.arange(8).chunk(2)]
    assert min(parts) >= 2  # rows of 40 to 64 tokens: at most 2 a micro-batch
    m_whole, p_whole = params_after(whole, arch, batch)
    m_micro, p_micro = params_after(micro, arch, batch)
    moved = max((p_whole[n] - tiny_model(arch, seed=0).state_dict()[n]).abs().max() for n in p_whole)
    assert moved > 1e-4  # the update did something the comparison can see
    for name, value in p_micro.items():
        torch.testing.assert_close(value, p_whole[name], atol=1e-5, rtol=0, msg=name)
    # every metric is the minibatch's whatever the split: means pooled by their units, quantiles over every value
    assert {"ratio_p05", "ratio_p95", "clip_fraction", "entropy", "mismatch_abs_logprob_diff"} <= m_whole.keys()
    assert m_micro.keys() == m_whole.keys()
    for key, value in m_whole.items():
        if key != "expert_flip_rate":  # a sample: the first rows of minibatch 0's first micro-batch
            assert m_micro[key] == pytest.approx(value, rel=1e-5, abs=1e-9), key


def test_micro_batches_hold_the_token_budget_longest_rows_first():
    trainer = Trainer(TrainerConfig(optim=OptimConfig(microbatch_tokens=120)), tiny_model("qwen3", seed=0))
    lengths = torch.tensor([10, 200, 30, 60, 50, 40, 20, 5])
    parts = trainer._micro_batches(torch.arange(8), lengths)
    assert [p.tolist() for p in parts] == [[1], [3, 4], [5, 2, 6], [0, 7]]  # 200 alone; then ≤ 120 padded
    assert all(len(p) * int(lengths[p].max()) <= 120 for p in parts[1:])


def test_rows_that_generated_nothing_take_no_step():
    """An episode that ended before its first turn is a row without a term in J: the update is that of the other
    rows alone, the same steps; a minibatch of only such rows would still step (AdamW moves the weights on zero
    gradients, by its momentum and weight decay). A batch of nothing but them is refused."""
    batch = fixed_batch(B=4)
    batch.loss_mask[2:] = 0
    cfg = TrainerConfig(optim=OptimConfig(lr=1e-3, minibatches=4))
    with_empty, alone = Trainer(cfg, tiny_model("qwen3", seed=0)), Trainer(cfg, tiny_model("qwen3", seed=0))
    for _ in range(2):  # the second with the first's momentum
        with_empty.update(batch)
        alone.update(batch.select([0, 1]))
    assert with_empty.scheduler.last_epoch == 4  # two steps an update, one a row that generated something
    for (name, p), q in zip(with_empty.policy.named_parameters(), alone.policy.parameters(), strict=True):
        assert torch.equal(p, q), name
    with pytest.raises(ValueError, match="no generated tokens"):
        with_empty.update(batch.select([2, 3]))
