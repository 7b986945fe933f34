"""What `agentrl view` reads from a run folder (`agentrl train`) or an evaluation folder (`agentrl eval --out`).

Nothing is loaded whole: JSONL files are followed from the byte where the last read stopped
(so a live run costs only its new lines per refresh), trajectories are listed from
`trajectories/index.jsonl` (one short summary line each, with the byte span of the full
record) and a trajectory is read by seeking to its span. A folder written before the index
existed is indexed once by scanning its trajectory files.

A trajectory holds one or more token sequences (a re-rendered, folded or rewritten context starts a new one): it
is shown sequence by sequence, each later sequence's prompt as context apart from the turns generated after it.
Turns that record the environment state they acted in (`state_key`) are shown with their step group: the turns
with the same key among the saved trajectories of their group (only the saved ones are known here).

A corrupt line (a run killed mid-write, a disk filling up) is skipped and named in
`warnings`; what is readable is shown.
"""

from __future__ import annotations

import bisect
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from tokenizers import Tokenizer

from agentrl.models.default import resolve_path
from agentrl.runs import PROMPT, JsonlTail, RunDir, policy_versions, read_trajectory, summary

MAX_PAGE = 200


class Unreadable(Exception):
    """A trajectory the index lists whose saved line cannot be read: its file missing (deleted, or a copy of the
    folder not there yet) or its bytes not one JSON record (a copy cut short, a disk error)."""


@dataclass
class Filters:
    iteration: int | None = None
    task: str | None = None
    """a substring of the task id"""
    group: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    failure: str | None = None
    """a failure class (ok, agent, infra_error, ...) or a status (failed, dropped)"""
    turns: int | None = None
    partial: bool | None = None
    """spanning several policy versions"""
    multi: bool | None = None
    """holding several token sequences (a re-rendered, folded or rewritten context)"""

    def keep(self, s: dict[str, Any]) -> bool:
        return (
            (self.iteration is None or s["iteration"] == self.iteration)
            and (self.task is None or self.task in s["task_id"])
            and (self.group is None or s["group_id"] == self.group)
            and (self.min_reward is None or s["reward"] >= self.min_reward)
            and (self.max_reward is None or s["reward"] <= self.max_reward)
            and (self.failure is None or self.failure in (s["failure"], s["status"]))
            and (self.turns is None or s["turns"] == self.turns)
            and (self.partial is None or s["partial"] == self.partial)
            and (self.multi is None or (s.get("sequences", 1) > 1) == self.multi)
        )


@dataclass
class Folder:
    """A run or evaluation folder, read lazily and refreshed on every call."""

    path: Path
    run: RunDir = field(init=False)
    _tails: dict[str, JsonlTail] = field(init=False, default_factory=dict)
    _scanned: tuple[list[dict[str, Any]], list[str]] | None = field(init=False, default=None)
    _tokenizer: Tokenizer | None = field(init=False, default=None)
    _state_keys: dict[tuple[str, int, int], list[str | None]] = field(init=False, default_factory=dict)
    """per saved trajectory (its span), its turns' state keys: read once for the step groups"""
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path} is not a folder")
        self.run = RunDir(self.path)
        if not (self.run.metrics.exists() or self.run.config.exists() or (self.path / "results.jsonl").exists()):
            raise FileNotFoundError(
                f"{self.path} is neither a run folder (config.yaml, metrics.jsonl) nor an "
                "evaluation folder (results.jsonl)"
            )

    @property
    def kind(self) -> str:
        return "eval" if (self.path / "results.jsonl").exists() else "run"

    def _tail(self, path: Path) -> JsonlTail:
        with self._lock:
            return self._tails.setdefault(str(path), JsonlTail(path))

    # -- overview ----------------------------------------------------------------------

    def overview(self) -> dict[str, Any]:
        config = self.run.config.read_text() if self.run.config.exists() else None
        summary_path = self.path / "summary.json"
        out = {
            "path": str(self.path),
            "kind": self.kind,
            "config": config,
            "summary": json.loads(summary_path.read_text()) if summary_path.exists() else None,
        }
        if config is not None:
            try:
                out["settings"] = yaml.safe_load(config)
            except yaml.YAMLError as e:
                out["settings"] = None
                out["config_error"] = str(e)
        return out

    def metrics(self) -> dict[str, Any]:
        tails = {
            "metrics": self._tail(self.run.metrics),
            "eval": self._tail(self.run.eval),
            "bench": self._tail(self.run.bench),
        }
        return {k: t.rows() for k, t in tails.items()} | {"warnings": [w for t in tails.values() for w in t.warnings]}

    # -- trajectories ----------------------------------------------------------------------

    def _index(self) -> tuple[list[dict[str, Any]], list[str]]:
        index = self.run.trajectories / "index.jsonl"
        if index.exists():
            tail = self._tail(index)
            rows = tail.rows()
            for r in rows:  # index lines written before trajectories held several sequences
                r.setdefault("sequences", 1)
            return rows, tail.warnings
        with self._lock:
            if self._scanned is None:
                self._scanned = self._scan()
            return self._scanned

    def _scan(self) -> tuple[list[dict[str, Any]], list[str]]:
        """The index of a folder written without one: every trajectory file read once."""
        rows, warnings = [], []
        for path in sorted(self.run.trajectories.glob("*.jsonl")):
            offset = 0
            with open(path, "rb") as f:
                for n, line in enumerate(f, 1):
                    try:
                        rows.append(
                            summary(json.loads(line)) | {"file": path.name, "offset": offset, "length": len(line)}
                        )
                    except (ValueError, KeyError, TypeError):
                        warnings.append(f"{path.name} line {n}: unreadable, skipped")
                    offset += len(line)
        return rows, warnings

    def trajectories(self, filters: Filters, offset: int = 0, limit: int = 50) -> dict[str, Any]:
        """One page of trajectory summaries (newest iteration first), the count matching and the facets."""
        rows, warnings = self._index()
        limit = max(1, min(limit, MAX_PAGE))
        matching = [r for r in rows if filters.keep(r)]
        matching.reverse()  # the index appends: newest last
        page = matching[offset : offset + limit]
        return {
            "total": len(rows),
            "matching": len(matching),
            "offset": offset,
            "limit": limit,
            "items": page,
            "warnings": warnings,
            "verdicts": self._verdicts([r["task_id"] for r in page]),
        }

    def facets(self) -> dict[str, Any]:
        rows, _ = self._index()
        return {
            "iterations": sorted({r["iteration"] for r in rows if r["iteration"] is not None}),
            "failures": sorted({r["failure"] for r in rows} | {r["status"] for r in rows}),
            "turns": sorted({r["turns"] for r in rows}),
        }

    def _find(self, episode_id: str) -> dict[str, Any]:
        rows, _ = self._index()
        for r in reversed(rows):  # a resumed run may have saved an episode twice: the last one counts
            if r["episode_id"] == episode_id:
                return r
        raise KeyError(episode_id)

    def trajectory(self, episode_id: str) -> dict[str, Any]:
        """One trajectory, turn by turn, its tokens as text with their per-token values."""
        entry = self._find(episode_id)
        try:
            row = read_trajectory(self.run.trajectories, entry)
        except FileNotFoundError:
            raise Unreadable(
                f"trajectory {episode_id}: the index lists it in {entry['file']}, which is not there (deleted, or "
                "the folder is still being copied)"
            ) from None
        except (OSError, ValueError) as e:
            raise Unreadable(
                f"trajectory {episode_id}: its line in {entry['file']} (byte {entry['offset']}, "
                f"{entry['length']} bytes) is unreadable: {e}"
            ) from None
        return render(row, self.tokenizer(), self._step_groups(entry, row)) | {"summary": entry}

    def _step_groups(self, entry: dict[str, Any], row: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """For each state key of `row`'s turns, its step group among the saved trajectories of its group (same
        group id and iteration, as `group` shows them): how many turns hold the key, in how many of how many
        trajectories, and which (episode id, turn index). Empty when its turns record no state."""
        keys = {t.get("state_key") for t in row["turns"]} - {None}
        if not keys:
            return {}
        rows, _ = self._index()
        members: dict[str, dict[str, Any]] = {}  # by episode id: a resumed run's second save counts
        for r in rows:
            if r["group_id"] == entry["group_id"] and r["iteration"] == entry["iteration"]:
                members[r["episode_id"]] = r
        members[row["episode_id"]] = entry
        groups = {k: {"size": 0, "trajectories": 0, "saved": len(members), "members": []} for k in keys}
        for episode_id, r in members.items():
            seen = set()
            for turn, key in enumerate(self._turn_keys(r, row if r is entry else None)):
                if key in groups:
                    groups[key]["size"] += 1
                    groups[key]["members"].append([episode_id, turn])
                    seen.add(key)
            for key in seen:
                groups[key]["trajectories"] += 1
        return groups

    def _turn_keys(self, entry: dict[str, Any], row: dict[str, Any] | None) -> list[str | None]:
        span = (entry["file"], entry["offset"], entry["length"])
        keys = self._state_keys.get(span)
        if keys is None:
            try:
                turns = (row or read_trajectory(self.run.trajectories, entry))["turns"]
            except (OSError, ValueError, KeyError):
                return []  # unreadable: its turns are not counted
            keys = self._state_keys[span] = [t.get("state_key") for t in turns]
        return keys

    def group(self, group_id: str, iteration: int | None) -> dict[str, Any]:
        """The group's saved trajectories; an unreadable one is named in `warnings`, the others shown."""
        rows, _ = self._index()
        ids = [r["episode_id"] for r in rows if r["group_id"] == group_id and r["iteration"] == iteration]
        members, warnings = [], []
        for e in dict.fromkeys(ids):
            try:
                members.append(self.trajectory(e))
            except Unreadable as why:
                warnings.append(str(why))
        return {"members": members, "warnings": warnings}

    # -- evaluation folders --------------------------------------------------------------

    def results(self, offset: int = 0, limit: int = 50, passed: bool | None = None) -> dict[str, Any]:
        """An evaluation's per-problem rows (agent runs) or per-completion verdicts (a samples file)."""
        tail = self._tail(self.path / "results.jsonl")
        rows = tail.rows()
        if passed is not None:
            rows = [r for r in rows if _passed(r) == passed]
        limit = max(1, min(limit, MAX_PAGE))
        return {
            "matching": len(rows),
            "offset": offset,
            "limit": limit,
            "items": rows[offset : offset + limit],
            "warnings": tail.warnings,
        }

    def _verdicts(self, task_ids: list[str]) -> dict[str, Any]:
        if self.kind != "eval":
            return {}
        wanted = set(task_ids)
        return {r["task_id"]: r for r in self._tail(self.path / "results.jsonl").rows() if r.get("task_id") in wanted}

    # -- tokens -----------------------------------------------------------------------------

    def tokenizer(self) -> Tokenizer:
        """The folder's own tokenizer (saved by the run), else the run's model's. The `tokenizers` library
        decodes: the viewer needs no transformers (nor torch) for it."""
        if self._tokenizer is None:
            source = self.run.tokenizer / "tokenizer.json"
            if not source.exists():
                model = (self.overview().get("settings") or {}).get("model", {}).get("path")
                if model is None:
                    raise FileNotFoundError(f"{self.path} has no tokenizer/ folder and names no model")
                source = _tokenizer_file(resolve_path(model))
            self._tokenizer = Tokenizer.from_file(str(source))
        return self._tokenizer


def _tokenizer_file(model: str) -> Path:
    """tokenizer.json of a model folder, or of a hub model downloaded before (the viewer downloads nothing)."""
    path = Path(model) / "tokenizer.json"
    if path.exists():
        return path
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(model, "tokenizer.json") if model.count("/") <= 1 else None
    if not isinstance(cached, str):
        raise FileNotFoundError(
            f"no tokenizer.json for {model}: neither a folder holding one nor a hub model in the cache"
        )
    return Path(cached)


def _passed(row: dict[str, Any]) -> bool:
    return bool(row["passed"]) if "passed" in row else row.get("correct", 0) > 0


def render(
    row: dict[str, Any], tokenizer: Tokenizer, step_groups: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A saved trajectory as the page shows it: the prompt's text, then per turn its generated tokens
    (text piece, engine logprob, policy version, advantage, trainer logprob, and with an MoE routing record the
    share of layers the trainer routed otherwise than the engine) and the env's reply; its sequences (one for
    trajectories saved before they held several), each with its span, why it started, its prompt's text (later
    ones: the re-rendered conversation, context only) and its turns; per turn its state key and step group (from
    `step_groups`, by key)."""
    ids, trained = row["token_ids"], row.get("trained")
    routing = trained.get("router_differs") if trained else None  # None in rows saved before it was recorded
    pieces = tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)

    def text(lo: int, hi: int) -> str:
        return tokenizer.decode(ids[lo:hi], skip_special_tokens=False)

    later = row.get("sequences") or []  # absent in rows saved before sequences existed
    starts = [0, *(s["start"] for s in later)]
    ends = [*starts[1:], len(ids)]
    prompt_end = next((k for k, s in enumerate(row["segments"][: ends[0]]) if s != PROMPT), ends[0])
    ratios = (trained or {}).get("sequence_ratios") or []
    sequences = [
        {
            "index": k,
            "start": lo,
            "end": hi,
            "tokens": hi - lo,
            "generated": sum(row["loss_mask"][lo:hi]),
            "prompt": prompt_end if k == 0 else later[k - 1]["prompt"],
            "reason": None if k == 0 else later[k - 1]["reason"],
            "info": {} if k == 0 else later[k - 1].get("info") or {},
            "ratio": ratios[k] if len(ratios) == len(starts) else None,
            "context": None if k == 0 else text(lo, lo + later[k - 1]["prompt"]),
            "turns": [],
        }
        for k, (lo, hi) in enumerate(zip(starts, ends, strict=True))
    ]
    turns = []
    for k, turn in enumerate(row["turns"]):
        seq = sequences[bisect.bisect_right(starts, turn["start"]) - 1]
        seq["turns"].append(k)
        next_start = row["turns"][k + 1]["start"] if k + 1 < len(row["turns"]) else len(ids)
        obs_end = min(next_start, seq["end"])  # a reply never runs on into the next sequence's prompt
        span = range(turn["start"], turn["end"])
        key = turn.get("state_key")
        turns.append(
            {
                "index": turn["index"],
                "sequence": seq["index"],
                "reward": turn["reward"],
                "finish_reason": turn["finish_reason"],
                "info": turn["info"],
                "state_key": key,
                "step_group": (step_groups or {}).get(key) if key is not None else None,
                "tokens": [pieces[j] for j in span],
                "logprob": [row["logprobs"][j] for j in span],
                "version": [row["versions"][j] for j in span],
                "advantage": [trained["advantages"][j] for j in span] if trained else None,
                "trainer_logprob": [trained["trainer_logprobs"][j] for j in span] if trained else None,
                "router_differs": [routing[j] for j in span] if routing else None,
                "observation": text(turn["end"], obs_end),
            }
        )
    for seq in sequences:  # what follows a later sequence's prompt before its first turn (an env reply), if any
        first = row["turns"][seq["turns"][0]]["start"] if seq["turns"] else seq["end"]
        seq["lead"] = text(seq["start"] + seq["prompt"], first) if seq["index"] else ""
    return {
        "episode_id": row["episode_id"],
        "group_id": row["group_id"],
        "task_id": row["task_id"],
        "iteration": row.get("iteration"),
        "status": row["status"],
        "failure": row["failure"],
        "error": row["error"],
        "truncation": row["truncation"],
        "reward": row["outcome_reward"],
        "sampling": row["sampling"],
        "versions": policy_versions(row),
        "prompt": text(0, prompt_end),
        "sequences": sequences,
        "turns": turns,
        "trained": {k: trained[k] for k in ("ratio", "clipped", "minibatch")} if trained else None,
    }
