"""Run configs: recipes and --set overrides are validated before anything starts, with the fix named."""

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli import agentrl
from typer.testing import CliRunner

from agentrl.cli import app
from agentrl.cli.train import configs_dir, preflight, resolve_config
from agentrl.config import ConfigError, load, parse_sets
from agentrl.train.config import lr_factor
from agentrl.train.run_config import RunConfig

RECIPES = sorted(configs_dir().glob("*.yaml"))
GSPO = ["algo.loss=gspo", "algo.advantage=outcome"]


def test_unknown_key_names_the_valid_ones_and_a_close_match():
    with pytest.raises(ConfigError) as e:
        load(RunConfig, {"algo": {"lose": "grpo"}})
    msg = str(e.value)
    assert "algo.lose: unknown key (did you mean 'loss'?)" in msg
    assert "valid keys here: advantage, async_level, behaviour_cap" in msg


def test_wrong_types_and_choices_are_refused_with_the_choices():
    with pytest.raises(ConfigError, match=r"algo.loss: Input should be 'gspo', 'gspo_token' or 'grpo'"):
        load(RunConfig, parse_sets(["algo.loss=ppo"]))
    with pytest.raises(ConfigError, match=r"rollout.group_size: Input should be a valid integer"):
        load(RunConfig, parse_sets(["rollout.group_size=many"]))


@pytest.mark.parametrize(
    ("sets", "match"),
    [
        (["algo.loss=gspo", "algo.advantage=turn"], "one advantage per sequence"),
        (["rollout.sampling.temperature=0"], "greedy"),
        (["engine.kind=openai"], "base_url is required"),
        (["engine.kind=vllm", "engine.record_routing=true"], "record_routing needs engine.kind=hf"),
        (["rollout.partial=false", "rollout.iteration_token_budget=100"], "need partial=true"),
        (["algo.tis_cap=2"], "old_logprobs='recompute'"),
        (["algo.behaviour_weight=band", "algo.behaviour_cap=1"], r"needs behaviour_cap > 1, got 1.0"),
        ([*GSPO, "algo.behaviour_weight=mask", "algo.behaviour_level=token"], "or loss 'gspo_token'"),
        (["algo.routing_replay=R3"], "set engine.record_routing=true"),
        (["algo.routing_replay=R3", "engine.kind=openai", "engine.base_url=http://x"], "set engine.record_routing"),
        (["algo.routing_replay=R4"], "'none', 'R2' or 'R3'"),
        (["sandbox.backend=podman"], "sandbox.backend: Input should be 'docker', 'bwrap' or 'local'"),
        # env workers in processes of this one are on this machine: never with a cluster for them
        (["rollout.env_workers=local", "cluster.address=auto"], "drop cluster.address, or set rollout.env_workers=ray"),
        (
            ["rollout.env_workers=local", "rollout.ray_address=10.0.0.1:6379"],
            "drop ray_address, or set env_workers=ray",
        ),
        (["sandbox.backend=local", "cluster.address=auto"], "local sandboxes are host processes, not isolation"),
    ],
)
def test_incompatible_combinations_are_refused(sets, match):
    with pytest.raises(ConfigError, match=match):
        load(RunConfig, parse_sets(sets))


OPENAI = ["engine.kind=openai", "engine.base_url=http://x"]


@pytest.mark.parametrize(
    ("sets", "match"),
    [
        ([*OPENAI, "engine.dtype=bfloat16"], "engine.dtype does nothing with engine.kind=openai"),
        ([*OPENAI, "engine.max_batch_size=8"], "engine.max_batch_size does nothing with engine.kind=openai"),
        (["engine.kind=vllm", "engine.prefix_cache_tokens=0"], "does nothing with engine.kind=vllm"),
        (["engine.kind=vllm", "engine.decode_window=8"], "decode_window sets the hf engine's decode loop"),
        ([*OPENAI, "engine.prefix_cache_tokens=0"], "does nothing with engine.kind=openai"),
        (["engine.affinity_slack_tokens=100"], "affinity_slack_tokens chooses between replicas"),
        (["engine.replicas=1", "engine.affinity_slack_tokens=100"], "it does nothing without two or more"),
        (["engine.options.note=hi"], "engine.options does nothing with engine.kind=hf"),
        (["algo.advantage=outcome", "algo.gamma=0.9"], "algo.gamma .* does nothing with algo.advantage=outcome"),
        (["algo.behaviour_cap=3"], "algo.behaviour_cap does nothing with algo.behaviour_weight=none"),
        (["algo.behaviour_level=token", "algo.behaviour_cap=3"], "behaviour_level and algo.behaviour_cap do nothing"),
        (["optim.warmup_steps=10", "optim.decay_steps=10"], "decay_steps=10 ends the cosine decay no later"),
        (["optim.min_lr_ratio=0"], "optim.min_lr_ratio .* does nothing without optim.decay_steps"),
        (["optim.warmup_steps=10", "optim.decay_steps=0", "optim.min_lr_ratio=0"], "set optim.decay_steps >"),
        (["log.wandb='off'", "log.wandb_project=mine"], "log.wandb_project does nothing with log.wandb=off"),
        (["log.trajectories_per_iteration=0", "log.max_trajectory_mb=9"], "max_trajectory_mb .* does nothing"),
        (["rollout.sampling.seed=3"], "rollout.sampling.seed does nothing: .* set rollout.seed"),
        (["rollout.sampling.stop_token_ids=[7]"], "rollout.sampling.stop_token_ids does nothing"),
        (["rollout.on_infra_failure=mask", "rollout.max_retries=3"], "max_retries does nothing with .*=mask"),
        (["rollout.partial=false", "rollout.max_staleness=2"], "max_staleness does nothing with rollout.partial"),
        (["algo.routing_replay=R2", "optim.minibatches=1"], "R2 .* does nothing at optim.minibatches=1"),
        (["cluster.inference.resources={inference: 1}"], "cluster.inference .* does nothing without engine.repl"),
        (
            ["cluster.address=auto", "cluster.inference.gpus_per_replica=1"],
            "cluster.inference .* does nothing without engine.replicas",
        ),
        (
            ["engine.replicas=1", "engine.ray_address=10.0.0.1:6379", "rollout.ray_address=10.0.0.2:6379"],
            "one of them would do nothing",
        ),
    ],
)
def test_settings_that_cannot_apply_are_refused(sets, match):
    with pytest.raises(ConfigError, match=match):
        load(RunConfig, parse_sets(sets))


@pytest.mark.parametrize(
    "sets",
    [
        ["engine.kind=vllm", "engine.dtype=bfloat16", "engine.max_batch_size=8"],
        ["engine.prefix_cache_tokens=0", "engine.options={}"],
        ["engine.replicas=2", "engine.affinity_slack_tokens=100", "cluster.inference.resources={inference: 1}"],
        [*OPENAI[:1], "engine.base_urls=[http://a, http://b]", "engine.affinity_slack_tokens=100"],
        ["algo.gamma=0.9", "algo.behaviour_weight=truncate", "algo.behaviour_cap=3", "algo.behaviour_level=token"],
        ["optim.warmup_steps=5", "optim.decay_steps=20", "optim.min_lr_ratio=0"],
        ["log.wandb_project=mine", "log.max_trajectory_mb=9", "rollout.seed=3", "rollout.max_retries=3"],
        ["rollout.max_staleness=2", "algo.routing_replay=R2", "optim.minibatches=2"],
        ["rollout.partial=false", "algo.async_level=1", "rollout.max_staleness=2"],
        ["engine.replicas=1", "engine.ray_address=10.0.0.1:6379", "rollout.ray_address=10.0.0.1:6379"],
        ["sandbox.backend=bwrap", "cluster.address=auto"],
    ],
)
def test_the_same_settings_load_where_they_apply(sets):
    load(RunConfig, parse_sets(sets))


def test_settings_left_at_their_defaults_never_count_as_set():
    """A run's saved config.yaml sets every field, most at their defaults: with every switch that makes some
    setting inert turned, it loads back as it was."""
    switches = [
        *OPENAI,
        "algo.advantage=outcome",
        "optim.warmup_steps=3",
        "log.wandb='off'",
        "log.trajectories_per_iteration=0",
        "rollout.on_infra_failure=mask",
        "rollout.partial=false",
    ]
    cfg = load(RunConfig, parse_sets(switches))
    saved = yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert load(RunConfig, saved) == cfg
    assert load(RunConfig, parse_sets([*switches, "algo.gamma=1.0", "rollout.max_retries=1"])) == cfg


def test_a_bare_on_or_off_names_the_switch_not_a_bool():
    """YAML reads `off` as false: `--set log.wandb=off` and a recipe's `wandb: on` still mean the switch."""
    assert load(RunConfig, parse_sets(["log.wandb=off"])).log.wandb == "off"
    assert load(RunConfig, yaml.safe_load("log: {wandb: on}")).log.wandb == "on"
    with pytest.raises(ConfigError, match=r"log\.wandb"):
        load(RunConfig, parse_sets(["log.wandb=maybe"]))


def test_behaviour_options_load_and_old_keys_keep_their_meaning():
    """band and behaviour_level load; configs saved before behaviour_weight keep loading as the weight at the
    objective's own level, which is what they were."""
    algo = load(
        RunConfig,
        parse_sets(
            ["algo.loss=grpo", "algo.behaviour_weight=band", "algo.behaviour_cap=3", "algo.behaviour_level=sequence"]
        ),
    ).algo
    assert (algo.behaviour_weight, algo.behaviour_cap, algo.behaviour_level) == ("band", 3.0, "sequence")
    old = load(RunConfig, {"algo": {"loss": "grpo", "old_logprobs": "recompute", "tis_cap": 1.5}}).algo
    assert (old.behaviour_weight, old.behaviour_cap, old.behaviour_level) == ("truncate", 1.5, "auto")


def test_set_parses_dotted_keys_and_yaml_values():
    sets = [
        "algo.loss=grpo",
        "rollout.sampling.temperature=0.7",
        "rollout.env_kwargs.tasks=humaneval",
        "iterations=3",
        "model.lora.target_modules=[q_proj, v_proj]",
    ]
    assert parse_sets(sets) == {
        "algo": {"loss": "grpo"},
        "rollout": {"sampling": {"temperature": 0.7}, "env_kwargs": {"tasks": "humaneval"}},
        "iterations": 3,
        "model": {"lora": {"target_modules": ["q_proj", "v_proj"]}},
    }
    with pytest.raises(ConfigError, match="key=value"):
        parse_sets(["iterations"])


def test_the_seed_reaches_the_rollouts_unless_they_set_their_own():
    assert load(RunConfig, {"seed": 7}).rollout.seed == 7
    assert load(RunConfig, {"seed": 7, "rollout": {"seed": 1}}).rollout.seed == 1


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_loads(recipe):
    cfg = load(RunConfig, yaml.safe_load(recipe.read_text()), source=recipe.name)
    assert cfg.iterations >= 1


def test_default_recipe_and_overrides_resolve():
    cfg = resolve_config("code_sandbox", None, ["algo.loss=grpo", "algo.advantage=outcome"], None)
    assert (cfg.rollout.env, cfg.model.path, cfg.algo.loss, cfg.algo.advantage) == (
        "code_sandbox",
        "default",
        "grpo",
        "outcome",
    )
    saved = yaml.safe_dump(cfg.model_dump(mode="json"))  # config.yaml of the run folder
    assert load(RunConfig, yaml.safe_load(saved)) == cfg


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--set", "optim.learning_rate=1"], "optim.learning_rate: unknown key"),
        # the fast tier goes through the command's refusal once; these two differ only in the message
        pytest.param(["--set", "rollout.env_kwargs.max_turnz=3"], "max_turnz", marks=pytest.mark.slow),
        pytest.param(["--set", "rollout.env=code_sandbx"], "Did you mean", marks=pytest.mark.slow),
    ],
)
def test_agentrl_train_refuses_a_bad_config_before_starting(tmp_path, args, match):
    """Nothing starts: no run folder, no Ray, no container; exit 2 and the reason."""
    r = agentrl("train", "--env", "code_sandbox", *args, cwd=tmp_path, timeout=120, check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    assert match in r.stderr
    assert not (tmp_path / "runs").exists()


def test_a_run_config_resolves_without_importing_torch_transformers_or_ray():
    """A bad setting is refused before what runs a training is imported (about 1 s of imports instead of 5): the
    settings' modules are plain pydantic, and the rollout and eval packages import the rest on first use."""
    code = (
        "import sys\n"
        "from agentrl.cli.train import resolve_config\n"
        "resolve_config('code_sandbox', None, ['iterations=3'], None)\n"
        "print(sorted({'torch', 'transformers', 'ray'} & set(sys.modules)))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert r.stdout.strip() == "[]", r.stdout


def test_the_start_up_check_is_the_sandbox_backend_s_and_names_bwrap_without_a_docker_engine():
    """Docker is out of reach here (no docker marker): the check says so in one line with the daemon-free backend,
    which it never falls back to; with that backend chosen nothing is missing."""
    cfg = resolve_config("code_sandbox", None, [], None)
    assert preflight(cfg) == [
        "sandbox.backend=docker: no Docker engine answers (start one: `bash scripts/setup.sh`), or run sandboxes "
        "without a daemon: --set sandbox.backend=bwrap (`--backend bwrap` for agentrl sandbox and agentrl envs)"
    ]
    assert preflight(resolve_config("code_sandbox", None, ["sandbox.backend=bwrap"], None)) == []


def test_a_resume_stays_in_its_folder_and_a_run_folder_is_a_folder(tmp_path, capsys):
    """`--resume RUN --set out=OTHER` would continue (or start over, or overwrite another run's config) in OTHER; an
    `out` that is a file is said in one line, not a traceback."""
    from agentrl.cli.train import _create_run_folder

    run = Path(__file__).parents[1] / "data" / "run_v0" / "run"
    with pytest.raises(ValueError, match=r"--resume continues the run in .*: drop --set out"):
        resolve_config(None, None, [f"out={tmp_path}"], run)
    afile = tmp_path / "afile"
    afile.write_text("mine")
    cfg = resolve_config("code_sandbox", None, [f"out={afile}"], None)
    assert not _create_run_folder(cfg, None) and afile.read_text() == "mine"
    assert "is a file, not a run folder" in capsys.readouterr().err


def test_held_out_tasks_a_run_would_train_on_are_refused_before_it_starts():
    """humaneval's default split is all of it: its test split is no held-out set for a run that trains on it."""
    sets = ["sandbox.backend=bwrap"]
    [line] = preflight(resolve_config("humaneval", None, sets, None))
    assert line.startswith("eval.tasks: held-out evaluation draws the test split of humaneval"), line
    assert "rollout.env_kwargs.split=train" in line
    assert preflight(resolve_config("humaneval", None, [*sets, "rollout.env_kwargs.split=train"], None)) == []
    assert preflight(resolve_config("humaneval", None, [*sets, "eval.tasks=0"], None)) == []


def test_a_host_without_bubblewrap_is_told_in_one_line(monkeypatch, tmp_path):
    """No `bwrap` on PATH: `agentrl train` and `agentrl sandbox exec` refuse in one line naming the package, and
    nothing starts."""
    from agentrl.sandbox import bwrap

    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH where no bwrap is
    bwrap.unavailable.cache_clear()
    try:
        cfg = resolve_config("code_sandbox", None, ["sandbox.backend=bwrap"], None)
        [line] = preflight(cfg)
        assert line.startswith("sandbox.backend=bwrap: bubblewrap is not installed (no `bwrap` on PATH)"), line
        assert "apt-get install bubblewrap" in line
    finally:
        bwrap.unavailable.cache_clear()
    prog = tmp_path / "p.py"
    prog.write_text("print(1)")
    r = agentrl("sandbox", "exec", prog, "--backend", "bwrap", check=False, extra_env={"PATH": str(tmp_path)})
    assert r.returncode != 0 and "bubblewrap is not installed" in r.stderr and "Traceback" not in r.stderr


def test_namespaces_refused_are_said_in_one_line_and_a_probe_that_fails_once_is_tried_again(monkeypatch, tmp_path):
    """A `bwrap` that refuses its namespaces every time is named with what it said; one that refuses once (a busy
    host) is asked again before the answer is kept for the process."""
    from agentrl.sandbox import bwrap

    fake = tmp_path / "bwrap"
    tries = tmp_path / "tries"
    fake.write_text(
        "#!/bin/sh\n"
        f"echo x >> {tries}\n"
        f'[ "$(wc -l < {tries})" -gt "$REFUSALS" ] && exit 0\n'
        "echo 'bwrap: Creating new namespace failed: Operation not permitted' >&2; exit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    try:
        for refusals, said in [
            (
                "9",
                "bubblewrap's namespaces are refused on this host: bwrap: Creating new namespace failed: Operation "
                "not permitted",
            ),
            ("1", None),
        ]:
            tries.unlink(missing_ok=True)
            monkeypatch.setenv("REFUSALS", refusals)
            bwrap.unavailable.cache_clear()
            assert bwrap.unavailable() == said
        assert tries.read_text().count("x") == 2
    finally:
        bwrap.unavailable.cache_clear()


def test_learning_rate_schedule_warms_up_then_decays_to_its_floor():
    f = [lr_factor(s, warmup=2, decay=10, floor=0.1) for s in range(13)]
    assert f[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert f[6] == pytest.approx(0.55)  # half way through the cosine: (1 + 0.1) / 2
    assert all(a > b for a, b in itertools.pairwise(f[2:11])) and f[10:] == pytest.approx([0.1] * 3)
    assert [lr_factor(s, warmup=2, decay=0, floor=0.1) for s in (2, 50)] == [1.0, 1.0]  # no decay asked


def test_replicas_start_on_the_runs_ray_address_and_a_resume_may_name_another():
    """engine replicas follow rollout.ray_address without a copy in the saved engine section, which would refuse a
    resume that names a new address as two clusters."""
    cfg = load(RunConfig, parse_sets(["engine.replicas=1", "rollout.ray_address=10.0.0.1:6379"]))
    assert cfg.engine.ray_address is None and cfg.engine_config().ray_address == "10.0.0.1:6379"
    saved = yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json")))
    moved = load(RunConfig, {**saved, "rollout": {**saved["rollout"], "ray_address": "10.0.0.2:6379"}})
    assert moved.engine_config().ray_address == "10.0.0.2:6379"
    own = load(RunConfig, parse_sets(["engine.replicas=1", "engine.ray_address=10.0.0.3:6379"]))
    assert own.engine_config().ray_address == "10.0.0.3:6379"
    assert load(RunConfig, parse_sets(["rollout.ray_address=10.0.0.1:6379"])).engine_config().ray_address is None


def test_a_cluster_run_resumes_on_a_cluster_at_another_address():
    """The address is said once (cluster.address) and not copied into the saved sections: the saved config of a
    cluster run loads with a new address (the head moved) or none; naming a second address is refused."""
    cfg = load(
        RunConfig,
        parse_sets(["cluster.address=auto", "engine.replicas=2", "cluster.inference.resources={inference: 1}"]),
    )
    assert (cfg.ray_address, cfg.rollout.ray_address, cfg.engine.ray_address) == ("auto", None, None)
    assert cfg.engine.placement.resources == {"inference": 1}
    saved = yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json")))
    moved = load(RunConfig, {**saved, "cluster": {**saved["cluster"], "address": "10.0.0.1:6379"}})
    assert moved.ray_address == "10.0.0.1:6379" and moved.engine.placement.resources == {"inference": 1}
    assert load(RunConfig, {**saved, "cluster": {**saved["cluster"], "address": None}}).ray_address is None
    with pytest.raises(ConfigError, match=r"on a cluster set only cluster\.address"):
        load(RunConfig, parse_sets(["cluster.address=auto", "rollout.ray_address=10.0.0.1:6379"]))


def test_a_bwrap_run_on_a_cluster_places_its_env_workers_on_bwrap_nodes():
    """cluster.envs.node_resource defaults to the sandbox backend's name: a bwrap run's env workers go to the nodes
    started with {"bwrap": 1}, a Docker run's to those with {"docker": 1}; a resource named stays."""
    on_cluster = ["cluster.address=auto"]
    bwrap = load(RunConfig, parse_sets([*on_cluster, "sandbox.backend=bwrap"]))
    assert bwrap.cluster.envs.resource(bwrap.sandbox.backend) == "bwrap"
    docker = load(RunConfig, parse_sets(on_cluster))
    assert docker.cluster.envs.resource(docker.sandbox.backend) == "docker"
    named = load(RunConfig, parse_sets([*on_cluster, "sandbox.backend=bwrap", "cluster.envs.node_resource=gpu_box"]))
    assert named.cluster.envs.resource(named.sandbox.backend) == "gpu_box"


def test_a_set_value_that_is_not_yaml_is_refused_in_one_line():
    """`--set optim.betas=[0.9` was a YAML traceback (exit 1): it is the command's one-line refusal, exit 2."""
    with pytest.raises(ConfigError) as e:
        parse_sets(["optim.betas=[0.9"])
    assert str(e.value).startswith("--set 'optim.betas=[0.9': the value is not YAML (") and "\n" not in str(e.value)
    r = CliRunner().invoke(app, ["train", "--env", "code_sandbox", "--set", "out=@runs"])
    assert r.exit_code == 2 and "--set 'out=@runs': the value is not YAML" in r.output, r.output


def test_a_key_said_twice_in_a_recipe_is_refused_not_dropped(tmp_path):
    """PyYAML keeps the last of two `optim:` sections: the first's lr was dropped without a word."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim:\n  lr: 1.0e-5\nrollout:\n  env: code_sandbox\noptim:\n  minibatches: 2\n")
    with pytest.raises(ConfigError, match=r"r\.yaml: key 'optim' appears twice in one mapping, line 5$"):
        resolve_config(None, recipe, [], None)
    with pytest.raises(ConfigError, match="key 'a' appears twice"):
        parse_sets(["rollout.env_kwargs={a: 1, a: 2}"])


def test_an_empty_mapping_set_empties_the_recipe_s():
    """`--set cluster.learner.resources={}` merged into the recipe's {learner: 1} and so changed nothing."""
    cluster = configs_dir() / "qwen3_30b_a3b_cluster.yaml"
    cfg = resolve_config(None, cluster, ["cluster.learner.resources={}", "rollout.env_kwargs={}"], None)
    assert cfg.cluster.learner.resources == {} and cfg.rollout.env_kwargs == {}
    one = resolve_config(None, cluster, ["rollout.env_kwargs.max_turns=3"], None)  # a dotted key changes one entry
    assert one.rollout.env_kwargs == {"tasks": "procedural", "max_turns": 3}


def test_a_set_number_with_an_exponent_is_a_number_in_untyped_settings_too():
    """PyYAML reads `1e-5` (no dot) as a string: typed fields coerce it, env_kwargs kept the string."""
    assert parse_sets(["rollout.env_kwargs.x=1e-5", "optim.lr=3E-6", "out='1e5'"]) == {
        "rollout": {"env_kwargs": {"x": 1e-5}},
        "optim": {"lr": 3e-6},
        "out": "1e5",
    }


def test_an_unknown_key_in_a_list_entry_names_the_entry_s_keys():
    """eval.benchmarks.0.x named no valid keys at all ("valid keys here: ")."""
    with pytest.raises(
        ConfigError,
        match=r"eval\.benchmarks\.0\.tsks: unknown key \(did you mean 'tasks'\?\); valid "
        r"keys here: context, env, env_kwargs, k,",
    ):
        load(RunConfig, parse_sets(["eval.benchmarks=[{env: humaneval, tsks: 2}]"]))
