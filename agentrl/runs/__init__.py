"""The run folder: what `agentrl train` and `agentrl eval --out` write, and `agentrl view` and
`agentrl report` read.

It sits at the bottom of the layers (files and JSON only: no torch, transformers or ray), so a
reader stays light and every layer above writes the one format:

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

An evaluation folder (`agentrl eval --out`) holds results.jsonl, summary.json, trajectories/ and tokenizer/.
A line is written whole and flushed at once, so a killed run leaves at most one torn last line.
"""

from agentrl.runs.folder import RunDir, write_whole
from agentrl.runs.jsonl import JsonlTail, append_jsonl, read_jsonl
from agentrl.runs.trajectories import (
    PROMPT,
    TrainedView,
    policy_versions,
    read_trajectory,
    summary,
    write_trajectories,
)

__all__ = [
    "PROMPT",
    "JsonlTail",
    "RunDir",
    "TrainedView",
    "append_jsonl",
    "policy_versions",
    "read_jsonl",
    "read_trajectory",
    "summary",
    "write_trajectories",
    "write_whole",
]
