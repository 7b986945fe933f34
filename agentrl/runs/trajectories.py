"""Saved trajectories: one JSON line each in `trajectories/<name>.jsonl`, indexed by `trajectories/index.jsonl`.

A line is a rollout `Trajectory` as JSON (its per-token lists: token_ids, segments, turn_index,
loss_mask, logprobs, versions; its turns, sequences, status, failure, rewards) with two more keys:
"iteration" (None in an evaluation) and "trained" (a `TrainedView`, or None when no update saw it).
The index holds one short line per saved trajectory, its `summary` plus the byte span of its line,
so a reader lists and filters without parsing the trajectories and loads one by seeking.
This module reads and writes that JSON; it needs none of the classes that made it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel

from agentrl.runs.jsonl import append_lines

PROMPT = 0
"""the segment code of prompt tokens in a saved trajectory (then 1: generated, 2: observation)"""


class TrainedView(BaseModel):
    """What the update saw of one trajectory, per token aligned with its `token_ids` (rounded: a record)."""

    advantages: list[float]
    trainer_logprobs: list[float]
    """lp_θ when its minibatch was trained"""
    ratio: float
    """s_i, the sequence ratio against lp_b at that moment (several sequences: their mean)"""
    clipped: float
    """the share of its generated tokens whose clipped branch was taken (GSPO: 0 or 1; several sequences: the
    mean of theirs)"""
    minibatch: int
    """the minibatch that trained it (several sequences: the first's)"""
    sequence_ratios: list[float] | None = None
    """s_i of each of its sequences, in order, when it holds more than one"""
    router_differs: list[float] | None = None
    """MoE with the engine's routing record: per token, the share of MoE layers the learner routed otherwise than
    the engine (generated tokens; -1 elsewhere); None: not recorded (no record, or saved before it existed)"""


class Saveable(Protocol):
    """A trajectory as the rollout makes it: a pydantic model with an episode id."""

    episode_id: str

    def model_dump(self, *, mode: str) -> dict[str, Any]: ...


def policy_versions(row: Mapping[str, Any]) -> list[int]:
    """The distinct policy versions that sampled a saved trajectory's tokens, ascending."""
    return sorted({v for v in row["versions"] if v >= 0})


def summary(row: Mapping[str, Any]) -> dict[str, Any]:
    """A saved trajectory's index line (without its span): what the viewer filters and lists by."""
    versions = policy_versions(row)
    trained = row.get("trained")
    return {
        "iteration": row.get("iteration"),
        "episode_id": row["episode_id"],
        "group_id": row["group_id"],
        "task_id": row["task_id"],
        "reward": row["outcome_reward"],
        "status": row["status"],
        "failure": row["failure"],
        "turns": len(row["turns"]),
        "versions": versions,
        "partial": len(versions) > 1,
        "tokens": len(row["token_ids"]),
        "sequences": 1 + len(row.get("sequences") or []),
        "truncated": row["truncation"] if row["truncated"] else None,
        "error": row["error"],
        "ratio": trained["ratio"] if trained else None,
        "clipped": trained["clipped"] if trained else None,
    }


def write_trajectories(
    folder: Path, name: str, trajectories: Sequence[Saveable], iteration: int | None, trained: Mapping[str, TrainedView]
) -> int:
    """`folder/name`: one JSON line per trajectory (with its `trained` view, by episode id, if any); then
    one line each in `folder/index.jsonl`, after the data it points into. Returns how many were written."""
    folder.mkdir(parents=True, exist_ok=True)
    lines, index, offset = [], [], 0
    for t in trajectories:
        view = trained.get(t.episode_id)
        row = {"iteration": iteration, **t.model_dump(mode="json"), "trained": view and view.model_dump()}
        line = (json.dumps(row) + "\n").encode()
        index.append(json.dumps(summary(row) | {"file": name, "offset": offset, "length": len(line)}))
        lines.append(line)
        offset += len(line)
    (folder / name).write_bytes(b"".join(lines))
    append_lines(folder / "index.jsonl", index)
    return len(index)


def read_trajectory(folder: Path, entry: Mapping[str, Any]) -> dict[str, Any]:
    """The saved trajectory an index line points at, read by seeking to its span."""
    with open(folder / entry["file"], "rb") as f:
        f.seek(entry["offset"])
        return json.loads(f.read(entry["length"]))
