"""A tiny real Qwen3 whose greedy reply to any generation prompt is a thought, then an answer.

Its weights are set, not trained: every decoder layer's output projections are zero (the residual stream holds
the token's embedding alone), and the head maps each token of a walk to the next, a bigram walk
`<generation prompt's last token> <think> plan </think> ok <|im_end|>`. So the hf engine samples it like any model
(greedy, or at temperature 1 almost surely the same), with its own logprobs, and a fresh forward scores it alike.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from transformers import PreTrainedModel

from agentrl.models.tiny import tiny_model
from agentrl.models.tokenizer import load_tokenizer
from agentrl.rollout import ChatFormat

THOUGHT, ANSWER = "plan", "ok"
REPLY = f"<think>{THOUGHT}</think>{ANSWER}"


def thinking_policy(scale: float = 40.0) -> PreTrainedModel:
    chat = ChatFormat(load_tokenizer("qwen3"))
    walk = [chat.prompt_ids([{"role": "user", "content": "x"}])[-1], *chat.encode(REPLY), chat.turn_end_id]
    assert len(set(walk)) == len(walk), f"the walk must not revisit a token: {walk}"
    model = tiny_model("qwen3", seed=0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = model.lm_head.weight
        head.zero_()
        for cur, nxt in itertools.pairwise(walk):
            h = model.model.norm(model.model.embed_tokens.weight[cur])  # the final hidden state after `cur`
            head[nxt] += scale * h / h.square().sum()
    return model.eval()


def save_thinking_policy(path: Path) -> Path:
    thinking_policy().save_pretrained(path)
    load_tokenizer("qwen3").save_pretrained(path)
    return path
