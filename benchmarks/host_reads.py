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
import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
READS = {
    aten._local_scalar_dense,  # .item(), float(t), int(t), bool(t)
    aten.is_nonzero,
    aten.equal,
    aten.nonzero,
    aten.masked_select,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
}
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


class Reads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.inside = self.outside = self.depth = 0
        self.started = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        boolean = packet in INDEXING and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if self.started and (packet in READS or boolean):
            if self.depth:
                self.inside += 1
            else:
                self.outside += 1
        return func(*args, **(kwargs or {}))


def reads(minibatches: int) -> dict[str, int]:
    from agentrl.train.config import OptimConfig, TrainerConfig
    from agentrl.train.trainer import Trainer

    cfg = harness.model_config("tiny")
    trainer = Trainer(TrainerConfig(optim=OptimConfig(lr=1e-3, minibatches=minibatches)), harness.random_model("tiny"))
    batch = harness.synthetic_batch(8, 64, cfg.vocab_size, "cpu")
    trainer.update(batch)  # whatever is set up once
    count, forwards = Reads(), []

    def enter(module, args, kwargs) -> None:
        count.started = True
        count.depth += 1
        forwards.append(1)

    def leave(module, args, kwargs, out) -> None:
        count.depth -= 1

    trainer.scorer.register_forward_pre_hook(enter, with_kwargs=True)
    trainer.scorer.register_forward_hook(leave, with_kwargs=True)
    with count:
        trainer.update(batch)
    return {"forwards": len(forwards), "reads_in_scorer": count.inside, "reads_outside_scorer": count.outside}


def main() -> None:
    print(json.dumps({"machine": harness.machine("torch"), **{f"M={m}": reads(m) for m in (1, 4)}}, indent=2))


if __name__ == "__main__":
    main()
