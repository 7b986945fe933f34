"""One run under torch.profiler, summarised the same way by every benchmark that profiles (train_step_bench.py
--profile, decode_bench.py on a GPU): its wall seconds; on a GPU the kernels' busy time and its share of the wall (a GPU
busy for a small share of the wall waits on the host); and the `top` entries by time, kernels on a GPU (memcpy and
memset included), ops by self time on the CPU.

    with profiled(cuda, top=12) as summary:
        step()
    summary  # {"wall_s": ..., "gpu_busy_s": ..., "gpu_busy_share": ..., "top": [{"name", "calls", "ms", "share"}]}

`HostReads` counts the ops that read a value back from the device (host_reads.py, tests/train/test_host_reads.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode


@contextmanager
def profiled(cuda: bool, top: int) -> Iterator[dict]:
    """Profile the block; the dict it yields holds the summary once the block ends (see the module docstring).
    CPU ops are recorded from the calling thread only; CUDA kernels from every thread."""
    summary: dict = {}
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        yield summary
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    if cuda:
        rows = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
        us = lambda e: e.self_device_time_total  # noqa: E731
    else:
        rows, us = list(prof.key_averages()), (lambda e: e.self_cpu_time_total)
    total = sum(us(e) for e in rows) or 1.0
    summary |= {
        "wall_s": wall,
        **({"gpu_busy_s": total / 1e6, "gpu_busy_share": total / 1e6 / wall} if cuda else {}),
        "top": [
            {"name": e.key[:120], "calls": e.count, "ms": us(e) / 1e3, "share": us(e) / total}
            for e in sorted(rows, key=us, reverse=True)[:top]
        ],
    }


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
"""the ops whose result's size or value the host must wait for"""
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
"""indexing ops, which read back when an index is boolean"""


class HostReads(TorchDispatchMode):
    """While active, records each op that reads a value back to the host (on a GPU, each waits for every kernel
    queued before it): in `reads`, or in `scoped` while `depth` > 0 (a caller's hooks mark a region apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.scoped: list[str] = []
        self.depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        boolean = packet in INDEXING and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if packet in READS or boolean:
            (self.scoped if self.depth else self.reads).append(str(func))
        return func(*args, **(kwargs or {}))
