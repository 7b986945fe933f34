"""The prompt of an episode's next turn: its record extended, or a new token sequence of the same episode.

Today's rule, and the default: the next prompt is the current sequence extended by the observation's delta
(`ChatFormat.observation_ids`), never a re-rendering. Two settings make a turn's context something else, and
then the turn starts a new sequence (`Trajectory.start_sequence`) whose prompt is the conversation rendered:

- `rollout.thinking: strip`: once a turn thought, the context is the chat template's own rendering of the
  conversation, as when the model is served (Qwen3-style templates drop earlier turns' reasoning, those after the
  last user message only later). Where that rendering is the record extended token for token (a template that
  keeps the thought), the turn appends.
- context folding (`rollout.context`): when the next prompt would leave less than a whole turn under
  `context.max_tokens` (`fold_at`),
  - truncate: the opening messages (system prompt and task) and the last turns that fit, rendered;
  - summarize: the observation and a request for a summary are appended, the policy writes the summary (a turn
    of its own, trained with the episode, never sent to the env), and the next sequence is the opening
    messages and the summary.
  An observation too large on its own is cut to fit, and says so in its text.

An agent program's rewritten history is the third way to a new sequence (`agentrl.rollout.gateway`).
`Conversation` keeps the messages (the assistant's as its decoded text, thoughts included) so that the
conversation can be rendered at any turn; a resumed episode rebuilds it by replaying its env.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentrl.env.base import Message
from agentrl.env.parsers import has_thought, without_thoughts
from agentrl.rollout.chat import ChatFormat
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.trajectory import SequenceReason, Trajectory

SUMMARY_HEAD = "A summary of the work so far (the earlier turns were folded away):\n\n"


@dataclass
class Conversation:
    """An episode's messages: the opening (system prompt, task), then per turn the assistant's message and the
    messages that answered it. `first`: the first turn the context still shows; `summary`: the summary that stands
    for the turns before it (summarize)."""

    opening: list[Message]
    tools: list[dict] | None = None
    turns: list[list[Message]] = field(default_factory=list)
    first: int = 0
    summary: str | None = None

    def context(self, first: int | None = None) -> list[Message]:
        """The messages the policy sees next: the opening, the summary if any, the turns from `first` on."""
        head = [*self.opening]
        if self.summary is not None:
            head.append({"role": "user", "content": SUMMARY_HEAD + self.summary})
        return head + [m for turn in self.turns[self.first if first is None else first :] for m in turn]


@dataclass
class Plan:
    """What follows a turn: `ids` appended to the record (`sequence` None) or starting a sequence for that reason;
    `summarize`: the next turn is the summary; `end`: the episode ends truncated (that reason); `failure`: it fails
    (counted, never scored); `new`: a sequence's tokens new to the episode (`SequenceStart.new`)."""

    ids: list[int] = field(default_factory=list)
    sequence: SequenceReason | None = None
    new: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    summarize: bool = False
    end: str | None = None
    failure: str | None = None


class ContextLayout:
    """The next prompt of an episode, for one chat format and the rollout's settings (module doc)."""

    def __init__(self, chat: ChatFormat, cfg: RolloutConfig, max_context: int) -> None:
        self.chat, self.cfg, self.fold = chat, cfg, cfg.context
        self.limit = min(max_context, self.fold.max_tokens or max_context)
        """the most tokens a sequence holds: the engine's context, or the fold's limit"""
        self.request: Message = {"role": "user", "content": self.fold.summary_prompt}
        self.fold_at: int | None = None
        """the longest prompt that leaves room for a whole turn (and a summary, summarize); None: no folding"""
        if self.fold.max_tokens is not None:
            self.fold_at = self.limit - cfg.sampling.max_tokens
            if self.fold.policy == "summarize":
                request = chat.observation_ids([self.request], last_token=chat.turn_end_id)
                self.fold_at -= self.fold.summary_max_tokens + len(request)

    def opening(self, conv: Conversation) -> list[int]:
        return self.chat.prompt_ids(conv.opening, tools=conv.tools)

    def render(self, conv: Conversation, first: int | None = None) -> list[int]:
        return self.chat.prompt_ids(conv.context(first), tools=conv.tools)

    def after_turn(self, traj: Trajectory, conv: Conversation, observation: list[Message]) -> Plan:
        """The env answered the last turn (`conv.turns[-1]`, the assistant's message) with `observation`."""
        conv.turns[-1] += observation
        context = traj.context_ids
        # a thought the context still shows (the template kept it after a tool message) may be dropped now
        if self.cfg.thinking == "strip" and any(has_thought(turn[0]["content"]) for turn in conv.turns[conv.first :]):
            ids = self.render(conv)
            extends = len(ids) > len(context) and ids[: len(context)] == context
            plan = Plan(ids[len(context) :]) if extends else Plan(ids, SequenceReason.RERENDER)
        else:
            plan = Plan(self.chat.observation_ids(observation, last_token=context[-1]))
        if self.fold_at is not None and len(plan.ids) + (0 if plan.sequence else len(context)) > self.fold_at:
            plan = self._summary_request(traj, conv) if self.fold.policy == "summarize" else self._truncate(conv)
        if plan.sequence is not None:  # the episode grew by the observation (as shown), not by what is repeated
            # the delta closes a turn cut by length: its end-of-turn token is new too
            plan.new = len(self.chat.observation_ids(conv.turns[-1][1:], last_token=context[-1]))
        return plan

    def after_summary(self, conv: Conversation, finish_reason: str) -> Plan:
        """The policy wrote its summary (`conv.turns[-1]`): the next sequence is the opening and the summary."""
        text = without_thoughts(conv.turns[-1][0]["content"]).strip()
        if finish_reason == "length":
            return Plan(failure=f"the summary turn ran past context.summary_max_tokens={self.fold.summary_max_tokens}")
        if not text:
            return Plan(failure="the summary turn was empty")
        folded = list(range(conv.first, len(conv.turns)))
        conv.summary, conv.first = text, len(conv.turns)
        ids = self.render(conv)
        if len(ids) > self.fold_at:
            return Plan(failure=f"the opening and the summary ({len(ids)} tokens) leave no room for a turn")
        return Plan(ids, SequenceReason.FOLD, info={"policy": "summarize", "summarised_turns": folded})

    def _truncate(self, conv: Conversation) -> Plan:
        """The opening and the last turns that fit; the last turn always (its observation cut if need be)."""
        last = len(conv.turns) - 1
        ids, first = self.render(conv, last), last
        for j in range(last - 1, conv.first - 1, -1):  # a context grows as turns are added: stop at the first misfit
            more = self.render(conv, j)
            if len(more) > self.fold_at:
                break
            ids, first = more, j
        info: dict[str, Any] = {"policy": "truncate", "dropped_turns": list(range(conv.first, first))}
        if len(ids) > self.fold_at:
            ids, info["cut_tokens"] = self._cut(conv.turns[last], lambda: self.render(conv, last), self.fold_at)
            if ids is None:
                return Plan(end="context")
        conv.first = first
        return Plan(ids, SequenceReason.FOLD, info=info)

    def _summary_request(self, traj: Trajectory, conv: Conversation) -> Plan:
        """The observation and the summary request, appended (the observation cut to leave the summary room)."""
        turn, context = conv.turns[-1], traj.context_ids
        turn.append(self.request)

        def delta() -> list[int]:
            return self.chat.observation_ids(turn[1:], last_token=context[-1])

        ids, cut = delta(), 0
        room = self.limit - self.fold.summary_max_tokens - len(context)
        if len(ids) > room:
            ids, cut = self._cut(turn, delta, room)
            if ids is None:
                return Plan(end="context")
        return Plan(ids, summarize=True, info={"cut_tokens": cut} if cut else {})

    def _cut(self, turn: list[Message], render: Callable[[], list[int]], budget: int) -> tuple[list[int] | None, int]:
        """Cut the longest observation message of `turn` (not its assistant message, nor the summary request) until
        `render()` fits `budget`, marking the cut in its text. (ids, tokens cut), or (None, 0) when even an
        empty message does not fit."""
        if len(turn) < 2:  # no observation to cut
            return None, 0
        k = max(range(1, len(turn)), key=lambda i: (turn[i] is not self.request, len(turn[i]["content"])))
        tokens = self.chat.encode(turn[k]["content"])
        keep, ids = len(tokens), render()
        while len(ids) > budget:
            keep -= len(ids) - budget + 16  # the marker's own tokens, and slack for merges at the cut
            if keep < 0:
                return None, 0
            mark = f"\n[... {len(tokens) - keep} tokens cut to fit the context]"
            turn[k] = {**turn[k], "content": self.chat.tokenizer.decode(tokens[:keep]) + mark}
            ids = render()
        return ids, len(tokens) - keep
