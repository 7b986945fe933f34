"""The embedded default policy: a small Qwen3-MoE that ships inside the package.

`agentrl train --env code_sandbox` starts from it, offline. It is made by the project itself
(no download): a random-init model of `ARCHITECTURE` with the project tokenizer
(`agentrl models init`), fine-tuned with `agentrl sft` on demonstrations that the
procedural task generator's reference solutions play through the real `code_sandbox` env
(`agentrl envs demos`). `scripts/build_default_policy.sh` runs the three steps. The expert
it imitates has a habit (it mostly prints its result instead of returning it), so the policy
starts with a low success rate for RL to raise.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_POLICY = Path(__file__).parent / "assets" / "default_policy"

ARCHITECTURE = dict(
    hidden_size=192,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    max_position_embeddings=4096,
)
"""Qwen3-MoE shapes: 3.5M parameters (4 experts, top-2 routing), the project tokenizer's 2054-token vocabulary"""

SMALL_ARCHITECTURE = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=512,
    max_position_embeddings=4096,
)
"""14.4M parameters (8 experts, top-2), twice the default's active parameters: `agentrl models init --preset small`,
a larger starting point where the default policy is too small to learn a task (repo_fix's copying of text)"""


def default_policy() -> Path:
    """The shipped checkpoint's folder; a clear error if this install lacks it."""
    if not (DEFAULT_POLICY / "config.json").exists():
        raise FileNotFoundError(
            f"the default policy is missing from {DEFAULT_POLICY}; rebuild it with scripts/build_default_policy.sh"
        )
    return DEFAULT_POLICY


def resolve_path(path: str) -> str:
    """A model path as from_pretrained takes it: "default" is the embedded default policy's folder, a local folder
    is made absolute (it may be handed to processes with another working directory: Ray actors), a hub id is
    itself."""
    if path == "default":
        return str(default_policy())
    if not path:
        raise ValueError('model.path is empty: give a Hugging Face folder, a hub id, or "default"')
    return str(Path(path).absolute()) if Path(path).exists() else path
