"""The project's own tokenizer, with two chat templates.

No model hub is reachable on the machines this is built on, so tests, examples and the
tiny models use a byte-level BPE the project ships (`assets/tokenizer.json`, made by
`scripts/make_tokenizer.py`). Two chat templates cover the two families that matter for
multi-turn token bookkeeping:

- "qwen3": ChatML with tool calls in `<tool_call>` tags, tool results grouped in a user
  turn inside `<tool_response>`, and Qwen3's `<think>` handling: the reasoning of an
  assistant turn is dropped from the rendering once a later user message exists. That
  history rewriting is exactly what makes re-rendering a conversation drift from the
  tokens the model saw (see `agentrl.rollout.chat`).
- "llama3": Llama-3 header blocks, `<|eot_id|>` ends a turn, tool results as `ipython`.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

from tokenizers import Tokenizer, decoders
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

ASSETS = Path(__file__).parent / "assets"

# Control tokens: special (dropped by `decode(skip_special_tokens=True)`).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
# Markup tokens: atomic but part of the text an env reads, as in Qwen3's tokenizer.
MARKUP_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

QWEN3_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou may call one or more functions. Their signatures are within <tools></tools>:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nFor each call, return a JSON object within <tool_call></tool_call> tags:\n' }}
{{- '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'system' and loop.first %}
{%- elif m.role in ['system', 'user'] %}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- elif m.role == 'assistant' %}
{%- set content = m.content %}{%- set reasoning = '' %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
{{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content + '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}
{%- endif %}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""

LLAMA3_TEMPLATE = r"""
{{- '<|begin_of_text|>' }}
{%- if tools %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content | trim + '\n\n' }}{%- endif %}
{{- 'You have access to these functions. To call one, respond with ' }}
{{- '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>.\n' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '<|eot_id|>' }}
{%- elif messages[0].role == 'system' %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' + messages[0].content | trim + '<|eot_id|>' }}
{%- endif %}
{%- for m in messages %}
{%- if not (m.role == 'system' and loop.first) %}
{%- set role = 'ipython' if m.role == 'tool' else m.role %}
{{- '<|start_header_id|>' + role + '<|end_header_id|>\n\n' + m.content | trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

TemplateName = Literal["qwen3", "llama3"]
TEMPLATES: dict[str, dict[str, str]] = {
    "qwen3": {"chat_template": QWEN3_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "llama3": {
        "chat_template": LLAMA3_TEMPLATE,
        "eos_token": "<|eot_id|>",
        "pad_token": "<|end_of_text|>",
        "bos_token": "<|begin_of_text|>",
    },
}


@functools.cache
def _tokenizer_json() -> str:
    return (ASSETS / "tokenizer.json").read_text()


def load_tokenizer(template: TemplateName = "qwen3") -> PreTrainedTokenizerFast:
    """The project tokenizer with the named chat template (a fresh object per call)."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown chat template {template!r}; choose one of {sorted(TEMPLATES)}")
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json()), **TEMPLATES[template])
    tok.chat_template = TEMPLATES[template]["chat_template"]
    return tok


@functools.cache
def _byte_of() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[bytes]:
    """Each token's own bytes: joined, they are the tokens' text in UTF-8 exactly, also where a token holds part of a
    character (decoded alone, such a token is U+FFFD, whose bytes are not its own).

    A byte-level BPE (GPT-2's, Qwen's, Llama 3's, the project's) writes each byte as one printable character of GPT-2's
    `bytes_to_unicode` table: a token's characters map back to its bytes as its ByteLevel decoder maps them (a token
    with a character outside the table, as an added token may have, is its own text). Another tokenizer's tokens
    are their decoded text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.decoder, decoders.ByteLevel):
        return [tokenizer.decode([t], skip_special_tokens=False).encode() for t in ids]
    byte_of = _byte_of()
    return [
        bytes(byte_of[c] for c in token) if all(c in byte_of for c in token) else token.encode()
        for token in tokenizer.convert_ids_to_tokens(ids)
    ]
