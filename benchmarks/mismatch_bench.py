"""A real engine/learner mismatch on a CPU: the hf engine's bf16 modes against the learner's float32, in one run.

For each `engine.dtype` (float32: its own copy, as the learner; bfloat16_weights: weights rounded to bf16, float32
compute; bfloat16: bf16 weights and compute) the engine samples the same requests (temperature 1, the same
seeds), recording its MoE routing; the float32 learner (`Scorer`, the update's forward) then scores the sampled
tokens. Printed as one JSON object, per mode:

- decode speed: generated tokens per second over all requests (one batch), and its ratio to float32's;
- logprob mismatch over the generated tokens: mean, p99 and max of |lp_learner − lp_engine|, and the mean per
  sequence of k3(lp_learner − lp_engine) (an estimate of KL(engine ‖ learner));
- router disagreement (`agentrl.train.diagnostics.router_disagreement`): the share of (token, layer) pairs whose
  top-k set differs, and of tokens with any layer differing;
- the same mismatch with routing replay (R3, `r3_*`): the learner's forward routed to the engine's recorded experts
  at every position, prompt included.

    python benchmarks/mismatch_bench.py                           # the default policy, 16 requests x 64 tokens
    python benchmarks/mismatch_bench.py --model DIR --requests 32  # another Hugging Face folder
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import harness
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.engine import EngineConfig, EngineModel, build_engine
from agentrl.engine.base import Generation, SamplingParams
from agentrl.models.default import resolve_path
from agentrl.train.diagnostics import router_disagreement
from agentrl.train.replay import position_routing
from agentrl.train.scoring import Scorer

MODES = ("float32", "bfloat16_weights", "bfloat16")


def prompts(path: str, n: int) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(path)
    tasks = [
        f"Write a Python function f(xs) that returns the sum of the first {i + 2} items of the list xs."
        for i in range(n)
    ]
    texts = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        for t in tasks
    ]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


async def sample(path: str, mode: str, reqs: list[list[int]], tokens: int) -> tuple[list[Generation], float]:
    cfg = EngineConfig(kind="hf", dtype=mode, record_routing=True, max_batch_size=len(reqs))
    async with build_engine(cfg, EngineModel(path=path), seed=0) as engine:
        params = [SamplingParams(temperature=1.0, max_tokens=tokens, seed=i) for i in range(len(reqs))]
        await engine.generate(reqs[0], SamplingParams(temperature=1.0, max_tokens=4, seed=0))  # warm-up
        t0 = time.perf_counter()
        gens = await asyncio.gather(*(engine.generate(p, s) for p, s in zip(reqs, params, strict=True)))
        return list(gens), time.perf_counter() - t0


def compare(scorer: Scorer, reqs: list[list[int]], gens: list[Generation]) -> dict[str, float]:
    """The learner's scoring of what the engine sampled, against the engine's own logprobs and routing."""
    B, L = len(reqs), max(len(p) + len(g.token_ids) for p, g in zip(reqs, gens, strict=True))
    ids, attention, mask = torch.zeros(B, L, dtype=torch.long), torch.zeros(B, L, dtype=torch.long), torch.zeros(B, L)
    lp_b = torch.zeros(B, L)
    layers, k = (len(gens[0].routed_experts[0]), len(gens[0].routed_experts[0][0]))
    routed = torch.full((B, L, layers, k), -1, dtype=torch.long)
    for b, (p, g) in enumerate(zip(reqs, gens, strict=True)):
        n, end = len(p), len(p) + len(g.token_ids)
        ids[b, :end] = torch.tensor(p + g.token_ids)
        attention[b, :end], mask[b, n:end] = 1, 1
        lp_b[b, n:end] = torch.tensor(g.logprobs)
        # token t's record: the forward at t - 1 that predicted it (prompt positions, then the sampling ones)
        routed[b, 1:end] = torch.tensor(g.prompt_routing + g.routed_experts)
    params = SamplingParams(temperature=1.0)
    with torch.no_grad():
        lp, _, router = scorer(ids, attention, params, router=True)
        lp_r3 = scorer(ids, attention, params, routing=position_routing(routed))[0]
    counts = router_disagreement(routed, router, mask)
    share = {key: counts[key][0] / counts[key][1] for key in ("router_disagreement", "router_disagreement_tokens")}
    return {**_mismatch(lp, lp_b, mask), **share, **{f"r3_{k}": v for k, v in _mismatch(lp_r3, lp_b, mask).items()}}


def _mismatch(lp: torch.Tensor, lp_b: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """|lp_learner − lp_engine| over the generated tokens (mean, p99, max) and the mean k3 sequence KL."""
    d = (lp - lp_b)[mask.bool()]
    per_seq = torch.stack([_k3((lp - lp_b)[b][mask[b].bool()]) for b in range(len(lp))])
    return {
        "lp_abs_diff_mean": float(d.abs().mean()),
        "lp_abs_diff_p99": float(d.abs().quantile(0.99)),
        "lp_abs_diff_max": float(d.abs().max()),
        "seq_kl_k3_mean": float(per_seq.mean()),
    }


def _k3(d: torch.Tensor) -> torch.Tensor:
    """mean over a sequence of exp(d) − d − 1, d = lp_learner − lp_engine on the engine's samples."""
    return (d.exp() - d - 1).mean()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="a Hugging Face folder (default: the embedded default policy)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    args = ap.parse_args()
    path = resolve_path(args.model)
    reqs = prompts(path, args.requests)
    scorer = Scorer(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), replay=True)
    out: dict = {
        "model": args.model,
        "requests": args.requests,
        "tokens": args.tokens,
        "machine": harness.machine("torch") | {"threads": torch.get_num_threads()},
        "modes": {},
    }
    for mode in MODES:
        gens, wall = asyncio.run(sample(path, mode, reqs, args.tokens))
        generated = sum(len(g.token_ids) for g in gens)
        out["modes"][mode] = {"tokens_per_s": generated / wall, **compare(scorer, reqs, gens)}
    base = out["modes"]["float32"]["tokens_per_s"]
    for m in out["modes"].values():
        m["speed_vs_float32"] = m["tokens_per_s"] / base
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
