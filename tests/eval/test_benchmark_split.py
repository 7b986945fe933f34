"""A benchmark of a run on the run's own env is held out from its training tasks: it splits them as the run does."""

import json

import pytest

from agentrl.config import ConfigError, load, parse_sets
from agentrl.eval.bench import bench_tasks
from agentrl.rollout.workers import make_env
from agentrl.train.run_config import RunConfig


def run_config(trained: dict, *benchmarks: str) -> RunConfig:
    return load(
        RunConfig,
        parse_sets(
            [
                "rollout.env=code_sandbox",
                f"rollout.env_kwargs={json.dumps(trained)}",
                f"eval.benchmarks=[{', '.join(benchmarks)}]",
            ]
        ),
    )


@pytest.mark.parametrize("trained", [{"split_seed": 7}, {"test_fraction": 0.1}], ids=["split_seed", "test_fraction"])
def test_a_benchmark_on_the_training_env_with_its_own_env_kwargs_sees_no_training_task(trained):
    """Its own env_kwargs (here max_turns) once left it the env's default split: seed 0 and a fifth held out, so a run
    splitting by another seed, or holding out less, trained on most of its "test" tasks."""
    cfg = run_config(trained, "{env: code_sandbox, env_kwargs: {max_turns: 2}, tasks: 200}", "{env: humaneval}")
    bench, humaneval = cfg.eval.benchmarks
    split, _, ids = bench_tasks(bench)
    training = make_env(cfg.rollout.env, cfg.rollout.env_kwargs).task_set

    def trained_on(task_id: str) -> bool:
        try:
            training.get(task_id)
        except KeyError:  # on the other side of the run's split
            return False
        return True

    assert split == "test" and len(ids) == 200 and not [i for i in ids if trained_on(i)]
    assert bench.env_kwargs == {"max_turns": 2, **trained} and humaneval.env_kwargs == {}  # another env: its own


@pytest.mark.parametrize(
    ("trained", "benchmark", "said", "run"),
    [
        ({"split_seed": 7}, {"split_seed": 3}, "env_kwargs.split_seed=3: ", "(rollout.env_kwargs.split_seed=7)"),
        ({}, {"test_fraction": 0.3}, "env_kwargs.test_fraction=0.3: ", "(rollout.env_kwargs.test_fraction unset"),
    ],
    ids=["split_seed", "test_fraction"],
)
def test_a_benchmark_splitting_the_training_env_otherwise_is_refused(trained, benchmark, said, run):
    with pytest.raises(ConfigError) as e:
        run_config(trained, json.dumps({"env": "code_sandbox", "env_kwargs": benchmark}))
    (line,) = [line for line in str(e.value).splitlines() if "eval.benchmarks.0." in line]
    assert said in line and f"splits its tasks as the run does {run}" in line and "drop it, or set" in line, line
    # drawing all its tasks, it asks for the training tasks too: nothing to hold out
    run_config(trained, json.dumps({"env": "code_sandbox", "env_kwargs": benchmark, "split": "all"}))
