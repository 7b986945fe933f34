"""Where a run's numbers go: JSONL in the run folder always (its layout: `agentrl.runs`), TensorBoard and
W&B when asked.
"""

from __future__ import annotations

import os
from typing import Any

from agentrl.rollout import Group, Trajectory
from agentrl.runs import RunDir, TrainedView, append_jsonl, write_trajectories
from agentrl.train.run_config import LogConfig


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

            self.wandb = wandb.init(
                project=cfg.wandb_project,
                dir=str(run.path),
                name=run.path.name,
                config=config,
                resume="allow",
                id=run.path.name,
            )

    def resume(self, iteration: int) -> None:
        """A resume at `iteration`: TensorBoard drops what the run cut short had logged from there on (past its
        checkpoint; `RunDir.truncate_logs` drops it from the JSONL), so what the resume logs anew is not a second
        curve over the first."""
        if self.tb is not None:
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog

            # TensorBoard purges the steps from a START event's on, but takes a run's first START for its own start:
            # a run that did not resume wrote none (nor does SummaryWriter(purge_step=...) write more than one)
            start = Event(step=iteration, session_log=SessionLog(status=SessionLog.START))
            for _ in range(2):
                self.tb.file_writer.add_event(start)

    def log(self, metrics: dict[str, Any]) -> None:
        append_jsonl(self.run.metrics, metrics)
        self._mirror(metrics, "")

    def log_eval(self, metrics: dict[str, Any]) -> None:
        append_jsonl(self.run.eval, metrics)
        self._mirror(metrics, "eval/")

    def log_bench(self, metrics: dict[str, Any]) -> None:
        append_jsonl(self.run.bench, metrics)
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
        name = self.run.trajectory_file(iteration).name
        return write_trajectories(self.run.trajectories, name, saved, iteration, trained)

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
