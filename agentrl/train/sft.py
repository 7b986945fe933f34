"""Supervised fine-tuning on chat conversations, with the loss on the assistant's tokens only.

Data: JSONL, one conversation per line: `{"messages": [{"role", "content"}, ...], "tools": [...]}`
(`tools` optional: JSON schemas the chat template renders). Each conversation is laid out
token for token as a rollout lays it out (`ChatFormat.conversation_ids`): the opening
messages are the prompt, each assistant message is its content closed by the template's
end-of-turn token, and what follows it is an observation delta. So a policy fine-tuned here
is scored in RL on exactly the token sequences it was trained on.

Loss: L = − Σ_b Σ_t m_{b,t} lp_θ(t) / Σ_b Σ_t m_{b,t} over a step's conversations (every
assistant token weighs the same; a step's conversations are split over the ranks and the
token count is the global one), plus the router's load-balancing loss for MoE models.
AdamW, linear warmup then cosine decay to `min_lr_ratio · lr` (a warmup as long as the run is refused: lr would
never be reached), gradients clipped. The `lr` logged at a step is the one that step used.

Resuming: with `save_every`, each step-N save also writes `out/resume-N`, a `torch.distributed.checkpoint` of the
model, optimizer, schedule and RNG with the data order still to come; `resume` continues from the latest one, so
an interrupted run ends with the weights an uninterrupted one would have had. The resume folders go once the
final model is saved.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import Field
from transformers import AutoTokenizer

from agentrl.models.default import resolve_path
from agentrl.rollout.chat import ChatFormat
from agentrl.train.config import ModelConfig, _Strict, lr_factor
from agentrl.train.logprobs import PLAIN_SOFTMAX
from agentrl.train.policy import causal_lm, load_policy, prepare, train_device
from agentrl.train.scoring import Scorer
from agentrl.train.trainer import clip_grad_norm, router_aux_loss


class SFTConfig(_Strict):
    data: str
    """chat JSONL: one conversation per line, {"messages": [...], "tools": [...]}"""
    out: str
    """where the fine-tuned model and its tokenizer are saved (a Hugging Face folder)"""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """the model to fine-tune (model.path: a Hugging Face folder with a tokenizer and chat template)"""
    epochs: float = Field(1.0, gt=0)
    """passes over the training conversations (fractions allowed); `steps` overrides it"""
    steps: int | None = Field(None, ge=1)
    """optimizer steps; None: as many as `epochs` takes"""
    batch_size: int = Field(32, ge=1)
    """conversations per optimizer step, over all ranks"""
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(20, ge=0)
    """optimizer steps of linear warmup from lr / (warmup_steps + 1); fewer than the run's steps"""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """the cosine schedule ends at this fraction of lr"""
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    max_length: int = Field(4096, ge=2)
    """conversations longer than this many tokens are left out (and counted)"""
    eval_fraction: float = Field(0.02, ge=0, lt=1)
    """share of conversations held out to report an evaluation loss"""
    eval_every: int = Field(100, ge=1)
    """optimizer steps between evaluation losses"""
    save_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the saved weights (bfloat16 halves the folder; from_pretrained upcasts on load)"""
    save_every: int = Field(0, ge=0)
    """also save the model every N steps to out/step-N, to pick a checkpoint later, and the state to resume from
    (out/resume-N; 0: only the model, at the end)"""
    resume: bool = False
    """continue from the latest out/resume-N if there is one (saved with these settings, `out`, `resume` and the
    data's path aside, and the same data file's bytes)"""
    seed: int = 0


@dataclass
class _Run:
    """What a resume folder holds (`checkpoint.Trained`)."""

    scorer: Scorer
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    rank: int


def _resumable(out: Path) -> Path | None:
    """The latest finished resume folder in `out` (one without state.json was cut off while being written)."""
    done = {
        int(n): p
        for p in out.glob("resume-*")
        if (n := p.name.removeprefix("resume-")).isdigit() and (p / "state.json").exists()
    }
    return done[max(done)] if done else None


@dataclass
class Example:
    ids: list[int]
    mask: list[int]


def _check_assistant_messages(messages: list) -> None:
    """What `ChatFormat.conversation_ids` would not lay out as written, refused naming the message: it takes an
    assistant message's text content alone (any other key, tool calls included, would be dropped), and an empty one
    to train on would teach the model to end its turn at once."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"message {i}: not an object with a string 'role'")
        if m["role"] != "assistant":
            continue
        if extra := sorted(set(m) - {"role", "content", "weight"}):
            raise ValueError(
                f"message {i}: an assistant message is laid out from its content alone, and its {extra} would be "
                "dropped (tool calls go into its content, as the template renders them)"
            )
        if not isinstance(m.get("content"), str):
            raise ValueError(f"message {i}: an assistant message's content is a string, not {m.get('content')!r}")
        if not m["content"].strip() and m.get("weight", 1) != 0:
            raise ValueError(f"message {i}: an empty assistant message is nothing to train on (give it weight 0)")


def load_conversations(path: str | Path, chat: ChatFormat, max_length: int) -> tuple[list[Example], int]:
    """Every conversation of a chat JSONL, tokenised; and how many were too long. Errors name the line."""
    examples, too_long = [], 0
    with open(path, "rb") as f:  # JSON is UTF-8 whatever the locale; a bad byte is named with its line below
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
                    raise ValueError('not an object with a "messages" list')
                _check_assistant_messages(row["messages"])
                ids, mask = chat.conversation_ids(row["messages"], tools=row.get("tools"))
                if not any(mask):
                    raise ValueError("every assistant message has weight 0: nothing to train on")
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{n}: not a chat conversation ({type(e).__name__}: {e})") from None
            if len(ids) > max_length:
                too_long += 1
            else:
                examples.append(Example(ids, mask))
    if not examples:
        raise ValueError(f"{path}: no conversation of at most {max_length} tokens")
    return examples, too_long


def _collate(examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    L = max(len(e.ids) for e in examples)
    ids = torch.zeros(len(examples), L, dtype=torch.long)
    attn, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, e in enumerate(examples):
        ids[i, : len(e.ids)] = torch.tensor(e.ids)
        attn[i, : len(e.ids)] = 1
        mask[i, : len(e.ids)] = torch.tensor(e.mask)
    return ids, attn, mask


def sft(cfg: SFTConfig, log: Callable[[dict], None] = print) -> dict[str, float]:
    """Fine-tune, save to `cfg.out`, and return the last metrics. Every rank calls it."""
    from agentrl.train import checkpoint

    torch.manual_seed(cfg.seed)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    tokenizer = AutoTokenizer.from_pretrained(resolve_path(cfg.model.path))
    chat = ChatFormat(tokenizer)
    examples, too_long = load_conversations(cfg.data, chat, cfg.max_length)
    random.Random(cfg.seed).shuffle(examples)
    n_eval = int(len(examples) * cfg.eval_fraction)
    held_out, examples = examples[:n_eval], examples[n_eval:]
    steps = cfg.steps or max(1, math.ceil(cfg.epochs * len(examples) / cfg.batch_size))
    if cfg.warmup_steps >= steps:  # the learning rate would never reach lr, nor decay
        of = (
            "" if cfg.steps else f" ({len(examples)} conversations x epochs={cfg.epochs} / batch_size={cfg.batch_size})"
        )
        raise ValueError(
            f"warmup_steps={cfg.warmup_steps} is not shorter than the run's {steps} optimizer steps{of}: the learning "
            "rate would never reach lr; lower warmup_steps"
        )

    policy = load_policy(cfg.model)
    scorer = Scorer(policy)
    device = train_device()
    prepare(policy, cfg.model, device, root=scorer)
    config = causal_lm(policy).config
    top_k = getattr(config, "num_experts_per_tok", 0)
    aux_coef = float(getattr(config, "router_aux_loss_coef", 0.0)) if cfg.model.router_aux_loss and top_k else 0.0
    params = [p for p in scorer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)  # as the trainer's
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup_steps, steps, cfg.min_lr_ratio)
    )

    def loss_of(batch: list[Example], *, train: bool) -> tuple[torch.Tensor, float]:
        """This rank's share of the batch: (loss to backpropagate, summed −lp over its assistant tokens)."""
        n_tokens = sum(sum(e.mask) for e in batch)
        mine = batch[rank::world] or batch[:1]  # a rank without rows still joins FSDP's collectives
        ids, attn, mask = (t.to(device) for t in _collate(mine))
        counted = attn  # the tokens the router loss counts: a stand-in row's none
        if not batch[rank::world]:
            mask, counted = torch.zeros_like(mask), torch.zeros_like(attn)
        lp, _, router = scorer(ids, attn, PLAIN_SOFTMAX, router=bool(aux_coef) and train)
        nll = -(lp * mask).sum()
        loss = nll * world / max(n_tokens, 1)  # FSDP averages gradients over ranks
        if router is not None:
            loss = loss + aux_coef * router_aux_loss(router, top_k, counted)
        return loss, float(nll.detach())

    def evaluate() -> float:
        scorer.eval()
        total = sum(sum(e.mask) for e in held_out)
        with torch.no_grad():
            nll = sum(
                loss_of(held_out[i : i + cfg.batch_size], train=False)[1]
                for i in range(0, len(held_out), cfg.batch_size)
            )
        scorer.train()
        return _all_sum(nll, device) / max(total, 1)

    def save(path: Path) -> None:
        checkpoint.export_hf(scorer, path, dtype=cfg.save_dtype)
        if rank == 0:
            tokenizer.save_pretrained(path)
            summary = {**metrics, "conversations": len(examples), "held_out": len(held_out), "too_long": too_long}
            (path / "agentrl_sft.json").write_text(
                json.dumps({"config": cfg.model_dump(mode="json"), "final": summary}, indent=1)
            )

    out = Path(cfg.out)
    run = _Run(scorer, optimizer, schedule, rank)
    # the folders may have moved (or be named from another directory): the data's digest stands for its path
    settings = cfg.model_dump(mode="json", exclude={"resume", "out", "data"})
    with open(cfg.data, "rb") as f:  # demonstrations recorded again may come in another order
        settings["data_sha256"] = hashlib.file_digest(f, "sha256").hexdigest()
    order: list[int] = []
    metrics: dict[str, float] = {}
    start = 0
    if cfg.resume and (latest := _resumable(out)) is not None:
        state = checkpoint.load(latest, run)
        if changed := sorted(k for k in settings if state["settings"].get(k) != settings[k]):
            raise ValueError(f"{latest} was saved with other settings ({', '.join(changed)}); resume with its own")
        start, order, metrics = state["step"], state["order"], state["metrics"]
        if rank == 0:
            log({"resumed": str(latest), "step": start})
    scorer.train()
    for step in range(start, steps):
        while len(order) < cfg.batch_size:  # epochs reshuffled, seeded
            order += random.Random(cfg.seed + len(order) + step).sample(range(len(examples)), len(examples))
        batch, order = [examples[i] for i in order[: cfg.batch_size]], order[cfg.batch_size :]
        loss, nll = loss_of(batch, train=True)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = clip_grad_norm(params, cfg.max_grad_norm)
        lr = optimizer.param_groups[0]["lr"]  # this step's: after schedule.step() it is the next one's
        optimizer.step()
        schedule.step()
        n_tokens = sum(sum(e.mask) for e in batch)
        metrics = {
            "step": step + 1,
            "loss": _all_sum(nll, device) / n_tokens,
            "lr": lr,
            "grad_norm": float(grad_norm),
        }
        if held_out and ((step + 1) % cfg.eval_every == 0 or step + 1 == steps):
            metrics["eval_loss"] = evaluate()
        if rank == 0:
            log(metrics)
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < steps:
            save(out / f"step-{step + 1}")
            state = {"step": step + 1, "order": order, "metrics": metrics, "settings": settings}
            checkpoint.save(out / f"resume-{step + 1}", run, state)
            _drop_resume_folders(out, rank, keep=step + 1)
    save(out)
    _drop_resume_folders(out, rank)
    return metrics


def _drop_resume_folders(out: Path, rank: int, keep: int | None = None) -> None:
    """Rank 0 removes the resume folders but the one of step `keep` (once it is finished: checkpoint.save returns
    after every rank wrote and rank 0 wrote state.json last)."""
    if rank == 0:
        for p in out.glob("resume-*"):
            if p.name != f"resume-{keep}":
                shutil.rmtree(p, ignore_errors=True)


def _all_sum(x: float, device: torch.device) -> float:
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device)  # nccl reduces GPU tensors only
    dist.all_reduce(t)
    return float(t)
