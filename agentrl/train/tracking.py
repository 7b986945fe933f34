"""Where a run's numbers go: JSONL in the run folder always, TensorBoard and W&B when asked.

Run folder (`RunDir`):
  config.yaml           the resolved config
  metrics.jsonl         one line per iteration (training), keys grouped as rollout/, batch/, train/, time/
  eval.jsonl            one line per held-out evaluation (greedy), apart from the training reward
  bench.jsonl           one line per `eval.benchmarks` evaluation (pass@k on a benchmark's fixed subset)
  trajectories/         iter-NNNNN.jsonl: sampled whole groups per iteration, each trajectory with what its
                        update saw ("trained": advantages, lp_θ, s_i, clip state); index.jsonl: one short
                        line per saved trajectory (its summary, file and byte span), for `agentrl view`
  tokenizer/            the run's tokenizer, to read token ids back as text
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
from pydantic import BaseModel

from agentrl.rollout import Group, Trajectory
from agentrl.train.batch import TrainBatch
from agentrl.train.run_config import LogConfig
from agentrl.train.trainer import RowStats

log = logging.getLogger(__name__)


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
        self.config.write_text(yaml.safe_dump(config, sort_keys=False))

    def checkpoint(self, iteration: int) -> Path:
        return self.checkpoints / f"iter-{iteration:05d}"

    def latest_checkpoint(self) -> Path | None:
        """The newest finished checkpoint (one with state.json: a save cut short has none)."""
        done = sorted(p for p in self.checkpoints.glob("iter-*") if (p / "state.json").exists())
        return done[-1] if done else None

    def truncate_logs(self, iteration: int) -> None:
        """Resuming at `iteration`: drop lines of later iterations (logged after the checkpoint) and torn lines
        (the index too: those iterations' trajectory files will be written anew)."""
        for path in (self.metrics, self.eval, self.bench, self.trajectories / "index.jsonl"):
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


class TrainedView(BaseModel):
    """What the update saw of one trajectory, per token aligned with its `token_ids` (rounded: a record)."""

    advantages: list[float]
    trainer_logprobs: list[float]
    """lp_θ when its minibatch was trained (`RowStats.logprobs`)"""
    ratio: float
    clipped: float
    minibatch: int

    @classmethod
    def of(cls, batch: TrainBatch, rows: dict[int, RowStats]) -> dict[str, TrainedView]:
        """By episode id, for every row of `batch` that `Trainer.update` recorded (`Record.stats`)."""
        views = {}
        for i, r in rows.items():
            n = len(r.logprobs)
            views[batch.episode_ids[i]] = cls(
                advantages=[round(a, 4) for a in batch.advantages[i, :n].tolist()],
                trainer_logprobs=[round(x, 4) for x in r.logprobs], ratio=r.ratio, clipped=r.clipped,
                minibatch=r.minibatch,
            )  # fmt: skip
        return views


def summary(t: Trajectory, iteration: int | None, view: TrainedView | None) -> dict[str, Any]:
    """A trajectory's one-line summary: what the viewer filters and lists by."""
    versions = t.policy_versions
    return {
        "iteration": iteration, "episode_id": t.episode_id, "group_id": t.group_id, "task_id": t.task_id,
        "reward": t.outcome_reward, "status": t.status.value, "failure": t.failure.value, "turns": len(t.turns),
        "versions": versions, "partial": len(versions) > 1, "tokens": len(t.token_ids),
        "truncated": t.truncation if t.truncated else None, "error": t.error,
        "ratio": view.ratio if view else None, "clipped": view.clipped if view else None,
    }  # fmt: skip


def write_trajectories(folder: Path, name: str, trajectories: list[Trajectory], iteration: int | None,
                       trained: dict[str, TrainedView]) -> int:  # fmt: skip
    """`folder/name`: one JSON line per trajectory (with its `trained` view, if any); then one line each
    in `folder/index.jsonl`: its summary and byte span, so a reader lists and filters without parsing
    the trajectories and loads one by seeking. Returns how many were written."""
    folder.mkdir(parents=True, exist_ok=True)
    lines, index, offset = [], [], 0
    for t in trajectories:
        view = trained.get(t.episode_id)
        row = {"iteration": iteration, **t.model_dump(mode="json"), "trained": view and view.model_dump()}
        line = (json.dumps(row) + "\n").encode()
        span = {"file": name, "offset": offset, "length": len(line)}
        index.append(json.dumps(summary(t, iteration, view) | span) + "\n")
        lines.append(line)
        offset += len(line)
    (folder / name).write_bytes(b"".join(lines))
    with open(folder / "index.jsonl", "a") as f:  # after the data it points into
        f.writelines(index)
    return len(index)


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

    def log_bench(self, metrics: dict[str, Any]) -> None:
        self._append(self.run.bench, metrics)
        self._mirror(metrics, f"bench/{metrics['env']}/")

    def to_save(self, groups: list[Group]) -> list[Trajectory]:
        """The trajectories an iteration saves: whole groups (the G samples side by side) up to the
        per-iteration count; none once the saved files reach `log.max_trajectory_mb`."""
        if not self.trajectories_per_iteration:
            return []
        used = sum(p.stat().st_size for p in self.run.trajectories.glob("*.jsonl"))
        if used >= self.max_trajectory_bytes:
            return []
        saved: list[Trajectory] = []
        for g in groups:
            if len(saved) >= self.trajectories_per_iteration:
                break
            saved += g.trajectories
        return saved

    def save_trajectories(self, iteration: int, saved: list[Trajectory], trained: dict[str, TrainedView]) -> int:
        """`saved` (from `to_save`) with `trained` (by episode id) where the update used them; returns how many."""
        if not saved:
            return 0
        return write_trajectories(self.run.trajectories, f"iter-{iteration:05d}.jsonl", saved, iteration, trained)

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
