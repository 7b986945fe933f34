"""The hf engine against a fresh teacher-forced forward pass of the same model (fp32, CPU)."""

import asyncio
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model_state_dict

from agentrl.engine.base import ContextTooLong, SamplingParams
from agentrl.engine.hf import HFEngine
from agentrl.engine.prefix_cache import PrefixCache
from agentrl.engine.sampling import sampling_logprobs, token_logprobs
from agentrl.models.lora import peft_model
from agentrl.models.tiny import tiny_model
from agentrl.models.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from profiling import HostReads  # the count benchmarks/host_reads.py makes

# Batched, left-padded, KV-cached decoding against one unpadded forward pass, fp32:
# measured differences are ~1e-6; this bound leaves room for other CPUs' kernels.
ATOL = 1e-4

PROMPTS = ["def add(a, b):", "Write a function", "hello " * 9, "x", "The quick brown fox jumps over the lazy dog. " * 3]


def teacher_forced(model, prompt, gen, params):
    ids = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]  # (T, V): position t predicts token t+1
    return token_logprobs(logits, torch.tensor(gen.token_ids), params)


@pytest.mark.parametrize("arch", ["qwen3_moe", "llama", "mixtral", "qwen3"])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=24),
        SamplingParams(temperature=1.0, max_tokens=24),
        SamplingParams(temperature=0.7, top_p=0.8, max_tokens=24),
        SamplingParams(temperature=1.3, top_k=40, top_p=0.95, max_tokens=24),
    ],
    ids=["greedy", "t1", "t0.7-p0.8", "t1.3-k40-p0.95"],
)
async def test_logprobs_match_a_fresh_forward_pass(arch, params):
    model = tiny_model(arch, seed=1)
    tok = load_tokenizer()
    async with HFEngine(model) as eng:
        prompts = [tok.encode(p) for p in PROMPTS]
        gens = await asyncio.gather(
            *(eng.generate(p, params.model_copy(update={"seed": i})) for i, p in enumerate(prompts))
        )
    for prompt, gen in zip(prompts, gens, strict=True):
        assert len(gen.token_ids) == params.max_tokens and gen.finish_reason == "length"
        expected = teacher_forced(model, prompt, gen, params)
        assert torch.isfinite(expected).all(), "a sampled token lies outside the trainer's top-k/top-p set"
        torch.testing.assert_close(torch.tensor(gen.logprobs), expected, atol=ATOL, rtol=0)


def test_sampling_semantics_are_the_truncated_renormalised_distribution():
    z = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    logq = sampling_logprobs(z, temperature=0.5, top_k=3, top_p=0.9)
    p = torch.softmax(z / 0.5, -1)
    # top-k keeps 3; of those, renormalised, the first two already reach 0.9? compute by hand:
    p3 = p[:3] / p[:3].sum()
    keep = 2 if p3[0] < 0.9 and p3[0] + p3[1] >= 0.9 else (1 if p3[0] >= 0.9 else 3)
    q = torch.zeros(5)
    q[:keep] = p3[:keep] / p3[:keep].sum()
    torch.testing.assert_close(logq.exp(), q)
    assert torch.isinf(logq[keep:]).all()
    # greedy reports the untempered, unfiltered softmax
    torch.testing.assert_close(sampling_logprobs(z, 0.0), torch.log_softmax(z, -1))


async def test_samples_follow_the_reported_distribution():
    """Empirical token frequencies match exp(logprob) of the reported distribution."""
    model = tiny_model("llama", seed=3)
    params = SamplingParams(temperature=0.9, top_p=0.7, max_tokens=1)
    prompt = load_tokenizer().encode("def f(x):")
    with torch.no_grad():
        q = sampling_logprobs(model(torch.tensor([prompt])).logits[0, -1], 0.9, 0, 0.7).exp()
    async with HFEngine(model) as eng:
        gens = await asyncio.gather(*(eng.generate(prompt, params.model_copy(update={"seed": s})) for s in range(600)))
    counts = torch.bincount(torch.tensor([g.token_ids[0] for g in gens]), minlength=q.numel()).float() / 600
    assert (counts[q == 0] == 0).all(), "sampled a token the top-p filter removed"
    assert (counts - q).abs().max() < 0.07


async def test_requests_join_a_running_batch_and_are_batching_invariant():
    model = tiny_model("qwen3_moe", seed=2)
    tok = load_tokenizer()
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=7)
    prompt = tok.encode("def fib(n):")
    async with HFEngine(model) as eng:
        alone = await eng.generate(prompt, params)
        long = SamplingParams(max_tokens=1000, seed=1)  # far longer than the joining request, even on a loaded machine
        long_running = asyncio.create_task(eng.generate(tok.encode("x = 1"), long, request_id="long"))
        await asyncio.sleep(0.2)  # the long request is mid-generation
        assert not long_running.done()
        joined = await eng.generate(prompt, params)
        assert not long_running.done(), "the joining request waited for the batch to drain"
        await eng.abort("long")
        assert (await long_running).finish_reason == "aborted"
    assert joined.token_ids == alone.token_ids
    torch.testing.assert_close(torch.tensor(joined.logprobs), torch.tensor(alone.logprobs), atol=ATOL, rtol=0)


async def test_rows_of_different_settings_decode_together_as_each_alone():
    """Greedy, top-k and top-p rows in one batch (filtered and drawn in one pass): each request draws the tokens
    it draws alone, with the logprobs of a fresh forward under its own settings."""
    model = tiny_model("qwen3_moe", seed=5)
    tok = load_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    params = [
        SamplingParams(temperature=0.0, max_tokens=16),
        SamplingParams(temperature=1.0, max_tokens=16, seed=1),
        SamplingParams(temperature=0.7, top_p=0.8, max_tokens=16, seed=2),
        SamplingParams(temperature=1.3, top_k=40, top_p=0.95, max_tokens=16, seed=3),
        SamplingParams(temperature=1.0, top_k=3, max_tokens=16, seed=4),
    ]
    async with HFEngine(model) as eng:
        with eng.paused():  # the loop cannot step: the requests enter as one batch
            batch = [asyncio.ensure_future(eng.generate(p, s)) for p, s in zip(prompts, params, strict=True)]
            await asyncio.sleep(0.1)
        together = await asyncio.gather(*batch)
        alone = [await eng.generate(p, s) for p, s in zip(prompts, params, strict=True)]
    for prompt, p, gen, ref in zip(prompts, params, together, alone, strict=True):
        assert gen.token_ids == ref.token_ids, p
        torch.testing.assert_close(torch.tensor(gen.logprobs), teacher_forced(model, prompt, gen, p), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3_moe", "llama"])
async def test_prefix_cache_reuses_earlier_turns_and_keeps_parity(arch):
    """Turn 2 extends turn 1 (prompt, generated, observation): only the new tokens are prefilled,
    identical prompts (a group) are prefilled once, and logprobs still match a fresh forward."""
    model = tiny_model(arch, seed=4)
    tok = load_tokenizer()
    params = SamplingParams(temperature=1.0, max_tokens=12)
    system = tok.encode("You are a coding agent. " * 8)
    obs = tok.encode("<|im_end|>observation: ok")

    async def turn(eng, prompts):
        return await asyncio.gather(
            *(eng.generate(p, params.model_copy(update={"seed": i})) for i, p in enumerate(prompts))
        )

    async with HFEngine(model, shared=True) as eng, HFEngine(model, prefix_cache_tokens=0) as ref:
        prompts = [system + tok.encode(f" task {i}") for i in range(3) for _ in range(2)]  # 3 groups of 2
        gens = await turn(eng, prompts)
        # however the requests fell into batches, the shared system prompt is prefilled once (same batch:
        # computed first, once; a later batch: served by the cache) and so is each group's prompt (+1:
        # a prompt identical to a cached one recomputes its last token for the logits)
        assert eng.prefilled_tokens <= len(system) + sum(len(p) - len(system) + 1 for p in prompts[::2])
        fresh = tok.encode("unrelated question")
        prompts2 = [p + g.token_ids + obs for p, g in zip(prompts, gens, strict=True)] + [fresh]
        before = eng.prefilled_tokens
        gens2 = await turn(eng, prompts2)
        # the last sampled token of turn 1 was never fed to the model: it is prefilled with the observation
        assert eng.prefilled_tokens - before == 6 * (1 + len(obs)) + len(fresh)
        assert [g.token_ids for g in gens2] == [g.token_ids for g in await turn(ref, prompts2)]
        for prompt, gen in zip(prompts2, gens2, strict=True):
            torch.testing.assert_close(
                torch.tensor(gen.logprobs), teacher_forced(model, prompt, gen, params), atol=ATOL, rtol=0
            )
        # a weight update empties the cache: KV of the old weights is never reused
        await eng.update_weights()
        cached = eng.cached_tokens
        await eng.generate(prompts2[0], params)
        assert eng.cached_tokens == cached
        # a batch arriving at once computes its shared system prompt once
        before = eng.prefilled_tokens
        await eng.update_weights()
        with eng.paused():  # the loop cannot step: the requests queue up and enter as one batch
            batch = [asyncio.ensure_future(eng.generate(p, params)) for p in prompts2[1:6]]
            await asyncio.sleep(0.1)
        await asyncio.gather(*batch)
        assert eng.prefilled_tokens - before <= len(system) + sum(len(p) - len(system) for p in prompts2[1:6])


def test_prefix_cache_keeps_the_longest_entries_within_its_budget():
    cache = PrefixCache(max_tokens=10)
    kv = lambda n: [(torch.arange(n).float()[None, :, None], torch.zeros(1, n, 1))]  # noqa: E731
    cache.insert([1, 2, 3], kv(3))
    cache.insert([1, 2, 3, 4, 5], kv(5))  # extends the first: replaces it
    assert len(cache) == 1 and cache.tokens == 5
    m, got, _ = cache.lookup([1, 2, 3, 9])
    assert m == 3 and got[0][0].flatten().tolist() == [0, 1, 2]
    assert cache.lookup([1, 2, 3, 4, 5])[0] == 4, "the last prompt token must be prefilled for its logits"
    assert cache.lookup([7, 1, 2])[0] == 0
    cache.insert([7, 8, 9, 10], kv(4))
    cache.lookup([1, 2])  # touch: [7, 8, 9, 10] is now the least recently used
    cache.insert([5, 6], kv(2))
    assert cache.tokens == 7 and cache.lookup([7, 8, 9])[0] == 0 and cache.lookup([1, 2, 3])[0] == 2


@pytest.mark.parametrize("fixed_shapes", [False, True], ids=["", "fixed-shapes"])
async def test_rows_leave_and_join_in_any_order(fixed_shapes):
    """Requests of different lengths finish at different steps (their rows are refilled from the end
    of the batch) while others join mid-generation; every one still matches a fresh forward pass. With fixed
    shapes, the batch crosses buckets and the KV storage grows under the step's buffers."""
    model = tiny_model("qwen3_moe", seed=6)
    tok = load_tokenizer()
    prompts = [tok.encode(f"{i} " + "word " * (3 * i + 1)) for i in range(10)]
    params = [SamplingParams(temperature=1.0, max_tokens=4 + 7 * (i % 5), seed=i) for i in range(10)]
    async with HFEngine(model, fixed_shapes=fixed_shapes) as eng:
        first = [asyncio.create_task(eng.generate(prompts[i], params[i])) for i in range(6)]
        await asyncio.sleep(0.05)
        later = [asyncio.create_task(eng.generate(prompts[i], params[i])) for i in range(6, 10)]
        gens = await asyncio.gather(*first, *later)
    for prompt, p, gen in zip(prompts, params, gens, strict=True):
        assert len(gen.token_ids) == p.max_tokens
        torch.testing.assert_close(torch.tensor(gen.logprobs), teacher_forced(model, prompt, gen, p), atol=ATOL, rtol=0)


async def test_stop_tokens_end_generation_and_are_returned():
    model = tiny_model("llama", seed=0)
    prompt = load_tokenizer().encode("abc")
    async with HFEngine(model) as eng:
        free = await eng.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30))
        stop = free.token_ids[5]
        first = free.token_ids.index(stop)
        got = await eng.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=(stop,)))
    assert got.finish_reason == "stop" and got.token_ids == free.token_ids[: first + 1]


@pytest.mark.parametrize("fixed_shapes", [False, True], ids=["", "fixed-shapes"])
async def test_a_decode_window_returns_what_single_steps_return(fixed_shapes):
    """Five decode steps between two reads back: requests that stop (a stop token, their max_tokens) inside a
    window return the tokens, logprobs and routing that one step at a time returns, and the prefix cache keeps
    only what they returned, so a second turn reuses as much KV, with parity. With fixed shapes (what a CUDA
    graph replays: the batch padded to a bucket, attention over all the KV storage) too."""
    model = tiny_model("qwen3_moe", seed=7)
    tok = load_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS[:4]]

    async def run(eng, turn, params):
        with eng.paused():  # the requests enter as one batch, in both engines alike
            batch = [asyncio.ensure_future(eng.generate(p, s)) for p, s in zip(turn, params, strict=True)]
            await asyncio.sleep(0.1)
        return await asyncio.gather(*batch)

    async with (
        HFEngine(model, record_routing=True) as one,
        HFEngine(model, record_routing=True, decode_window=5, fixed_shapes=fixed_shapes) as five,
    ):
        first = [SamplingParams(max_tokens=20, seed=i) for i in range(4)]
        free = await run(one, prompts, first)
        assert [g.token_ids for g in await run(five, prompts, first)] == [g.token_ids for g in free]
        # requests 0 and 2 stop on a token they draw (at index 3 or 7 at the latest), 1 and 3 at their max_tokens
        stops = [(free[0].token_ids[3],), (), (free[2].token_ids[7],), ()]
        params = [
            SamplingParams(max_tokens=n, seed=i, stop_token_ids=stop)
            for i, (n, stop) in enumerate(zip((13, 7, 20, 11), stops, strict=True))
        ]
        want, got = await run(one, prompts, params), await run(five, prompts, params)
        assert [g.finish_reason for g in got] == ["stop", "length", "stop", "length"]
        turn2 = [p + g.token_ids + tok.encode(" next") for p, g in zip(prompts, got, strict=True)]
        again = [SamplingParams(max_tokens=9, seed=10 + i) for i in range(4)]
        cached = one.cached_tokens, five.cached_tokens
        want2, got2 = await run(one, turn2, again), await run(five, turn2, again)
        assert five.cached_tokens - cached[1] == one.cached_tokens - cached[0] > 0
    for prompt, p, w, g in zip(prompts + turn2, params + again, want + want2, got + got2, strict=True):
        assert (g.token_ids, g.finish_reason, g.routed_experts) == (w.token_ids, w.finish_reason, w.routed_experts)
        assert g.prompt_routing == w.prompt_routing
        torch.testing.assert_close(torch.tensor(g.logprobs), teacher_forced(model, prompt, g, p), atol=ATOL, rtol=0)


def test_cuda_graphs_need_a_gpu_the_engine_s_own_weights_and_sdpa():
    model = tiny_model("qwen3_moe", seed=0)
    with pytest.raises(ValueError, match="captures decode steps on a GPU: the model is on cpu"):
        HFEngine(model, cuda_graphs=True)
    with pytest.raises(ValueError, match="needs the engine's own weights"):
        HFEngine(model, fixed_shapes=True, shared=True)
    model.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="needs sdpa attention"):
        HFEngine(model, fixed_shapes=True)


@pytest.mark.parametrize("window", [1, 4])
async def test_a_decode_window_reads_nothing_back_but_its_tokens(window):
    """No step of a window waits on the device before its one transfer of the tokens (transformers' own mask
    code read the 2D mask back once per step; the engine gives it the 4D mask instead). On the CPU that transfer
    is no aten op, so a window counts no read at all."""
    eng = HFEngine(tiny_model("qwen3_moe", seed=2), decode_window=window)
    loop = asyncio.get_running_loop()
    params = [SamplingParams(max_tokens=64, seed=i) for i in range(3)]
    reqs = [eng._new_request(str(i), list(range(10, 15 + 3 * i)), p, loop) for i, p in enumerate(params)]  # padded
    with torch.no_grad():
        eng._step(reqs)  # the prefill
        eng._step([])  # the first window copies the rows' inputs from the host
        with HostReads() as host:
            eng._step([])
    assert [len(r.tokens) for r in reqs] == [1 + 2 * window] * 3
    assert host.reads == []


@pytest.mark.slow  # the fast tier updates weights under requests in flight in tests/engine/test_fleet.py
async def test_weight_update_bumps_version_mid_request():
    model = tiny_model("qwen3", seed=0)
    other = tiny_model("qwen3", seed=5).state_dict()
    prompt = load_tokenizer().encode("def f():")
    async with HFEngine(model) as eng:
        req = asyncio.create_task(eng.generate(prompt, SamplingParams(max_tokens=3000, seed=0)))
        await asyncio.sleep(0.3)
        assert await eng.update_weights(other) == 1
        gen = await req
        after = await eng.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8))
    assert gen.versions[0] == 0 and gen.versions[-1] == 1 and gen.versions == sorted(gen.versions)
    assert set(after.versions) == {1}
    # the new weights are really in place: the logprobs match a model built from them
    fresh = tiny_model("qwen3", seed=5)
    expected = teacher_forced(fresh, prompt, after, SamplingParams(temperature=0.0))
    torch.testing.assert_close(torch.tensor(after.logprobs), expected, atol=ATOL, rtol=0)


async def test_lora_update_and_shared_weights():
    base = tiny_model("qwen3_moe", seed=0)
    model = peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    prompt = load_tokenizer().encode("print(")
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    async with HFEngine(model, shared=True) as eng:
        before = await eng.generate(prompt, greedy)
        adapter = {k: torch.randn_like(v) * 0.5 for k, v in get_peft_model_state_dict(model).items()}
        assert await eng.update_weights(lora=adapter) == 1
        after = await eng.generate(prompt, greedy)
        assert after.versions == [1] * 10 and after.logprobs != before.logprobs
        torch.testing.assert_close(torch.tensor(after.logprobs), teacher_forced(model, prompt, after, greedy))
        # shared module: the trainer changes weights in place, then bumps the version
        with eng.paused(), torch.no_grad():
            for p in model.parameters():
                p.mul_(1.01)
        assert await eng.update_weights() == 2
        shared = await eng.generate(prompt, greedy)
        torch.testing.assert_close(torch.tensor(shared.logprobs), teacher_forced(model, prompt, shared, greedy))
        with pytest.raises(ValueError, match="adapter lacks"):
            await eng.update_weights(lora={"nonsense.lora_A.weight": torch.zeros(1)})


async def test_a_refused_update_changes_no_weight():
    """An update with a wrong key or shape is refused whole: torch and peft copied every tensor that fit before
    raising, so the engine went on sampling a mix of old and new weights under the old version (`agentrl serve`
    answers such an update 400 and keeps serving)."""
    model = tiny_model("qwen3", seed=0)
    new = tiny_model("qwen3", seed=5).state_dict()
    wrong_shape = {**new, "lm_head.weight": torch.zeros(new["lm_head.weight"].shape[0], 65)}
    unknown = {**new, "model.no_such.weight": torch.zeros(1)}
    lacking = {k: v for k, v in new.items() if k != "model.norm.weight"}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    async with HFEngine(model) as eng:
        for bad, says in [(wrong_shape, "wrong shape"), (unknown, "keys the model lacks"), (lacking, "lacks keys")]:
            with pytest.raises(ValueError, match=rf"{says}.*no weight was changed"):
                await eng.update_weights(bad)
        assert eng.version == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    lora = peft_model(tiny_model("qwen3", seed=0), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    adapter = {k: v.clone() for k, v in get_peft_model_state_dict(lora).items()}
    first = next(iter(adapter))
    bad = {k: torch.randn(v.shape[0] + 1, v.shape[1]) if k == first else v + 1 for k, v in adapter.items()}
    async with HFEngine(lora) as eng:
        with pytest.raises(ValueError, match=r"wrong shape.*no weight was changed"):
            await eng.update_weights(lora=bad)
        with pytest.raises(ValueError, match="adapter lacks"):
            await eng.update_weights(lora={**{k: v + 1 for k, v in adapter.items()}, "x.lora_A.weight": torch.zeros(1)})
        assert eng.version == 0
    assert all(torch.equal(adapter[k], v) for k, v in get_peft_model_state_dict(lora).items())


async def test_abort_returns_partial_tokens():
    model = tiny_model("llama", seed=0)
    prompt = load_tokenizer().encode("x")
    async with HFEngine(model) as eng:
        req = asyncio.create_task(eng.generate(prompt, SamplingParams(max_tokens=2000), request_id="r1"))
        await asyncio.sleep(0.3)
        await eng.abort("r1")
        gen = await req
        await eng.abort("no-such-request")  # ignored
    assert gen.finish_reason == "aborted" and 0 < len(gen.token_ids) < 2000
    assert len(gen.logprobs) == len(gen.versions) == len(gen.token_ids)


async def test_a_stop_token_id_past_int64_is_refused_and_fails_no_other_request():
    """The decode thread put stop ids in an int64 tensor: one of 2^63 (JSON and SamplingParams allow it) failed the
    thread, the requests batched with it and every later one."""
    model = tiny_model("llama", seed=0)
    async with HFEngine(model) as eng:
        other = asyncio.create_task(eng.generate([5, 6, 7], SamplingParams(max_tokens=40, seed=1)))
        await asyncio.sleep(0.05)
        for bad in (2**63, model.config.vocab_size):
            with pytest.raises(ValueError, match=rf"stop token ids \[{bad}\] are not in the model's vocabulary"):
                await eng.generate([1, 2, 3], SamplingParams(max_tokens=4, stop_token_ids=(2, bad)))
        assert (await other).finish_reason == "length"
        assert len((await eng.generate([1, 2, 3], SamplingParams(max_tokens=4))).token_ids) == 4


async def test_overlong_requests_never_reach_the_model():
    model = tiny_model("llama", seed=0, max_position_embeddings=64)
    async with HFEngine(model) as eng:
        assert eng.max_context == 64
        with pytest.raises(ContextTooLong, match="exceeds the context of 64"):
            await eng.generate(list(range(10, 60)), SamplingParams(max_tokens=20))
        with pytest.raises(ValueError, match="empty prompt"):
            await eng.generate([], SamplingParams())
        vocab = model.config.vocab_size  # an id past it would fail the decode thread, and every request after
        for bad in (vocab, -1):
            with pytest.raises(ValueError, match=f"prompt token id {bad} is not in the model's vocabulary"):
                await eng.generate([5, bad], SamplingParams(max_tokens=2))
        ok = await eng.generate(list(range(10, 60)), SamplingParams(max_tokens=14))
    assert len(ok.token_ids) == 14


def test_sampling_params_are_validated():
    with pytest.raises(ValueError, match="greedy"):
        SamplingParams(temperature=0.0, top_p=0.5)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams(temprature=1.0)


async def test_a_model_error_fails_requests_instead_of_hanging():
    model = tiny_model("llama", seed=0)

    def broken(module, args, out):
        raise IndexError("a forward pass that fails")

    async with HFEngine(model) as eng:
        model.model.embed_tokens.register_forward_hook(broken)
        with pytest.raises(IndexError, match="a forward pass that fails"):
            await eng.generate([1, 2], SamplingParams(max_tokens=4))
        with pytest.raises(RuntimeError, match="decode loop failed"):
            await eng.generate([1, 2], SamplingParams(max_tokens=4))


def experts_of(model, ids: list[int]) -> list[list[list[int]]]:
    """Per position, per layer, the sorted experts a fresh forward routes it to."""
    chosen = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, a, out: chosen.append(out[2])) for layer in model.model.layers
    ]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return [[sorted(layer[p].tolist()) for layer in chosen] for p in range(len(ids))]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
async def test_routed_experts_are_those_of_a_fresh_forward(arch):
    """Each generated token records, per layer, the experts of the position that sampled it; each prompt
    position its own."""
    model = tiny_model(arch, seed=2)
    tok = load_tokenizer()
    prompts = [tok.encode("def add(a, b):"), tok.encode("The quick brown fox " * 3)]
    async with HFEngine(model, record_routing=True) as eng:
        gens = await asyncio.gather(
            *(eng.generate(p, SamplingParams(max_tokens=6, seed=i)) for i, p in enumerate(prompts))
        )
    for prompt, gen in zip(prompts, gens, strict=True):
        fresh = experts_of(model, prompt + gen.token_ids)
        assert [[sorted(e) for e in token] for token in gen.routed_experts] == fresh[len(prompt) - 1 : -1]
        assert [[sorted(e) for e in pos] for pos in gen.prompt_routing] == fresh[: len(prompt) - 1]
    with pytest.raises(ValueError, match="MoE"):
        HFEngine(tiny_model("llama", seed=0), record_routing=True)


async def test_prompt_routing_of_prefix_cache_hits_is_the_routing_their_kv_was_computed_with():
    """A later turn's prompt resends the earlier context: the part served from the prefix cache reports the
    routing recorded with its KV (prefill and decode positions alike), equal to a fresh forward's."""
    model = tiny_model("qwen3_moe", seed=3)
    tok = load_tokenizer()
    first = tok.encode("The quick brown fox jumps over the lazy dog. " * 2)
    async with HFEngine(model, record_routing=True) as eng:
        gen = await eng.generate(first, SamplingParams(max_tokens=8, seed=0))
        turn2 = first + gen.token_ids + tok.encode(" and then")
        cached = eng.cached_tokens
        gen2 = await eng.generate(turn2, SamplingParams(max_tokens=4, seed=1))
        assert eng.cached_tokens - cached == len(first) + len(gen.token_ids) - 1, "the first turn's KV is reused"
    fresh = experts_of(model, turn2 + gen2.token_ids)
    assert [[sorted(e) for e in pos] for pos in gen2.prompt_routing] == fresh[: len(turn2) - 1]
    assert [[sorted(e) for e in token] for token in gen2.routed_experts] == fresh[len(turn2) - 1 : -1]
    assert gen2.prompt_routing[: len(first) - 1] == gen.prompt_routing, "a hit reports what was recorded"
    assert gen2.prompt_routing[len(first) - 1 : len(first) - 1 + len(gen.routed_experts)] == gen.routed_experts


async def test_a_sliding_window_model_keeps_parity_when_prompts_reuse_cached_prefixes():
    """Sliding-window layers mask by column: a row whose cached prefix and suffix sat apart (a shorter suffix than
    its batch's longest) lost earlier tokens from its window (0.15-0.38 off). The two prompts share a 40-token
    system prompt, computed once first and then reused by both, with suffixes of 2 and 10 tokens."""
    model = tiny_model("qwen3", seed=0, use_sliding_window=True, sliding_window=6, max_window_layers=0)
    assert set(model.config.layer_types) == {"sliding_attention"}
    system = list(range(100, 140))
    prompts = [[*system, 200, 201], system + list(range(300, 310))]
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=0)
    async with HFEngine(model) as eng:
        with eng.paused():  # the requests enter as one batch
            gens = [asyncio.ensure_future(eng.generate(p, params)) for p in prompts]
            await asyncio.sleep(0.05)
        gens = await asyncio.gather(*gens)
        assert eng.cached_tokens > 0  # the shared prefix was reused
    for prompt, gen in zip(prompts, gens, strict=True):
        torch.testing.assert_close(
            torch.tensor(gen.logprobs), teacher_forced(model, prompt, gen, params), atol=ATOL, rtol=0
        )


async def test_a_decode_window_feeds_no_position_past_a_row_s_last():
    """A row that reaches its max_tokens inside a window decodes on to the window's end: its position must stay
    within prompt + max_tokens (here max_context), or a model with learned positions indexes past its table."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=2)).eval()
    async with HFEngine(model, decode_window=4) as eng:
        with eng.paused():  # one batch: the first request ends at the context's end while the other goes on
            full = asyncio.ensure_future(eng.generate(list(range(10, 60)), SamplingParams(max_tokens=14, seed=0)))
            other = asyncio.ensure_future(eng.generate(list(range(10, 20)), SamplingParams(max_tokens=30, seed=1)))
            await asyncio.sleep(0.05)
        full, other = await asyncio.gather(full, other)
    assert (len(full.token_ids), len(other.token_ids)) == (14, 30)


async def test_an_aborted_request_waiting_for_room_ends_at_once():
    model = tiny_model("llama", seed=0)
    async with HFEngine(model, max_batch_size=1) as eng:
        running = asyncio.create_task(eng.generate([5, 6], SamplingParams(max_tokens=3000), request_id="a"))
        waiting = asyncio.create_task(eng.generate([7, 8], SamplingParams(max_tokens=8), request_id="b"))
        await asyncio.sleep(0.2)
        await eng.abort("b")
        gen = await waiting  # not when the running request frees its row
        assert not running.done() and gen.finish_reason == "aborted" and gen.token_ids == []
        await eng.abort("a")
        await running


async def test_a_shared_module_s_new_version_begins_as_its_update_ends():
    """`paused(new_version=True)` around an in-place update: the version moves, and the old weights' KV leaves
    the prefix cache, before the engine can step again (an `update_weights()` after the block left a step between
    the two, whose tokens carried the new weights under the old version); a failed update moves nothing."""
    model = tiny_model("qwen3", seed=0)
    async with HFEngine(model, shared=True) as eng:
        await eng.generate(list(range(10, 50)), SamplingParams(max_tokens=4))
        assert eng._prefix.tokens > 0
        with eng.paused(new_version=True):
            assert eng.version == 0
        assert eng.version == 1 and eng._prefix.tokens == 0
        with pytest.raises(RuntimeError), eng.paused(new_version=True):
            raise RuntimeError("the optimizer step failed")
        assert eng.version == 1
        gen = await eng.generate(list(range(10, 50)), SamplingParams(max_tokens=4))
    assert gen.versions == [1] * 4
