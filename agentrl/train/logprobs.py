"""Log-probabilities of target tokens without a float32 (B, T, V) tensor.

A causal LM's last hidden states h (B, T, H) and its output head W (V, H) give the logits;
at vocab 152k and 8k tokens those are 5 GB in fp32, more than the model on a small GPU. Here
the positions are cut into chunks: each chunk's logits are made (in the head's dtype), upcast
to fp32, turned into lp(y) under the engine's sampling distribution (`agentrl.engine.sampling`,
invariant 2) and dropped. Each chunk runs under activation checkpointing, so backward
recomputes its logits instead of keeping them: peak memory is one chunk's logits, not T's.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from agentrl.engine.base import SamplingParams
from agentrl.engine.sampling import sampling_logprobs

PLAIN_SOFTMAX = SamplingParams(temperature=1.0)  # lp under the model's plain softmax

LOGIT_TRANSFORMS = {
    "final_logit_softcapping": None,  # Gemma 2: cap · tanh(logits / cap)
    "logits_soft_cap": None,  # RecurrentGemma, the same
    "logits_scaling": 1.0,  # Granite divides by it, others multiply
    "logit_scale": 1.0,  # Cohere
    "output_multiplier": 1.0,
    "lm_head_multiplier": 1.0,
}
"""the config settings with which transformers' causal LMs change the head's logits after it, each with the value
that changes nothing"""


def check_plain_head(lm: torch.nn.Module) -> None:
    """Raise ValueError unless `lm`'s logits are its output head's product alone, h · Wᵀ, which `target_logprobs`
    computes: a bias, a softcap or a scale the model applies after its head would make the learner's lp differ from
    the engine's, whose logits are the model's own (the ratios and the behaviour weight biased, silently)."""
    configs = {id(c): c for c in (lm.config, lm.config.get_text_config())}.values()
    applied = [
        f"{name}={value}"
        for c in configs
        for name, neutral in LOGIT_TRANSFORMS.items()
        if (value := getattr(c, name, neutral)) not in (neutral, None)
    ]
    if getattr(lm.get_output_embeddings(), "bias", None) is not None:
        applied.append("a bias in its output head")
    if applied:
        raise ValueError(
            f"{lm.config.model_type} changes its logits after the output head ({', '.join(applied)}), which the "
            "learner's scorer, h · Wᵀ in chunks, does not: its logprobs would not be the engine's. Supported: models "
            "whose logits are the head's product alone (Qwen, Llama, Mistral, Mixtral, ...)"
        )


def _chunk(
    h: torch.Tensor, W: torch.Tensor, y: torch.Tensor, params: SamplingParams, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    logq = sampling_logprobs(h @ W.T, params.temperature, params.top_k, params.top_p)  # (n, V) fp32
    lp = logq.gather(-1, y[:, None])[:, 0]
    if not with_entropy:
        return lp, lp.new_zeros(())
    with torch.no_grad():
        q = logq.exp()
        entropy = -(q * torch.where(q > 0, logq, 0.0)).sum(-1)  # filtered tokens: 0·log 0 = 0
    return lp, entropy


def target_logprobs(
    hidden: torch.Tensor,
    head: torch.Tensor,
    targets: torch.Tensor,
    params: SamplingParams = PLAIN_SOFTMAX,
    *,
    chunk_size: int | None = None,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """lp(targets) (B, T) in fp32, and optionally the entropy of q per position (B, T), no gradient.

    hidden (B, T, H): the hidden state that predicts targets[:, t] at position t (already shifted).
    head (V, H): the output embedding. params: the distribution the tokens were sampled from.
    chunk_size: positions per chunk; by default as many as keep one chunk's fp32 logits near
    64 MB (2^24 values).
    """
    B, T, H = hidden.shape
    chunk_size = chunk_size or max(16, 2**24 // head.shape[0])
    h, y = hidden.reshape(B * T, H), targets.reshape(B * T)
    lps, ents = [], []
    # at least one chunk, empty if nothing is scored (a length bucket of one-token rows): lp (B, 0) on the graph
    for start in range(0, max(B * T, 1), chunk_size):
        args = (h[start : start + chunk_size], head, y[start : start + chunk_size], params, entropy)
        lp, ent = checkpoint(_chunk, *args, use_reentrant=False) if torch.is_grad_enabled() else _chunk(*args)
        lps.append(lp)
        ents.append(ent)
    lp = torch.cat(lps).reshape(B, T)
    return lp, (torch.cat(ents).reshape(B, T) if entropy else None)


def naive_target_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, params: SamplingParams = PLAIN_SOFTMAX
) -> torch.Tensor:
    """The reference: the whole (B, T, V) logits at once, upcast to fp32."""
    logq = sampling_logprobs(logits, params.temperature, params.top_k, params.top_p)
    return logq.gather(-1, targets[..., None])[..., 0]
