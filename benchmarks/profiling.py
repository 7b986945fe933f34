"""One run under torch.profiler, summarised the same way by every benchmark that profiles (train_step_bench.py
--profile, decode_profile.py): its wall seconds; on a GPU the kernels' busy time and its share of the wall (a GPU
busy for a small share of the wall waits on the host); and the `top` entries by time, kernels on a GPU (memcpy and
memset included), ops by self time on the CPU.

    with profiled(cuda, top=12) as summary:
        step()
    summary  # {"wall_s": ..., "gpu_busy_s": ..., "gpu_busy_share": ..., "top": [{"name", "calls", "ms", "share"}]}
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


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
