"""`RunDir`: the paths of a run folder (the layout is in `agentrl.runs`), and the edits a resume makes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from agentrl.runs.jsonl import read_jsonl


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.metrics = self.path / "metrics.jsonl"
        self.eval = self.path / "eval.jsonl"
        self.bench = self.path / "bench.jsonl"
        self.trajectories = self.path / "trajectories"
        self.checkpoints = self.path / "checkpoints"
        self.final = self.path / "final"
        self.plots = self.path / "plots"
        self.config = self.path / "config.yaml"
        self.tokenizer = self.path / "tokenizer"

    def create(self, config: dict[str, Any]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        write_whole(self.config, yaml.safe_dump(config, sort_keys=False))

    def checkpoint(self, iteration: int) -> Path:
        return self.checkpoints / f"iter-{iteration:05d}"

    def trajectory_file(self, iteration: int) -> Path:
        """The trajectories saved at `iteration`."""
        return self.trajectories / f"iter-{iteration:05d}.jsonl"

    def latest_checkpoint(self) -> Path | None:
        """The newest finished checkpoint (one with state.json: a save cut short has none)."""
        done = sorted(p for p in self.checkpoints.glob("iter-*") if (p / "state.json").exists())
        return done[-1] if done else None

    def truncate_logs(self, iteration: int) -> None:
        """Resuming at `iteration`: drop lines of later iterations (logged after the checkpoint) and torn lines,
        and those iterations' trajectory files, as if the run had never got past the checkpoint. Left, a file the
        resume does not write again (stopped sooner, or past `log.max_trajectory_mb`, which counts it) would stay
        on disk, out of the index."""
        for path in (self.metrics, self.eval, self.bench, self.trajectories / "index.jsonl"):
            if path.exists():
                rows = read_jsonl(path)
                write_whole(path, "".join(json.dumps(r) + "\n" for r in rows if r.get("iteration", 0) < iteration))
        # after the index: a line of it never points into a removed file
        for path in self.trajectories.glob("iter-*.jsonl"):
            n = path.stem.removeprefix("iter-")
            if n.isdigit() and int(n) >= iteration:
                path.unlink()


def write_whole(path: Path, text: str) -> None:
    """`path` holds `text` or, if this is cut short (killed, disk full), what it held: never a part of either."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
