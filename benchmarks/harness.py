"""What the benchmarks share. A benchmark script imports this module (`import harness`: Python puts a script's
folder on sys.path), never another benchmark.

- Running agentrl: `agentrl(...)` runs the command to its end, its output in a log file; `train(...)` is one
  `agentrl train` with `--set` overrides; `child_env()` is the environment of what a benchmark starts.
- A training run's held-out figures: `held_out(...)` and `run_summary(...)`.
- The machine a figure was measured on: `machine(...)`, the "machine" of a benchmark's JSON.
- Memory, one function per quantity (their docstrings say which to use when): `proc_kib` (the kernel's figures
  of a process), `tree_rss_mib` (a process tree's resident memory now), `gpu_peak_gib` (torch's CUDA allocator's
  peak), `PeakSampler` (the peak of a quantity nothing keeps a peak of).
- The models and inputs of the model benchmarks: `SIZES`, `model_config`, `random_model`, `model_folder`,
  `describe_model`, `active_params`, `synthetic_batch`, `prompts`, `generate_all`.

Only the standard library is imported at the top: gpu_check.py's driver imports this module and needs neither torch
nor agentrl (its checks import them, each in a process of its own). torch, transformers and agentrl are imported
where used.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# -- running agentrl ------------------------------------------------------------------------------------


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a process a benchmark starts: this checkout importable (installed or not), Ray without
    auth (the local cluster a run starts, as the tests run it), then `extra`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("RAY_AUTH_MODE", "disabled")
    return env | extra


def sets(settings: Iterable[str]) -> list[str]:
    """Run settings as `agentrl` options: `--set S` for each."""
    return [a for s in settings for a in ("--set", s)]


def agentrl(
    *args: object,
    log: Path,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> float:
    """`python -m agentrl ARGS` run to its end (environment: `env`, else child_env()), its stdout and stderr
    written to `log`: its wall seconds. Raises subprocess.CalledProcessError if it fails, and
    subprocess.TimeoutExpired past `timeout`."""
    t0 = time.monotonic()
    with open(log, "w") as f:
        subprocess.run(
            [sys.executable, "-m", "agentrl", *map(str, args)],
            stdout=f,
            stderr=subprocess.STDOUT,
            check=True,
            cwd=cwd,
            env=env or child_env(),
            timeout=timeout,
        )
    return time.monotonic() - t0


def train(out: Path, settings: Iterable[str], recipe: Sequence[str] = ("--env", "code_sandbox")) -> float:
    """One `agentrl train RECIPE` (by default the default run) into the run folder `out`, with `settings` (each a
    `--set`), its output in OUT.log: its wall seconds (the sandbox image is built beforehand, not timed)."""
    return agentrl("train", *recipe, *sets([f"out={out}", *settings]), log=Path(f"{out}.log"))


# -- a run's held-out figures ---------------------------------------------------------------------------


def held_out(evals: list[dict]) -> dict:
    """Held-out success from a run's eval.jsonl rows (greedy, the env's test split; the first row is the starting
    checkpoint's, before iteration 0): start, final, the gain in points and the curve by iteration."""
    start, final = evals[0]["success_rate"], evals[-1]["success_rate"]
    return {
        "start": start,
        "final": final,
        "gain_pp": round(100 * (final - start), 1),
        "curve": {e["iteration"]: e["success_rate"] for e in evals},
    }


def run_summary(evals: list[dict], metrics: list[dict], wall_s: float | None) -> dict:
    """A training run from its eval.jsonl and metrics.jsonl rows: iterations, held-out tasks, `held_out`'s figures
    and the wall seconds, as timed, or (`wall_s` None: a run made earlier) the last iteration's elapsed time,
    which leaves out the final evaluation."""
    return {
        "iterations": len(metrics),
        "tasks": evals[-1]["tasks"],
        **held_out(evals),
        "wall_s": round(wall_s if wall_s is not None else metrics[-1]["time/elapsed_s"]),
    }


# -- the machine ----------------------------------------------------------------------------------------


def output(cmd: list[str], timeout: float = 20) -> str | None:
    """A command's stdout, stripped; None if it is not there, fails or hangs."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def machine(*packages: str) -> dict[str, Any]:
    """The machine a benchmark ran on: platform, cores, Python, the version of each of `packages` ("torch" adds
    its CUDA build, whether CUDA is available and the GPUs' names), nvidia-smi's GPUs where it runs, and the
    checkout's commit."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    for name in packages:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            info[name] = f"not importable: {e}"
            continue
        info[name] = module.__version__
        if name == "torch":
            cuda = module.cuda.is_available()
            info |= {"torch_cuda": module.version.cuda, "cuda_available": cuda}
            if cuda:
                info["gpus"] = [module.cuda.get_device_name(i) for i in range(module.cuda.device_count())]
    smi = output(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    if smi is not None:
        info["nvidia_smi"] = smi.splitlines()
    if commit := output(["git", "rev-parse", "HEAD"]):
        info["commit"] = commit
    return info


# -- memory ---------------------------------------------------------------------------------------------


def proc_kib(field: str, pid: int | str = "self") -> int:
    """A figure of /proc/PID/status, KiB, kept by the kernel: VmRSS (resident now), VmHWM (VmRSS's peak, exact,
    no sampling: getrusage's ru_maxrss), RssAnon (the anonymous part of VmRSS, what the process owns: it leaves
    out the file pages it maps, such as safetensors read through mmap)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def tree_rss_mib(pid: int) -> float:
    """Resident memory now (VmRSS) of a process and its descendants, MiB: a server measured from outside."""
    pids = [pid]
    for p in pids:  # grows as children are found, each listed under the thread that started it
        for children in Path(f"/proc/{p}/task").glob("*/children"):
            pids += map(int, children.read_text().split())
    return round(sum(proc_kib("VmRSS", p) for p in pids) / 1024, 1)


def gpu_peak_gib() -> float | None:
    """The most memory torch's CUDA allocator held for tensors in this process since it started (or since
    torch.cuda.reset_peak_memory_stats()), GiB; None without CUDA. Exact, but blind to other processes."""
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def gpu_used_mib() -> float | None:
    """The memory in use on the fullest GPU, every process's (nvidia-smi), MiB; None without nvidia-smi."""
    smi = output(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], timeout=10)
    try:
        return max(float(x) for x in smi.split()) if smi else None
    except ValueError:
        return None


class PeakSampler:
    """The peak of `read()` sampled every `every` seconds in a thread of its own while the block runs: for a
    quantity that nothing keeps a peak of (a process's RssAnon; a GPU's memory used by processes torch's
    allocator does not see). A `read()` of None means no figure here (no nvidia-smi): sampling stops there."""

    def __init__(self, read: Callable[[], float | None], every: float) -> None:
        self.read, self.every = read, every
        self.peak = read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def sample(self) -> float | None:
        """Sample now (a phase just ended): the peak so far."""
        value = self.read()
        if value is None:
            self._stop.set()
        else:
            self.peak = value if self.peak is None else max(self.peak, value)
        return self.peak

    def reset(self) -> None:
        """Start the peak again from now (a new phase begins)."""
        self.peak = self.read()

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# -- models and inputs ----------------------------------------------------------------------------------

QWEN3_MOE_1B = dict(
    hidden_size=1024,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=768,
    vocab_size=151_936,
)
"""Qwen3-MoE shapes of 1.56B parameters (32 experts, top-4), a Qwen-sized vocabulary: the GPU checks' model"""

SIZES = ("tiny", "small", "default", "1b")
"""The Qwen3-MoE shapes `model_config` knows: tiny_config's own; `agentrl models init --preset small`'s; the
embedded default policy's (repo_fix's start); QWEN3_MOE_1B"""


def model_config(size: str):
    """A Qwen3-MoE config of one of SIZES, with the project tokenizer's special tokens."""
    from agentrl.models.default import ARCHITECTURE, SMALL_ARCHITECTURE
    from agentrl.models.tiny import tiny_config

    shapes = {"tiny": {}, "small": SMALL_ARCHITECTURE, "default": ARCHITECTURE, "1b": QWEN3_MOE_1B}
    return tiny_config("qwen3_moe", **shapes[size])


def random_model(size: str, device: str = "cpu"):
    """A random-init float32 Qwen3-MoE of `size` (the same weights for the same size), initialised on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(model_config(size), dtype=torch.float32)


def model_folder(workdir: Path, size: str, device: str) -> Path:
    """A Hugging Face folder of `random_model(size)` with the project tokenizer, in `workdir`: made by the first
    caller that needs it, reused by the next ones."""
    from agentrl.models.tokenizer import load_tokenizer

    path = workdir / f"model-{size}"
    if not (path / "complete").exists():
        shutil.rmtree(path, ignore_errors=True)
        random_model(size, device).save_pretrained(path)
        load_tokenizer().save_pretrained(path)
        (path / "complete").touch()
    return path


def active_params(cfg) -> float:
    """Parameters each token uses: attention, the router, top-k experts, embeddings and head."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    attn = h * cfg.head_dim * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
    experts = cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
    return layers * (attn + experts + h * cfg.num_experts) + 2 * cfg.vocab_size * h


def matmul_params(cfg) -> float:
    """The parameters each token multiplies by, as MFU counts them: attention's projections, the router, the
    top-k experts and the output head; not the input embedding, which is only gathered."""
    return active_params(cfg) - cfg.vocab_size * cfg.hidden_size


def train_flops_per_token(cfg, context: float) -> float:
    """Forward and backward FLOPs per token, PaLM's count (arXiv:2204.02311, Appendix B): 6·N for the N matmul
    parameters, plus 12·L·H·Q·T for attention over a context of T tokens (L layers, H heads of size Q)."""
    attention = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * context
    return 6 * matmul_params(cfg) + attention


def describe_model(cfg, name: str = "qwen3_moe") -> str:
    """`name`: its parameters and active parameters, in millions (counted on the meta device: nothing allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    return f"{name}: {n / 1e6:.1f}M parameters, {active_params(cfg) / 1e6:.1f}M active"


def synthetic_batch(B: int, L: int, vocab: int, device: str):
    """A TrainBatch of B sequences of L tokens: a prompt, generated turns and an observation each (the loss mask
    keeps the generated ones), random tokens, old logprobs and advantages (seed 0)."""
    import torch

    # the learner's modules are imported here: gpu_check.py's driver imports this module on machines without Ray
    from agentrl.engine.base import SamplingParams
    from agentrl.train.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[:, : L // 4] = 0  # prompt
    mask[:, L // 2 : L // 2 + L // 16] = 0  # an observation
    return TrainBatch(
        input_ids=torch.randint(1, vocab, (B, L), generator=g).to(device),
        attention_mask=torch.ones_like(mask).to(device),
        loss_mask=mask.to(device),
        old_logprobs=(-torch.rand(B, L, generator=g) * 5 * mask).to(device),
        advantages=(torch.randn(B, L, generator=g) * mask).to(device),
        sampling=SamplingParams(),
    )


def prompts(n: int) -> list[list[int]]:
    """`n` short prompts of mixed kinds (code, a question, repetition, a tool call), token ids of the project
    tokenizer, each made distinct by its number."""
    from agentrl.models.tokenizer import load_tokenizer

    tok = load_tokenizer()
    texts = [
        "def add(a, b):",
        "What is 12 * 34? Use the calculator.",
        "hello " * 9,
        "x",
        "<tool_call>",
        "The quick brown fox jumps over the lazy dog. " * 3,
        "import numpy as np\n",
        "Answer:",
    ]
    return [tok.encode(f"{texts[i % len(texts)]} #{i}") for i in range(n)]


async def generate_all(engine, requests: list[list[int]], params) -> list:
    """Every request at once on the open `engine`, request i with seed i."""
    return await asyncio.gather(
        *(engine.generate(p, params.model_copy(update={"seed": i})) for i, p in enumerate(requests))
    )
