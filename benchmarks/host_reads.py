"""How often one `Trainer.update` reads a value back from the device, inside the scorer's forwards and outside them.

On a GPU each read (`.item()`, `float(t)`, `if t:`, `nonzero`, boolean-mask indexing, `unique`) waits for every
kernel queued before it, so the host cannot run ahead. On the CPU the reads are counted as the aten ops that make
them (a `TorchDispatchMode`), from the update's first forward on (the split before it reads what it needs once);
a read inside a forward of the scorer counts apart (since the scorer plans from host copies of the ids and masks,
its own reads there are the host's, which the CPU cannot tell apart). The tiny Qwen3-MoE, a synthetic batch of 8
x 64 tokens, M = 1 and M = 4 minibatches. Another checkout's trainer: `PYTHONPATH=<checkout>`.

    python benchmarks/host_reads.py      # prints one JSON object
"""

from __future__ import annotations

import json

import harness
from profiling import HostReads


def reads(minibatches: int) -> dict[str, int]:
    from agentrl.train.config import OptimConfig, TrainerConfig
    from agentrl.train.trainer import Trainer

    cfg = harness.model_config("tiny")
    trainer = Trainer(TrainerConfig(optim=OptimConfig(lr=1e-3, minibatches=minibatches)), harness.random_model("tiny"))
    batch = harness.synthetic_batch(8, 64, cfg.vocab_size, "cpu")
    trainer.update(batch)  # whatever is set up once
    count, forwards = HostReads(), []

    def enter(module, args, kwargs) -> None:
        if not forwards:  # from the first forward on: the split before it reads once, on purpose
            count.reads.clear()
        count.depth += 1
        forwards.append(1)

    def leave(module, args, kwargs, out) -> None:
        count.depth -= 1

    trainer.scorer.register_forward_pre_hook(enter, with_kwargs=True)
    trainer.scorer.register_forward_hook(leave, with_kwargs=True)
    with count:
        trainer.update(batch)
    return {"forwards": len(forwards), "reads_in_scorer": len(count.scoped), "reads_outside_scorer": len(count.reads)}


def main() -> None:
    print(json.dumps({"machine": harness.machine("torch"), **{f"M={m}": reads(m) for m in (1, 4)}}, indent=2))


if __name__ == "__main__":
    main()
