"""Where a run's numbers go: JSONL in the run folder always, TensorBoard and W&B when asked.

Run folder (`RunDir`):
  config.yaml           the resolved config
  metrics.jsonl         one line per iteration (training), keys grouped as rollout/, batch/, train/, time/
  eval.jsonl            one line per held-out evaluation (greedy), apart from the training reward
  trajectories/         iter-NNNNN.jsonl: sampled whole groups per iteration, for `agentrl view`
  checkpoints/          iter-NNNNN/: resumable (torch.distributed.checkpoint)
  tensorboard/          event files (log.tensorboard)
  final/                the final policy as a Hugging Face folder
  plots/                `agentrl report` PNGs and summary
A line is written whole and flushed at once, so a killed run leaves at most one torn last line.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import yaml

from agentrl.rollout import Group
from agentrl.train.run_config import LogConfig

log = logging.getLogger(__name__)


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.metrics = self.path / "metrics.jsonl"
        self.eval = self.path / "eval.jsonl"
        self.trajectories = self.path / "trajectories"
        self.checkpoints = self.path / "checkpoints"
        self.final = self.path / "final"
        self.plots = self.path / "plots"
        self.config = self.path / "config.yaml"

    def create(self, config: dict[str, Any]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self.config.write_text(yaml.safe_dump(config, sort_keys=False))

    def checkpoint(self, iteration: int) -> Path:
        return self.checkpoints / f"iter-{iteration:05d}"

    def latest_checkpoint(self) -> Path | None:
        """The newest finished checkpoint (one with state.json: a save cut short has none)."""
        done = sorted(p for p in self.checkpoints.glob("iter-*") if (p / "state.json").exists())
        return done[-1] if done else None

    def truncate_logs(self, iteration: int) -> None:
        """Resuming at `iteration`: drop lines of later iterations (logged after the checkpoint) and torn lines."""
        for path in (self.metrics, self.eval):
            if path.exists():
                rows = read_jsonl(path)
                path.write_text("".join(json.dumps(r) + "\n" for r in rows if r.get("iteration", 0) < iteration))


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every readable line; a torn or corrupt line (a killed run) is skipped with a warning."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("%s:%d: unreadable line skipped (a run killed mid-write?)", path, n)
    return rows


class Tracker:
    """Appends metrics to the run folder, and mirrors them to TensorBoard / W&B."""

    def __init__(self, run: RunDir, cfg: LogConfig, config: dict[str, Any]) -> None:
        self.run = run
        self.trajectories_per_iteration = cfg.trajectories_per_iteration
        self.max_trajectory_bytes = cfg.max_trajectory_mb * 2**20
        self.tb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run.path / "tensorboard"))
        self.wandb = None
        if cfg.wandb == "on" or (cfg.wandb == "auto" and _wandb_configured()):
            import wandb

            self.wandb = wandb.init(project=cfg.wandb_project, dir=str(run.path), name=run.path.name, config=config,
                                    resume="allow", id=run.path.name)  # fmt: skip

    def log(self, metrics: dict[str, Any]) -> None:
        self._append(self.run.metrics, metrics)
        self._mirror(metrics, "")

    def log_eval(self, metrics: dict[str, Any]) -> None:
        self._append(self.run.eval, metrics)
        self._mirror(metrics, "eval/")

    def save_trajectories(self, iteration: int, groups: list[Group]) -> int:
        """Whole groups (the G samples side by side) up to the per-iteration count; returns how many were saved."""
        if not self.trajectories_per_iteration:
            return 0
        self.run.trajectories.mkdir(exist_ok=True)
        used = sum(p.stat().st_size for p in self.run.trajectories.glob("*.jsonl"))
        if used >= self.max_trajectory_bytes:
            return 0
        lines, n = [], 0
        for g in groups:
            if n >= self.trajectories_per_iteration:
                break
            for t in g.trajectories:
                lines.append(json.dumps({"iteration": iteration, **t.model_dump(mode="json")}) + "\n")
            n += len(g.trajectories)
        with open(self.run.trajectories / f"iter-{iteration:05d}.jsonl", "w") as f:
            f.writelines(lines)
        return n

    def _append(self, path: Path, row: dict[str, Any]) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()

    def _mirror(self, metrics: dict[str, Any], prefix: str) -> None:
        step = metrics.get("iteration", 0)
        scalars = {prefix + k: v for k, v in metrics.items() if isinstance(v, int | float) and k != "iteration"}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_configured() -> bool:
    try:
        import wandb  # noqa: F401
    except ImportError:
        return False
    return bool(os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE"))
