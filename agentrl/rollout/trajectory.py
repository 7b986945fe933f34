"""The token-exact record of one episode: what the engine saw, what it sampled, and why.

Words (fixed once): a *turn* is one generation by the policy followed by the environment's
reply; an *episode* runs from reset to its end; its *trajectory* is this record; an
*iteration* is one rollout-then-train cycle; the *policy version* counts weight updates.

Per token (parallel lists, one entry per position of `token_ids`):
  segment      prompt | generated | observation
  turn         the turn index (prompt tokens: the turn that follows them, 0 in the first sequence; observation
               tokens: the turn they answer)
  loss_mask    1 on generated tokens the trainer optimises, else 0
  logprob      lp_b: the engine's logprob for generated tokens (0.0 elsewhere)
  version      the policy version that sampled a generated token (-1 elsewhere)
  kv_version   the oldest policy version among the KV that token was sampled over (-1 elsewhere):
               older than `version` when a weight update landed while its request ran. Staleness
               counts from the older of the two (`token_versions`)

Sequences: an episode's record is one or more token *sequences*, laid end to end in these lists. The first
starts at 0; each later one (`sequences`) starts with a prompt of its own, the conversation so far as the policy
is to see it next (the template's own rendering with earlier thoughts dropped, a folded context, an agent's
rewritten history), and goes on with turns appended as in the first. A generated token belongs to the sequence
it was generated in and is trained there only: a later sequence's prompt repeats earlier turns as context
(segment prompt, loss mask 0). Episodes of one sequence (every episode before sequences existed) have
`sequences == []`.

The invariant (docs/design.md §8, invariant 1): every prompt handed to the engine is the current sequence
(`context_ids`) at that moment (the controller sends the trajectory itself), so the ids the trainer scores are
exactly the ids the engine saw and produced. Nothing is ever decoded and re-encoded to extend a sequence.
"""

from __future__ import annotations

import enum
from typing import Any

from pydantic import BaseModel, Field

from agentrl.engine.base import FinishReason, Generation, SamplingParams
from agentrl.env.base import FailureClass


class Segment(enum.IntEnum):
    PROMPT = 0
    GENERATED = 1
    OBSERVATION = 2


class Status(enum.StrEnum):
    RUNNING = "running"
    """still being generated; parked between iterations with its sandbox kept alive"""
    FINISHED = "finished"
    """ended: terminated by the env, or truncated by the env's turn limit or a token budget"""
    FAILED = "failed"
    """an infrastructure failure: left out of the loss (and counted), never scored as 0"""
    DROPPED = "dropped"
    """past the staleness bound (too many policy versions behind): left out and counted"""
    REWRITTEN = "rewritten"
    """runs saved before trajectories held several sequences: an agent program rewrote its history, and the
    episode was left out (a rewrite now starts a sequence, `SequenceReason.REWRITTEN`)"""


class SequenceReason(enum.StrEnum):
    """Why a sequence after the first started."""

    RERENDER = "rerender"
    """the chat template's own rendering of the conversation is not the record extended (`rollout.thinking:
    strip` drops earlier thoughts)"""
    FOLD = "fold"
    """the context reached `rollout.context.max_tokens` and was folded (truncated or summarised)"""
    REWRITTEN = "rewritten"
    """an agent program sent a history that is not its record extended (it dropped, edited or summarised
    messages)"""


class SequenceStart(BaseModel):
    """Where a sequence after the first begins in the record, and why."""

    start: int
    """the index in `token_ids` of its first token"""
    prompt: int
    """how many tokens its prompt holds (context, never trained)"""
    new: int = 0
    """how many of them are new to the episode (the observation that led to it, as a delta would hold it): the
    rest repeats what the episode already holds"""
    reason: SequenceReason
    info: dict[str, Any] = Field(default_factory=dict)
    """what the fold did (its policy, the turns it dropped or summarised), or the like"""


class TrajectoryError(RuntimeError):
    """The token bookkeeping broke (a prompt that is not the trajectory, a stray append)."""


class Turn(BaseModel):
    """One turn: the span [start, end) of its generated tokens, its reward and its info."""

    index: int
    start: int
    end: int
    reward: float = 0.0
    finish_reason: FinishReason | None = None
    """why its generation ended; "aborted" pieces were continued and do not show here"""
    info: dict[str, Any] = Field(default_factory=dict)
    state_key: str | None = None
    """the environment state the turn acted in (GiGPO's anchor state: turns of a group with the same key form a
    step group), the env's own name for it or a hash of the observation; None where not recorded"""


class Trajectory(BaseModel):
    episode_id: str
    group_id: str
    task_id: str
    sampling: SamplingParams
    token_ids: list[int] = Field(default_factory=list)
    segments: list[Segment] = Field(default_factory=list)
    turn_index: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    versions: list[int] = Field(default_factory=list)
    kv_versions: list[int] = Field(default_factory=list)
    """empty in trajectories saved before it was recorded: read as `versions`"""
    turns: list[Turn] = Field(default_factory=list)
    sequences: list[SequenceStart] = Field(default_factory=list)
    """the sequences after the first, in order (empty: one sequence)"""
    routed_experts: list[list[list[int]] | None] | None = None
    """MoE models, when the engine records routing: aligned with token_ids, entry t holding per layer the experts
    of position t − 1's forward (the one that predicted token t), for prompt, observation and generated tokens
    alike; None where no forward ran (token 0, tokens after the last). A position that several requests ran (every
    turn resends the context) keeps the latest request's record, the routing that conditioned its latest tokens.
    Trajectories saved before prompt routing was recorded hold one entry per generated token instead"""
    status: Status = Status.RUNNING
    terminated: bool = False
    truncated: bool = False
    truncation: str | None = None
    """why it was truncated: "env" (turn limit), "episode_tokens", "context", or an infra error"""
    failure: FailureClass = FailureClass.OK
    error: str | None = None
    outcome_reward: float = 0.0
    """the episode's return: the sum of its turn rewards (the env's outcome term included)"""

    # -- appending ------------------------------------------------------------------

    def _extend(self, ids: list[int], segment: Segment, turn: int) -> None:
        n = len(ids)
        if len(self.kv_versions) == len(self.versions):  # not a trajectory saved before kv_versions existed
            self.kv_versions.extend([-1] * n)
        self.token_ids.extend(ids)
        self.segments.extend([segment] * n)
        self.turn_index.extend([turn] * n)
        self.loss_mask.extend([int(segment is Segment.GENERATED)] * n)
        self.logprobs.extend([0.0] * n)
        self.versions.extend([-1] * n)
        if self.routed_experts is not None and len(self.routed_experts) == len(self.token_ids) - n:
            self.routed_experts.extend([None] * n)

    def append_prompt(self, ids: list[int]) -> None:
        if self.token_ids:
            raise TrajectoryError("the prompt is appended once, first")
        self._extend(ids, Segment.PROMPT, 0)

    def start_sequence(
        self, ids: list[int], reason: SequenceReason, info: dict[str, Any] | None = None, *, new: int = 0
    ) -> None:
        """Begin a new sequence whose prompt is `ids` (the next turn's whole context), after a finished turn; `new`
        of its tokens are new to the episode (`SequenceStart.new`)."""
        if self.turn_open or not self.turns:
            raise TrajectoryError("a sequence starts after a finished turn")
        if not ids:
            raise TrajectoryError("a sequence starts with a prompt")
        start = SequenceStart(start=len(self.token_ids), prompt=len(ids), new=new, reason=reason, info=info or {})
        self.sequences.append(start)
        self._extend(ids, Segment.PROMPT, len(self.turns))

    @property
    def turn_open(self) -> bool:
        """True while the last turn's generation is unfinished (it was aborted and parked)."""
        return bool(self.turns) and self.turns[-1].finish_reason is None

    def append_generation(self, gen: Generation) -> None:
        """Append one generation; an aborted one leaves the turn open for continuation."""
        if not self.turn_open:
            self.turns.append(Turn(index=len(self.turns), start=len(self.token_ids), end=len(self.token_ids)))
        turn = self.turns[-1]
        start = len(self.token_ids)
        if gen.routed_experts is not None and (self.routed_experts is None or len(self.routed_experts) != start):
            self.routed_experts = [None] * start  # a record begins (or an old-format one is replaced)
        self._extend(gen.token_ids, Segment.GENERATED, turn.index)
        self.logprobs[start:] = gen.logprobs
        self.versions[start:] = gen.versions
        if len(self.kv_versions) == len(self.versions):
            self.kv_versions[start:] = gen.kv_versions
        turn.end = len(self.token_ids)
        if gen.routed_experts is not None:
            if gen.prompt_routing is not None:  # the sequence's position p predicted its token p + 1
                c = self.context_start
                self.routed_experts[c + 1 : c + len(gen.prompt_routing) + 1] = gen.prompt_routing
            self.routed_experts[start : start + len(gen.routed_experts)] = gen.routed_experts
        if gen.finish_reason != "aborted":
            turn.finish_reason = gen.finish_reason

    def append_observation(self, ids: list[int]) -> None:
        if self.turn_open or not self.turns:
            raise TrajectoryError("an observation follows a finished turn")
        self._extend(ids, Segment.OBSERVATION, self.turns[-1].index)

    # -- reading --------------------------------------------------------------------

    @property
    def context_start(self) -> int:
        """Where the current (last) sequence begins in `token_ids`."""
        return self.sequences[-1].start if self.sequences else 0

    @property
    def context_length(self) -> int:
        """How many tokens the current sequence holds."""
        return len(self.token_ids) - self.context_start

    @property
    def context_ids(self) -> list[int]:
        """The current sequence: what the engine is sent as the next prompt (a copy)."""
        return self.token_ids[self.context_start :]

    def sequence_spans(self) -> list[tuple[int, int]]:
        """Each sequence's [start, end) in `token_ids`, in order."""
        starts = [0, *(s.start for s in self.sequences)]
        return list(zip(starts, [*starts[1:], len(self.token_ids)], strict=True))

    @property
    def episode_tokens(self) -> int:
        """The episode's length, as one sequence would hold it unfolded: the first prompt, every generated and
        every observation token, each once (a later sequence's prompt counts only what is new in it)."""
        return len(self.token_ids) - sum(s.prompt - s.new for s in self.sequences)

    def generated_ids(self, turn: int) -> list[int]:
        t = self.turns[turn]
        return self.token_ids[t.start : t.end]

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    @property
    def policy_versions(self) -> list[int]:
        """The distinct policy versions that sampled this trajectory's tokens, ascending."""
        return sorted({v for v in self.versions if v >= 0})

    @property
    def token_versions(self) -> list[int]:
        """Per token, the version its staleness counts from: the older of the one that sampled it and the
        oldest in its KV (-1 on tokens not generated)."""
        if len(self.kv_versions) != len(self.versions):  # saved before kv_versions were recorded
            return list(self.versions)
        return [min(v, kv) for v, kv in zip(self.versions, self.kv_versions, strict=True)]

    @property
    def oldest_version(self) -> int | None:
        """The oldest of `token_versions` (None before any token is generated)."""
        return min((v for v in self.token_versions if v >= 0), default=None)

    def staleness(self, current_version: int) -> int:
        """How many versions behind the current policy its oldest token is, KV included (0 if none yet)."""
        oldest = self.oldest_version
        return 0 if oldest is None else current_version - oldest

    @property
    def trainable(self) -> bool:
        return self.status is Status.FINISHED
