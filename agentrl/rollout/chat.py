"""Chat-template deltas: the tokens to append after a generated turn, without re-rendering.

Re-rendering a conversation and re-tokenising it drifts from what the model saw: BPE merges
across the boundary between generated text and template text differ, decoded text does not
re-encode to the same ids, and templates rewrite history (Qwen3 drops the `<think>` part of
earlier assistant turns). So the next prompt is the current sequence + a delta (or, by choice, a new sequence of
the episode: `agentrl.rollout.context`), where the delta comes from rendering the new messages after a stand-in
assistant turn:

    full = render([user, assistant(SENTINEL), *new], generation_prompt)
    delta = full[after SENTINEL:]                      # <|im_end|>\n<|im_start|>user\n...assistant\n

The prefix property is checked on every delta: `full` must start with the rendering of the
turns before the assistant's and hold the assistant's content once (the template does not
rewrite or drop earlier turns when messages are appended), and the delta must start with a
special token, so no BPE merge can join it to whatever the model wrote. Either failing
raises `TemplatePrefixError`. When the model closed its turn
with a stop token that the delta starts with, that token is not repeated; when it was cut
(length), the delta's end-of-turn tokens close it.

A message's text is text: where it holds a control token's text (a tool printing `<|im_end|>`), those characters
are tokenized as characters, never as the control token, so no observation, prompt or demonstration can forge a
turn boundary or put a stop token inside a turn. Markup tokens (`<tool_call>`, `<think>`) stay atomic, as the model
writes them.

What the trajectory keeps of a turn is what the model generated, `<think>` included: the
next turn's prompt is the one the model really continued, not a re-rendered version of it.
"""

from __future__ import annotations

import re
from typing import Any

from transformers import PreTrainedTokenizerBase

from agentrl.env.base import Message

SENTINEL = "AGENTRLSENTINEL"
_STAND_IN: list[Message] = [{"role": "user", "content": "x"}]
# a hole in a message's text: private-use characters around the index of the text it stands for
_HOLE_OPEN, _HOLE_CLOSE = "\U000f0000", "\U000f0001"
_HOLE = re.compile(f"{_HOLE_OPEN}(\\d+){_HOLE_CLOSE}")


class TemplatePrefixError(ValueError):
    """The chat template breaks the prefix property, so deltas cannot be token-exact."""


class ChatFormat:
    """Turns chat messages into token ids for one tokenizer and its chat template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, template_kwargs: dict[str, Any] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; set tokenizer.chat_template")
        self.tokenizer = tokenizer
        self.template_kwargs = template_kwargs or {}
        stops = {tokenizer.eos_token_id}
        for t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"):
            tid = tokenizer.convert_tokens_to_ids(t)
            if isinstance(tid, int) and tid != tokenizer.unk_token_id and t in tokenizer.all_special_tokens:
                stops.add(tid)
        self._stand_in_rendered = self.render(_STAND_IN, generation_prompt=False)  # the same for every delta
        if self.render(_STAND_IN, generation_prompt=False) != self._stand_in_rendered:
            raise TemplatePrefixError(
                "the chat template is not deterministic (one conversation rendered twice differs: a date or time in "
                f"it?): {self._stand_in_rendered!r}; a trajectory's tokens could not be laid out again"
            )
        self._atomic = set(tokenizer.get_added_vocab())  # special and added tokens: never merged
        control = sorted((t.content for t in tokenizer.added_tokens_decoder.values() if t.special), key=len)[::-1]
        # the hole characters too: a text holding them must not read as a hole
        self._hidden = re.compile("|".join(map(re.escape, [*control, _HOLE_OPEN, _HOLE_CLOSE])))
        self.stop_token_ids: tuple[int, ...] = tuple(sorted(i for i in stops if i is not None))
        self.turn_end_id = self.observation_ids([], last_token=None)[0]
        """the token that closes an assistant turn in this template (<|im_end|>, <|eot_id|>)"""

    def render(self, messages: list[Message], *, tools: list[dict] | None = None, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **self.template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _hide(self, messages: list[Message], texts: list[str]) -> list[Message]:
        """`messages` with each control token's text in their content replaced by a hole, whose text joins `texts`."""

        def hole(m: re.Match) -> str:
            texts.append(m.group())
            return f"{_HOLE_OPEN}{len(texts) - 1}{_HOLE_CLOSE}"

        return [
            {**m, "content": self._hidden.sub(hole, m["content"])} if isinstance(m.get("content"), str) else m
            for m in messages
        ]

    def _ids(self, rendered: str, texts: list[str]) -> list[int]:
        """A rendering with holes as token ids: the template's text as the tokenizer reads it, a hole's as characters.
        The tokenizer splits the text at an added token before any merge, so the tokens around a hole are those
        around the control token the text held."""
        parts = _HOLE.split(rendered)  # rendered text and hole indices, in turn
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                ids += self.tokenizer.encode(texts[int(part)], add_special_tokens=False, split_special_tokens=True)
            else:
                ids += self.encode(part)
        return ids

    def prompt_ids(self, messages: list[Message], *, tools: list[dict] | None = None) -> list[int]:
        """The first prompt: the opening messages rendered with the generation prompt."""
        texts: list[str] = []
        return self._ids(self.render(self._hide(messages, texts), tools=tools, generation_prompt=True), texts)

    def observation_ids(self, messages: list[Message], *, last_token: int | None) -> list[int]:
        """The delta after a generated turn whose last token is `last_token` (see module doc)."""
        texts: list[str] = []
        messages = self._hide(messages, texts)
        full = self.render([*_STAND_IN, {"role": "assistant", "content": SENTINEL}, *messages], generation_prompt=True)
        before = self._stand_in_rendered
        if not full.startswith(before) or SENTINEL not in full[len(before) :]:
            raise TemplatePrefixError(
                "the chat template rewrites earlier turns once messages are appended, so a conversation is "
                f"not a prefix of its continuation: {before!r} + an assistant turn rendered as {full!r}"
            )
        # the first one after the stand-in is the assistant turn's: an observation may hold the same text (a tool's
        # output, an echoed malformed call), which must not fail the episode
        head = full[: full.index(SENTINEL, len(before)) + len(SENTINEL)]
        delta = self._ids(full[len(head) :], texts)
        if not delta or self.tokenizer.convert_ids_to_tokens(delta[0]) not in self._atomic:
            raise TemplatePrefixError(
                f"the assistant turn ends with plain text ({full[len(head) : len(head) + 20]!r}), which BPE may "
                "merge with what the model wrote: the template's end-of-turn text must start with a special token"
            )
        if last_token is not None and delta[:1] == [last_token]:
            delta = delta[1:]  # the model closed its own turn
        return delta

    def conversation_ids(
        self, messages: list[Message], *, tools: list[dict] | None = None
    ) -> tuple[list[int], list[int]]:
        """A whole conversation laid out token for token as a rollout lays it out, and its loss mask.

        The opening messages (up to the first assistant one) are the prompt; each assistant
        message is its content's tokens closed by `turn_end_id` (mask 1), as if the model had
        written it and stopped; the messages after it are an observation delta (mask 0). So
        supervised fine-tuning trains on exactly the token sequences the policy sees in RL.
        An assistant message with `"weight": 0` (OpenAI's fine-tuning format) stays in the
        context but is masked out: an error a demonstration recovers from, never a target.
        """
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if first is None or first == 0:
            raise ValueError("a conversation needs opening messages, then at least one assistant message")
        ids = self.prompt_ids(messages[:first], tools=tools)
        mask = [0] * len(ids)
        i = first
        while i < len(messages):
            texts: list[str] = []
            turn = [*self._ids(self._hide([messages[i]], texts)[0]["content"], texts), self.turn_end_id]
            weight = messages[i].get("weight", 1)
            if weight not in (0, 1) or isinstance(weight, bool):
                raise ValueError(f"message {i}: an assistant message's weight is 0 or 1, not {weight!r}")
            ids += turn
            mask += [weight] * len(turn)
            j = next((k for k in range(i + 1, len(messages)) if messages[k]["role"] == "assistant"), len(messages))
            if j > i + 1 or j < len(messages):  # an empty delta still opens the next assistant turn
                delta = self.observation_ids(messages[i + 1 : j], last_token=self.turn_end_id)
                ids += delta
                mask += [0] * len(delta)
            i = j
        return ids, mask

    def decode(self, generated: list[int]) -> str:
        """The text an environment reads: markup such as <tool_call> kept, a final stop token dropped."""
        if generated and generated[-1] in self.stop_token_ids:
            generated = generated[:-1]
        return self.tokenizer.decode(generated, skip_special_tokens=False)
