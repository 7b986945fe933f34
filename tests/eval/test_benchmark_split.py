"""A benchmark of a run on the run's own env is held out from its training tasks: it splits them as the run does."""

import json

import pytest
import yaml

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


def trained_on(training, task_id: str) -> bool:
    try:
        training.get(task_id)
    except KeyError:  # on the other side of the run's split
        return False
    return True


@pytest.mark.parametrize("trained", [{"split_seed": 7}, {"test_fraction": 0.1}], ids=["split_seed", "test_fraction"])
def test_a_benchmark_on_the_training_env_with_its_own_env_kwargs_sees_no_training_task(trained):
    """Its own env_kwargs (here max_turns) once left it the env's default split: seed 0 and a fifth held out, so a run
    splitting by another seed, or holding out less, trained on most of its "test" tasks."""
    cfg = run_config(trained, "{env: code_sandbox, env_kwargs: {max_turns: 2}, tasks: 200}", "{env: humaneval}")
    bench, humaneval = cfg.eval.benchmarks
    split, _, ids = bench_tasks(bench)
    training = make_env(cfg.rollout.env, cfg.rollout.env_kwargs).task_set
    assert split == "test" and len(ids) == 200 and not [i for i in ids if trained_on(training, i)]
    assert bench.env_kwargs == {"max_turns": 2, **trained} and humaneval.env_kwargs == {}  # another env: its own


@pytest.mark.parametrize(
    ("trained", "benchmark", "said", "run"),
    [
        ({"split_seed": 7}, {"split_seed": 3}, "env_kwargs.split_seed=3: ", "(rollout.env_kwargs: split_seed=7)"),
        ({}, {"test_fraction": 0.3}, "env_kwargs.test_fraction=0.3: ", "(rollout.env_kwargs: test_fraction unset"),
    ],
    ids=["split_seed", "test_fraction"],
)
def test_a_benchmark_splitting_the_training_env_otherwise_is_refused(trained, benchmark, said, run):
    with pytest.raises(ConfigError) as e:
        run_config(trained, json.dumps({"env": "code_sandbox", "env_kwargs": benchmark}))
    (line,) = [line for line in str(e.value).splitlines() if "eval.benchmarks.0." in line]
    assert (
        said in line
        and f"splits its tasks as training does {run}" in line
        and "drop it, or set" in line
        and "there too" in line
    ), line
    # drawing all its tasks, it asks for the training tasks too: nothing to hold out
    run_config(trained, json.dumps({"env": "code_sandbox", "env_kwargs": benchmark, "split": "all"}))


def trained_run(tmp_path, env_kwargs: dict, env: str = "code_sandbox"):
    """A run's folder as `agentrl train` leaves it, as far as `agentrl eval --model RUN/final` reads it."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"rollout": {"env": env, "env_kwargs": env_kwargs}}))
    return run / "final"


def test_agentrl_eval_of_a_runs_policy_splits_its_env_as_the_run_did(tmp_path):
    from agentrl.cli.evaluate import _as_trained
    from agentrl.eval.config import EvalCommandConfig

    final = trained_run(tmp_path, {"split_seed": 7})
    training = make_env("code_sandbox", {"split_seed": 7}).task_set
    cfg = EvalCommandConfig(env="code_sandbox", tasks=20)
    seed_0 = bench_tasks(cfg)[2]
    assert [i for i in seed_0 if trained_on(training, i)]  # the env's default split would score trained-on tasks
    assert _as_trained(cfg, final) is None and cfg.env_kwargs == {"split_seed": 7}
    assert not [i for i in bench_tasks(cfg)[2] if trained_on(training, i)]
    elsewhere = EvalCommandConfig(env="code_sandbox", tasks=20)  # not a run's final policy: nothing known of it
    assert _as_trained(elsewhere, tmp_path / "run" / "other") is None and elsewhere.env_kwargs == {}


@pytest.mark.parametrize(
    ("trained", "args", "said"),
    [
        ({"split_seed": 7}, ["--set", "env_kwargs.split_seed=3"], "--set env_kwargs.split_seed=3: an evaluation on"),
        ({"split": "all"}, [], "was trained on the all split of code_sandbox"),
        ({"split": "test"}, [], "was trained on the test split of code_sandbox"),
    ],
    ids=["another_seed", "trained_on_all", "trained_on_test"],
)
def test_agentrl_eval_refuses_to_score_a_runs_policy_on_tasks_it_trained_on(tmp_path, trained, args, said):
    from typer.testing import CliRunner

    from agentrl.cli import app

    final = trained_run(tmp_path, trained)
    r = CliRunner().invoke(app, ["eval", "--env", "code_sandbox", "--model", str(final), *args])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and said in r.output, r.output
    assert "(--set split=...)" in r.output or "drop it" in r.output
