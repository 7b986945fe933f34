"""Repository instances as task sets: the generated ones by spec (`repos`), and SWE-bench-style JSONL files
(`swebench:PATH`) of repositories the test builds itself (a git repository, a tarball)."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile

import numpy as np
import pytest
from repo_data import BUGGY, git_repo, record, write_jsonl

from agentrl.tasks import RepoTests
from agentrl.tasks import test_count as count_tests
from agentrl.tasks.registry import load_tasks
from agentrl.tasks.repos import LocalRunner, RepoTasks, generate, validate
from agentrl.tasks.repos.generate import variant
from agentrl.tasks.repos.taskset import GeneratedRepos, LoadedRepos

# Untraced by scripts/test.sh's coverage (pytest-cov's no_cover): these tests generate thousands of tasks in pure
# Python, which line tracing slows 2.6x (test_procedural.py and test_repo_tasksets.py together, fast tier, one
# process: 107 s traced, 41 s untraced, 40 s without coverage); the modules they run are imported and run by other
# tests too, so the every-module check is unchanged.
pytestmark = pytest.mark.no_cover


def test_generated_repos_by_spec_split_and_serve_instances():
    train_templates = load_tasks("repos")
    assert isinstance(train_templates, GeneratedRepos) and train_templates.templates == "train"
    train, test = train_templates.split("train"), train_templates.split("test")
    assert not set(train.ids()) & set(test.ids()) and len(train) + len(test) == len(train_templates)
    assert set(test.ids()) == set(RepoTasks().ids("test"))
    task = next(iter(test))
    inst = test.instance(task.id)
    assert task.prompt == inst.problem_statement and isinstance(task.tests, RepoTests)
    assert count_tests(task.tests) == len(inst.FAIL_TO_PASS) + len(inst.PASS_TO_PASS)
    assert task.metadata["template"] == inst.template and test.reference_solution(task) == inst.patch
    assert test.get(task.id) == task and test.sample(np.random.default_rng(0)).id in set(test.ids())
    with pytest.raises(KeyError):
        test.instance(next(iter(train)).id)  # the other side
    # the first N of a split span the templates (held-out evaluation takes the first N)
    assert len({test.instance(i).template for i in test.ids()[:20]}) >= 8
    held_out = load_tasks("repos:templates=test;by=site;families=off_by_one")
    assert set(held_out.ids()) <= set(RepoTasks(by="site").ids("train", templates="test")) | set(
        RepoTasks(by="site").ids("test", templates="test")
    )
    assert {held_out.instance(i).family for i in held_out.ids()} == {"off_by_one"}
    bad_specs = "templates=dev", "by=file", "colour=red", "part=3/2", "part=half", "spellings=0", "spellings=two"
    for bad in (f"repos:{b}" for b in bad_specs):
        with pytest.raises(ValueError):
            load_tasks(bad)


@pytest.mark.parametrize(
    "spec", ["repos:templates=", "repos:by=", "repos:part=", "repos:spellings=", "repos:families="]
)
def test_an_option_without_a_value_is_refused(spec):
    """Not an IndexError, nor (`families=`) quietly every family."""
    with pytest.raises(ValueError, match=rf"task set '{spec}': \w+= names no value"):
        load_tasks(spec)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_split_seed_splits_instances_and_leaves_the_held_out_templates_held_out(seed):
    """`repos:templates=test` (configs/repo_fix.yaml's "never trained on") stays so whatever the env's split_seed."""
    never_trained = {_template(i) for i in load_tasks("repos:templates=test").ids()}
    whole = load_tasks("repos")
    train, test = whole.split("train", seed=seed), whole.split("test", seed=seed)
    assert not {_template(i) for i in train.ids()} & never_trained
    assert not set(train.ids()) & set(test.ids()) and len(train) + len(test) == len(whole)
    assert set(test.ids()) != set(whole.split("test").ids())  # the seed still splits the instances
    assert load_tasks("repos:part=2/2").split("test", seed=seed).ids() == test.ids()  # parts share the held-out


def test_a_split_of_a_split_stays_inside_it():
    """`agentrl demos repo_fix --holdout`: the env's train side, split again by another seed, is a part of it."""
    env_train = load_tasks("repos").split("train", seed=0)
    held_out = set(load_tasks("repos").split("test", seed=0).ids())
    for side in ("train", "test"):
        inner = env_train.split(side, seed=1)
        assert len(inner) and set(inner.ids()) <= set(env_train.ids()) and not set(inner.ids()) & held_out


def _template(iid: str) -> str:
    """An instance's template, read off its variant without generating the instance."""
    return variant(iid).template.name


def test_parts_split_the_training_instances_and_keep_the_held_out_ones_whole():
    """SFT on part 1/2 and RL on part 2/2 see disjoint training instances, of every template, and are evaluated on
    the same held-out instances."""
    whole = load_tasks("repos")
    first, second = load_tasks("repos:part=1/2"), load_tasks("repos:part=2/2")
    a, b = set(first.split("train").ids()), set(second.split("train").ids())
    assert not a & b and a | b == set(whole.split("train").ids())
    assert min(len(a), len(b)) > 0.4 * len(whole.split("train"))
    templates = {_template(i) for i in whole.split("train").ids()}
    assert {_template(i) for i in a} == templates == {_template(i) for i in b}
    assert set(first.split("test").ids()) == set(second.split("test").ids()) == set(whole.split("test").ids())
    with pytest.raises(KeyError):
        second.instance(next(iter(a)))


def test_spellings_repeat_each_training_bug_under_other_names_and_keep_the_held_out_ones():
    """`spellings=3`: each training instance and two spellings of it, which keep its bug, package and cell but
    draw the paths, names and issue again and still validate; the held-out instances are those of the plain set."""
    plain, spelt = load_tasks("repos:part=1/2"), load_tasks("repos:part=1/2;spellings=3")
    train = spelt.split("train").ids()
    assert sorted(train) == sorted(j for i in plain.split("train").ids() for j in (i, f"{i}-1", f"{i}-2"))
    assert spelt.split("test").ids() == plain.split("test").ids()
    iid = "repo-mdtable-12"
    assert RepoTasks().cell_of(f"{iid}-2") == RepoTasks().cell_of(iid) == ("train", "train")
    held = plain.split("test").ids()[0]
    assert RepoTasks().cell_of(f"{held}-1") == ("test", "train")  # a spelling never crosses the split
    first, second = generate(iid), generate(f"{iid}-1")
    a, b = variant(iid), variant(f"{iid}-1")
    assert (a.site, a.pkg, a.values) == (b.site, b.pkg, b.values)
    assert set(first.repo) != set(second.repo) and first.patch != second.patch
    report = validate(second, LocalRunner())
    assert report.ok, report.problems
    for bad in (f"{iid}-0", f"{iid}-01"):
        with pytest.raises(ValueError, match="not a generated repository id"):
            variant(bad)


def test_a_fix_returning_an_object_equal_to_anything_fails_the_hidden_tests():
    """The generated hidden tests compare plain values: an answer object whose __eq__ says yes to anything fails."""
    inst = generate("repo-inifile-3")
    path = next(p for p in inst.repo if p.endswith("config.py"))
    hack = inst.repo[path] + (
        "\n\nclass _Yes:\n    def __eq__(self, other):\n        return True\n\n\n"
        "Config.getint = lambda self, *a, **k: _Yes()\n"
    )
    files = {**inst.repo, path: hack}
    from agentrl.tasks.repos import apply_patch

    outcomes = LocalRunner()(apply_patch(files, inst.test_patch), inst.FAIL_TO_PASS)
    assert set(outcomes.values()) == {"failed"}


# ---------------------------------------------------------------------------------------------------------------
# SWE-bench-style files (tests/repo_data.py builds them)


def test_a_git_repository_instance_loads_and_validates(tmp_path):
    commit = git_repo(tmp_path / "src" / "mathy", BUGGY)
    # a later commit must not leak into the instance: it is read at base_commit
    (tmp_path / "src" / "mathy" / "mathy" / "ops.py").write_text("BROKEN = True\n")
    subprocess.run(
        [
            "git",
            "-C",
            str(tmp_path / "src" / "mathy"),
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "commit",
            "-qam",
            "later",
        ],
        check=True,
    )
    tasks = load_tasks(f"swebench:{write_jsonl(tmp_path / 'data.jsonl', record('src/mathy', commit))}")
    assert isinstance(tasks, LoadedRepos) and tasks.ids() == ["mathy__clamp-1"]
    inst = tasks.instance("mathy__clamp-1")
    assert inst.repo == BUGGY  # text files at base_commit, the binary one left out
    assert inst.FAIL_TO_PASS == ["tests/test_edges.py::test_top"] and inst.image is None
    report = validate(inst, LocalRunner())
    assert report.ok, report.problems
    assert report.base["tests/test_edges.py::test_top"] == "failed"
    task = next(iter(tasks))
    assert task.prompt.startswith("clamp(12") and tasks.reference_solution(task) == inst.patch


def test_a_tarball_instance_with_a_top_folder_loads(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path, text in BUGGY.items():
            info = tarfile.TarInfo(f"mathy-abc123/{path}")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    (tmp_path / "mathy.tar.gz").write_bytes(buf.getvalue())
    image = tmp_path / "deps.tar"
    image.write_bytes(b"not checked here")
    data = write_jsonl(tmp_path / "d.jsonl", record("mathy.tar.gz", "abc123", image="deps.tar"))
    tasks = load_tasks(f"swebench:{data}")
    inst = tasks.instance("mathy__clamp-1")
    assert inst.repo == BUGGY and inst.image == str(image)


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"patch": None}, "patch"),
        ({"repo": "nowhere"}, "no such folder or tarball"),
        ({"base_commit": "0" * 40}, "git archive"),
        ({"FAIL_TO_PASS": ["not a node id"]}, "not pytest node ids"),
        ({"FAIL_TO_PASS": []}, "FAIL_TO_PASS is empty"),
        ({"image": "missing.tar"}, "image missing.tar"),
    ],
)
def test_a_bad_record_is_refused_with_its_line_and_reason(tmp_path, over, needle):
    commit = git_repo(tmp_path / "r", BUGGY)
    rec = {**record("r", commit), **over}
    if rec["patch"] is None:
        del rec["patch"]
    path = write_jsonl(tmp_path / "d.jsonl", record("r", commit, instance_id="ok-1"), rec)
    with pytest.raises(ValueError, match=needle) as e:
        load_tasks(f"swebench:{path}")
    assert str(e.value).startswith(f"{path}:2:")


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("null", "a record is a JSON object, not NoneType"),
        ("[1, 2]", "a record is a JSON object, not list"),
        ('"instance_id repo base_commit problem_statement patch test_patch FAIL_TO_PASS PASS_TO_PASS"', "not str"),
    ],
)
def test_a_record_that_is_not_an_object_is_refused_with_its_line(tmp_path, line, needle):
    commit = git_repo(tmp_path / "r", BUGGY)
    path = write_jsonl(tmp_path / "d.jsonl", record("r", commit))
    path.write_text(path.read_text() + line + "\n")
    with pytest.raises(ValueError, match=needle) as e:
        load_tasks(f"swebench:{path}")
    assert str(e.value).startswith(f"{path}:2:")
    path.write_text(json.dumps(record(5, commit)) + "\n")
    with pytest.raises(ValueError, match=f"{path}:1: repo, base_commit and image are strings"):
        load_tasks(f"swebench:{path}")


def test_a_problem_statement_with_unicode_line_separators_loads(tmp_path):
    """JSON strings may hold U+2028, U+2029 and U+0085 raw (`ensure_ascii=False`); they do not end a line."""
    commit = git_repo(tmp_path / "r", BUGGY)
    statement = "clamp(12, 0, 10) gives 9\u2028not 10\u2029\x85 (naïve ✓)"
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(record("r", commit, problem_statement=statement), ensure_ascii=False) + "\n", "utf-8")
    tasks = load_tasks(f"swebench:{path}")
    assert tasks.instance("mathy__clamp-1").problem_statement == statement


def test_split_names_a_side(tmp_path):
    """`all` is the env's word for no split; a task set's `split` takes a side only, as every set does."""
    commit = git_repo(tmp_path / "r", BUGGY)
    loaded = load_tasks(f"swebench:{write_jsonl(tmp_path / 'd.jsonl', record('r', commit))}")
    for tasks in (loaded, load_tasks("repos")):
        for bad in ("all", "Test"):
            with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
                tasks.split(bad)
        with pytest.raises(ValueError, match="test_fraction"):
            tasks.split("test", test_fraction=1.0)
