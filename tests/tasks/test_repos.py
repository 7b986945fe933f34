"""Generated repository tasks (issue 27): the instance model, the diff applier, the templates and their bug
sites, the generator, validation with pytest, and the two-way splits.

The fast tier generates one instance of every bug site (SAMPLE_IDS, 141 of the 705) and checks each; the slow tier
generates all 705 (31 s), checks each the same way, holds what needs all of them (the counts, the spellings, the
largest repository) and validates every bug site with pytest.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from agentrl.tasks.repos import (
    FAMILIES,
    HIDDEN_TESTS,
    TEMPLATES,
    LocalRunner,
    PatchError,
    RepoInstance,
    RepoTasks,
    Site,
    Template,
    apply_patch,
    content_hash,
    count,
    generate,
    instance_id,
    make_patch,
    validate,
)
from agentrl.tasks.repos.generate import collect_tests, variant
from agentrl.tasks.repos.names import SYNONYMS, draw, renamable, rename, rename_path

gen_module = importlib.import_module("agentrl.tasks.repos.generate")  # the package's `generate` is the function

ALL_IDS = [instance_id(name, n) for name, t in sorted(TEMPLATES.items()) for n in range(count(t))]
# one instance of every bug site, its package and parameter values turning from site to site (instance n is site
# n % sites, then package, then parameters)
SAMPLE_IDS = [
    instance_id(name, k + len(t.sites) * (k % (count(t) // len(t.sites))))
    for name, t in sorted(TEMPLATES.items())
    for k in range(len(t.sites))
]
# the instances the tests below name, and the last of the largest template
SAMPLE_IDS += [i for i in ("repo-inifile-0", "repo-calc-0", "repo-roman-2", "repo-wraptext-71") if i not in SAMPLE_IDS]


@pytest.fixture(scope="module")
def instances() -> dict[str, RepoInstance]:
    """All 705: the slow tier's."""
    return {iid: generate(iid) for iid in ALL_IDS}


@pytest.fixture(scope="module")
def sample() -> dict[str, RepoInstance]:
    return {iid: generate(iid) for iid in SAMPLE_IDS}


def _digest(insts: dict[str, RepoInstance]) -> str:
    h = hashlib.sha256()
    for iid in sorted(insts):
        h.update(insts[iid].model_dump_json().encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------------------------
# The catalogue


def test_catalogue_has_enough_templates_and_families():
    assert len(TEMPLATES) >= 20
    assert len(FAMILIES) == 5
    users = defaultdict(set)
    for name, t in TEMPLATES.items():
        families = {s.family for s in t.sites}
        assert len(families) >= 3, f"{name} offers sites of only {families}"
        for f in families:
            users[f].add(name)
        modules = [m for m in t.modules if m != "__init__.py"]
        assert 3 <= len(modules) <= 8, f"{name} has {len(modules)} modules"
        assert "__init__.py" in t.modules and t.tests
        assert len({s.id for s in t.sites}) == len(t.sites) and all(s.id.isidentifier() for s in t.sites)
        assert len(t.packages) >= 2 and not set(t.packages) & sys.stdlib_module_names, name
        # the generator runs visible tests in-process, where only the package and the standard library exist
        assert not any("pytest" in text for text in t.tests.values()), name
    assert {f: len(names) for f, names in users.items() if len(names) < 3} == {}
    assert set(users) == set(FAMILIES)


def test_modules_call_each_other():
    """Every template's modules import one another (relative imports), so cross-module bugs have somewhere to be."""
    for name, t in TEMPLATES.items():
        edges = {
            (m, dep)
            for m, text in t.modules.items()
            if m != "__init__.py"
            for dep in re.findall(r"^from \.(\w+)", text, re.M)
        }
        assert len(edges) >= 2, f"{name}: modules import siblings only as {edges}"


# ----------------------------------------------------------------------------------------------------------------
# The generator


def test_generate_is_deterministic(sample):
    iid = SAMPLE_IDS[len(SAMPLE_IDS) // 2]
    assert generate(iid) == sample[iid]
    # another process, another string-hash salt: the same bytes, on every fourth instance of the sample (all
    # templates among them)
    ids = SAMPLE_IDS[::4]
    assert {sample[i].template for i in ids} == set(TEMPLATES)
    code = (
        "import hashlib, sys\n"
        "from agentrl.tasks.repos import generate\n"
        "h = hashlib.sha256()\n"
        "for iid in sorted(sys.argv[1:]):\n"
        "    h.update(generate(iid).model_dump_json().encode())\n"
        "print(h.hexdigest())\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code, *ids], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == _digest({i: sample[i] for i in ids})


@pytest.mark.slow
def test_instances_of_a_template_differ(instances):
    by_template = defaultdict(list)
    for inst in instances.values():
        by_template[inst.template].append(inst)
    for name, insts in by_template.items():
        assert len(insts) == count(TEMPLATES[name])
        assert len({(json.dumps(i.repo, sort_keys=True), i.problem_statement) for i in insts}) == len(insts), name
        # instances of one bug site differ in more than the bug: the package's name, a constant
        same_site = defaultdict(set)
        for i in insts:
            same_site[variant(i.instance_id).site.id].add(i.base_commit)
        assert all(
            len(commits) == len(TEMPLATES[name].packages) * _param_combos(name) for commits in same_site.values()
        )


def _param_combos(name: str) -> int:
    n = 1
    for values in TEMPLATES[name].params.values():
        n *= len(values)
    return n


@pytest.mark.slow
def test_instances_spell_the_package_s_names_differently(instances):
    """The names in a package's code are drawn per instance (`agentrl.tasks.repos.names`): most bug sites read
    differently from one instance to the next, and module files take several names, so a fix or a path recalled
    from another instance's code does not apply."""
    patches, layouts = defaultdict(set), defaultdict(set)
    for iid, inst in instances.items():
        v = variant(iid)
        assert v.names, f"{iid}: nothing renamed"
        lines = [line for line in inst.patch.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]
        patches[(inst.template, v.site.id)].add("\n".join(lines).replace(v.pkg, "PKG"))
        layouts[inst.template].add(frozenset(p.split("/", 1)[1] for p in inst.repo if not p.startswith("tests/")))
    assert sum(len(texts) > 1 for texts in patches.values()) >= 0.75 * len(patches)
    assert all(len(seen) >= 2 for seen in layouts.values()), layouts


def test_renaming_changes_no_behaviour():
    """Every template: a renamed variant's hidden sessions give what the same variant with the template's own
    names gives, the same values and the same exceptions with the same messages."""
    for name in sorted(TEMPLATES):
        v = variant(instance_id(name, 0))
        renamed, own = (
            gen_module._expected(x, x.files(), gen_module._hidden_sessions(x)[1])
            for x in (v, dataclasses.replace(v, names={}))
        )
        for a, b in zip(renamed, own, strict=True):
            assert (a.value, str(a.raised)) == (b.value, str(b.raised)), name
            if b.raised is not None:
                own_name = type(b.raised).__name__
                assert type(a.raised).__name__ == v.names.get(own_name, own_name), name


RENAMED_MODULE = '''"""Reads `text` at `sep`."""
import re


def parse(text, sep=","):
    parts = re.split(sep, text)  # parts of text
    return sorted(parts, key=len), f"{text}", getattr(parts, "count"), "parse"
'''


def test_renaming_leaves_strings_comments_and_foreign_names_alone():
    # text occurs in an f-string, "parse" in a string; re, split and key are the library's; a module's stem counts
    others = ["from pkg import parse\nparse('a,b')"]
    assert renamable({"pkg/reader.py": RENAMED_MODULE}, others, "pkg") == {"reader", "sep", "parts"}
    out = rename(RENAMED_MODULE, {"parts": "pieces", "sep": "divider", "text": "src"}, docstrings=True)
    assert out == (
        '"""Reads `src` at `divider`."""\n'
        "import re\n\n\n"
        'def parse(src, divider=","):\n'
        "    pieces = re.split(divider, src)  # parts of text\n"
        '    return sorted(pieces, key=len), f"{text}", getattr(pieces, "count"), "parse"\n'
    )
    assert rename_path("pkg/reader.py", {"reader": "loader"}) == "pkg/loader.py"


def test_a_word_takes_one_spelling_in_every_name_and_never_one_in_use():
    spellings = set()
    for seed in range(30):
        names = draw({"text", "parse_text", "TEXT_COLOR", "TextBox"}, set(), random.Random(seed))
        word = names.get("text", "text")
        spellings.add(word)
        assert names.get("TEXT_COLOR", "TEXT_COLOR") == f"{word.upper()}_COLOR"
        assert names.get("parse_text", "parse_text").endswith(f"_{word}")
        assert names.get("TextBox", "TextBox") == word.title().replace("_", "") + "Box"
    assert spellings == {"text", *SYNONYMS["text"]}
    taken = {"src", "source", "string"}
    assert all("text" not in draw({"text"}, taken, random.Random(seed)) for seed in range(30))


def test_generate_rejects_ids_it_cannot_build():
    for bad in ("repo-nosuchtemplate-0", f"repo-calc-{count(TEMPLATES['calc'])}", "calc-1", "repo-calc-x"):
        with pytest.raises(ValueError):
            generate(bad)


def test_instance_fields(sample):
    for iid, inst in sample.items():
        _assert_fields(iid, inst)


def _assert_fields(iid: str, inst: RepoInstance) -> None:
    v = variant(iid)
    module = v.module(v.site)
    assert inst.family == v.site.family and inst.template == v.template.name and inst.image is None
    assert inst.base_commit == content_hash(inst.repo)
    # the gold patch touches the planted module only, and restores the template's code
    assert re.findall(r"^diff --git a/(\S+)", inst.patch, re.M) == [module]
    fixed = apply_patch(inst.repo, inst.patch)
    original = v.files()
    assert {p: t for p, t in fixed.items() if not p.startswith("tests/")} == {
        p: t for p, t in original.items() if not p.startswith("tests/")
    }
    # the test patch touches tests only; after it, every collected test is graded, and only those
    touched = re.findall(r"^diff --git a/(\S+)", inst.test_patch, re.M)
    assert HIDDEN_TESTS in touched and all(p.startswith("tests/") for p in touched)
    with_tests = apply_patch(inst.repo, inst.test_patch)
    assert sorted(collect_tests(with_tests)) == sorted(inst.FAIL_TO_PASS + inst.PASS_TO_PASS)
    # visible tests in the repository are all PASS_TO_PASS; FAIL_TO_PASS ones come with the test patch
    visible = collect_tests(inst.repo)
    assert set(visible) <= set(inst.PASS_TO_PASS)
    assert not set(visible) & set(inst.FAIL_TO_PASS)
    assert any(n.endswith(f"::test_{v.site.id}") or f"::test_{v.site.id}_" in n for n in inst.FAIL_TO_PASS)


@pytest.mark.slow
def test_visible_tests_the_bug_breaks_move_to_the_test_patch(instances):
    moved = {iid: [n for n in i.FAIL_TO_PASS if not n.startswith(HIDDEN_TESTS)] for iid, i in instances.items()}
    assert sum(bool(m) for m in moved.values()) >= 50  # common enough to matter
    iid = next(iid for iid, m in moved.items() if m)
    inst = instances[iid]
    path, name = moved[iid][0].split("::")
    assert f"def {name}(" not in inst.repo[path]
    assert f"def {name}(" in apply_patch(inst.repo, inst.test_patch)[path]


@pytest.mark.slow
def test_repos_fit_a_small_context(instances):
    """Whole repository plus issue within a 4,096-token context with room for the episode: a bound in characters
    on every instance, and in tokens (the project tokenizer) on the largest."""
    size = {iid: sum(map(len, i.repo.values())) for iid, i in instances.items()}
    assert max(size.values()) <= 5000
    assert max(sum(len(t) for p, t in i.repo.items() if not p.startswith("tests/")) for i in instances.values()) <= 4200
    assert max(len(i.problem_statement) for i in instances.values()) <= 700
    from agentrl.models.tokenizer import load_tokenizer

    tok = load_tokenizer()
    largest = instances[max(size, key=size.get)]
    text = "".join(f"{p}\n{t}\n" for p, t in sorted(largest.repo.items())) + largest.problem_statement
    assert len(tok.encode(text)) <= 2400


def test_problem_statement_does_not_leak_the_fix(sample):
    for iid, inst in sample.items():
        _assert_no_leak(iid, inst)


def _assert_no_leak(iid: str, inst: RepoInstance) -> None:
    v = variant(iid)
    text = inst.problem_statement
    module = v.module(v.site)
    stem = module.removesuffix(".py").replace("/", ".")
    for leak in (module.split("/", 1)[1], module, stem, "_agentrl_repo", " at 0x"):
        assert leak not in text, f"{iid}: the issue names {leak!r}"
    for snippet in (v.site.original, v.site.buggy):
        snippet = v.render(snippet, module_text=True).strip()
        lines = [line.strip() for line in snippet.splitlines() if len(line.strip()) >= 12]
        for part in [snippet, *lines] if snippet else []:
            assert part not in text, f"{iid}: the issue quotes the code {part!r}"
    assert text.startswith(v.title(v.site))
    assert f">>> from {v.pkg} import" in text


# ----------------------------------------------------------------------------------------------------------------
# Diffs


def test_make_patch_round_trip():
    before = {"a.py": "1\n2\n3\n4\n5\n6\n7\n8\n9\n10\n", "b.py": "x\ny", "gone.py": "bye\n", "empty.py": ""}
    after = {"a.py": "1\nTWO\n3\n4\n5\n6\n7\n8\n9\nten\n11\n", "b.py": "x\ny\nz", "new.py": "hi\n", "e2.py": ""}
    diff = make_patch(before, after)
    assert apply_patch(before, diff) == after
    assert apply_patch(after, make_patch(after, before)) == before
    assert make_patch(before, before) == "" and apply_patch(before, "") == before
    assert "\\ No newline at end of file" in diff and "new file mode" in diff and "deleted file mode" in diff
    rng = random.Random(0)
    for _ in range(200):
        old = {f"f{k}.py": _random_text(rng) for k in range(3)}
        new = {path: _edit(rng, text) for path, text in old.items()}
        assert apply_patch(old, make_patch(old, new, context=rng.randint(0, 3))) == new


def _random_text(rng: random.Random) -> str:
    # lines holding what str.splitlines would also break at (a form feed, a lone "\r", "\u2028"), and CRLF ends
    kinds = ["a", "b", "c", "", "def f():", "    return 1", "\f", "x = 1  \f# page", "a\rb", "s = '\u2028'", "crlf\r"]
    lines = [rng.choice(kinds) for _ in range(rng.randint(0, 12))]
    return "\n".join(lines) + rng.choice(["", "\n"])


def _edit(rng: random.Random, text: str) -> str:
    lines = text.split("\n")
    for _ in range(rng.randint(0, 4)):
        k = rng.randint(0, len(lines))
        match rng.randint(0, 2):
            case 0:
                lines.insert(k, rng.choice(["new", "", "x = 2"]))
            case 1 if lines:
                del lines[min(k, len(lines) - 1)]
            case _ if lines:
                lines[min(k, len(lines) - 1)] = "changed"
    return "\n".join(lines)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_our_patches_are_git_patches(sample, tmp_path):
    inst = sample["repo-inifile-0"]
    for path, text in inst.repo.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    (tmp_path / "p.diff").write_text(inst.patch + inst.test_patch)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "apply", "p.diff"], cwd=tmp_path, check=True)
    patched = apply_patch(apply_patch(inst.repo, inst.patch), inst.test_patch)
    assert all((tmp_path / p).read_text() == t for p, t in patched.items())
    # a form feed within a file, as Python's own sources hold between sections: git counts it inside its line
    before, after = {"ff.py": "a = 1\n\f\nb = 2\n"}, {"ff.py": "a = 1\n\f\nb = 3\n\f\n"}
    (tmp_path / "ff.py").write_bytes(before["ff.py"].encode())
    (tmp_path / "ff.diff").write_text(make_patch(before, after))
    subprocess.run(["git", "apply", "ff.diff"], cwd=tmp_path, check=True)
    assert (tmp_path / "ff.py").read_bytes() == after["ff.py"].encode() and apply_patch(
        before, make_patch(before, after)
    ) == after


def test_apply_patch_says_which_hunk_fails():
    before = {"pkg/m.py": "".join(f"line {k}\n" for k in range(1, 21))}
    after = {"pkg/m.py": before["pkg/m.py"].replace("line 3\n", "line three\n").replace("line 17\n", "")}
    diff = make_patch(before, after)
    changed = {"pkg/m.py": before["pkg/m.py"].replace("line 16\n", "line sixteen\n")}
    with pytest.raises(PatchError, match=r"pkg/m\.py: hunk #2 \(@@ -14,7 \+14,6 @@\) does not apply: expected line 16"):
        apply_patch(changed, diff)
    with pytest.raises(PatchError, match=r"pkg/m\.py: the diff changes it, but there is no such file"):
        apply_patch({}, diff)
    with pytest.raises(PatchError, match=r"new\.py: the diff creates it, but it already exists"):
        apply_patch({"new.py": "x\n"}, make_patch({}, {"new.py": "y\n"}))
    with pytest.raises(PatchError, match="ends early"):
        apply_patch(before, diff[: diff.rindex("\n", 0, -1) + 1])
    # a file that moved down keeps a unique match: it still applies, where `patch` would need fuzz
    shifted = {"pkg/m.py": "new first\nnew second\n" + before["pkg/m.py"]}
    assert apply_patch(shifted, diff)["pkg/m.py"] == "new first\nnew second\n" + after["pkg/m.py"]
    # a block that matches in two places, neither where the header says, is refused
    block = "a\nb\nc\n"
    with pytest.raises(PatchError, match=r"m\.py: hunk #1 .* expected line 1 to read 'a\\n', found 'x\\n'"):
        apply_patch({"m.py": "x\n" + block + "y\n" + block}, make_patch({"m.py": block}, {"m.py": "b2\n"}))


def test_repo_instance_rejects_bad_test_lists(sample):
    inst = sample["repo-calc-0"]
    fields = inst.model_dump()
    with pytest.raises(ValueError, match="node ids"):
        RepoInstance(**{**fields, "FAIL_TO_PASS": ["test_x"]})
    with pytest.raises(ValueError, match="both"):
        RepoInstance(**{**fields, "PASS_TO_PASS": [*inst.PASS_TO_PASS, inst.FAIL_TO_PASS[0]]})
    with pytest.raises(ValueError, match="FAIL_TO_PASS is empty"):
        RepoInstance(**{**fields, "FAIL_TO_PASS": []})


# ----------------------------------------------------------------------------------------------------------------
# Authoring mistakes are caught at generation


@pytest.fixture
def fake_template(monkeypatch):
    def install(**changes) -> str:
        base = {
            "name": "fake",
            "about": "a fake",
            "packages": ("fakepkg", "fakepkg2"),
            "modules": {
                "__init__.py": "from .a import inc\n",
                "a.py": "from .b import ONE\n\n\ndef inc(x):\n    return x + ONE\n",
                "b.py": "ONE = 1\n",
            },
            "tests": {"test_a.py": "from @pkg@ import inc\n\n\ndef test_inc():\n    assert inc(1) == 2\n"},
            "sites": (
                Site("plus", "wrong_operator_or_constant", "a.py", "x + ONE", "x - ONE", "inc is off", "inc(5)"),
            ),
        }
        monkeypatch.setitem(TEMPLATES, "fake", Template(**{**base, **changes}))
        return "repo-fake-0"

    yield install
    gen_module._renamable.cache_clear()
    gen_module._public_names_cached.cache_clear()


def test_generator_rejects_authoring_mistakes(fake_template):
    inst = generate(fake_template())
    visible, hidden = "tests/test_a.py::test_inc", f"{HIDDEN_TESTS}::test_plus"
    assert list(inst.FAIL_TO_PASS) == [visible, hidden]
    gen_module._renamable.cache_clear()
    site = Site("plus", "wrong_operator_or_constant", "a.py", "x + TWO", "x - ONE", "inc is off", "inc(5)")
    with pytest.raises(ValueError, match="occurs 0 times"):
        generate(fake_template(sites=(site,)))
    gen_module._renamable.cache_clear()
    site = Site("plus", "wrong_operator_or_constant", "a.py", "x + ONE", "ONE + x", "inc is off", "inc(5)")
    with pytest.raises(ValueError, match="changes none of the site's sessions"):
        generate(fake_template(sites=(site,)))
    gen_module._renamable.cache_clear()
    failing = {"test_a.py": "from @pkg@ import inc\n\n\ndef test_inc():\n    assert inc(1) == 3\n"}
    with pytest.raises(ValueError, match="its own tests fail"):
        generate(fake_template(tests=failing))
    gen_module._renamable.cache_clear()
    site = Site("plus", "wrong_operator_or_constant", "a.py", "x + ONE", "x - ONE", "inc is off", "{inc(5)}")
    with pytest.raises(ValueError, match="not a plain literal"):
        generate(fake_template(sites=(site,)))
    gen_module._renamable.cache_clear()
    twins = (
        Site("plus", "wrong_operator_or_constant", "a.py", "x + ONE", "x - ONE", "inc is off", "inc(5)", ("inc(0)",)),
        Site("plus_2", "off_by_one", "b.py", "ONE = 1", "ONE = 2", "inc is off", "inc(1)"),
    )
    with pytest.raises(ValueError, match="hidden test names clash"):
        generate(fake_template(sites=twins))
    gen_module._renamable.cache_clear()
    with pytest.raises(KeyError, match="unknown marker @WIDTH@"):
        generate(fake_template(modules={**TEMPLATES["fake"].modules, "b.py": "ONE = @WIDTH@\n"}))


# ----------------------------------------------------------------------------------------------------------------
# Running tests and validating instances


def test_local_runner_reports_each_outcome():
    files = {
        "tests/test_x.py": (
            "import time\n\n\n"
            "def test_ok():\n    assert True\n\n\n"
            "def test_bad():\n    assert 1 == 2\n\n\n"
            "def test_setup_error(no_such_fixture):\n    pass\n\n\n"
            "class TestGroup:\n    def test_inner(self):\n        assert True\n"
        ),
        "tests/test_broken.py": "def test_never(:\n",
    }
    nodes = [
        "tests/test_x.py::test_ok",
        "tests/test_x.py::test_bad",
        "tests/test_x.py::test_setup_error",
        "tests/test_x.py::TestGroup::test_inner",
        "tests/test_x.py::test_gone",
        "tests/test_broken.py::test_never",
        "tests/test_nofile.py::test_y",
    ]
    expected = ["passed", "failed", "error", "passed", "missing", "missing", "missing"]
    assert LocalRunner()(files, nodes) == dict(zip(nodes, expected, strict=True))
    slow = {"tests/test_s.py": "import time\n\n\ndef test_sleep():\n    time.sleep(30)\n"}
    assert LocalRunner(timeout_s=2)(slow, ["tests/test_s.py::test_sleep"]) == {"tests/test_s.py::test_sleep": "missing"}


def _spread(instances: dict[str, RepoInstance], per_family: int) -> list[RepoInstance]:
    """A few instances of each family, from as many different templates as possible."""
    picked, used = [], set()
    for family in FAMILIES:
        pool = [i for i in instances.values() if i.family == family]
        for _ in range(per_family):
            inst = next((i for i in pool if i.template not in used), pool[0])
            used.add(inst.template)
            pool.remove(inst)
            picked.append(inst)
    return picked


def _validate_all(insts: list[RepoInstance]) -> list[str]:
    runner = LocalRunner()
    with ThreadPoolExecutor(max_workers=2) as pool:
        reports = list(pool.map(lambda i: validate(i, runner), insts))
    assert [r.instance_id for r in reports] == [i.instance_id for i in insts]
    return [f"{r.instance_id}: {p}" for r in reports for p in r.problems]


def test_a_handful_of_instances_validate(sample):
    picked = [*_spread(sample, per_family=1), sample["repo-wraptext-71"]]
    assert len({i.template for i in picked}) == len(picked)
    assert _validate_all(picked) == []


@pytest.mark.slow
def test_every_instance_has_its_fields_and_an_issue_that_does_not_leak_the_fix(instances):
    """What test_instance_fields and test_problem_statement_does_not_leak_the_fix check on the sample, on all."""
    for iid, inst in instances.items():
        _assert_fields(iid, inst)
        _assert_no_leak(iid, inst)


@pytest.mark.slow
def test_every_bug_site_validates(instances):
    """One instance per bug site of every template (so every (template, family) pair), with a second package
    name or parameter value for the first site of each."""
    picked = [instances[instance_id(n, k)] for n, t in sorted(TEMPLATES.items()) for k in range(len(t.sites))]
    picked += [instances[instance_id(n, len(t.sites))] for n, t in sorted(TEMPLATES.items())]
    assert {(i.template, i.family) for i in picked} == {(n, s.family) for n, t in TEMPLATES.items() for s in t.sites}
    assert _validate_all(picked) == []


def test_validation_catches_a_wrong_instance(sample):
    inst = sample["repo-roman-2"]
    f2p, p2p = inst.FAIL_TO_PASS, inst.PASS_TO_PASS
    wrong = inst.model_copy(update={"patch": "", "FAIL_TO_PASS": p2p[:1], "PASS_TO_PASS": p2p[1:] + f2p})
    report = validate(wrong, LocalRunner())
    assert not report.ok
    assert f"FAIL_TO_PASS {p2p[0]} passed on the base" in report.problems
    assert f"PASS_TO_PASS {f2p[0]} failed on the base" in report.problems
    assert f"{f2p[0]} failed with the gold patch" in report.problems
    module = re.search(r"^diff --git a/(\S+)", inst.patch, re.M)[1]
    edited = "".join(f"{line} \n" for line in inst.repo[module].splitlines())  # every line differs from the patch's
    unapplied = inst.model_copy(update={"repo": {**inst.repo, module: edited}})
    calls = []
    report = validate(unapplied, lambda files, nodes: calls.append(nodes) or dict.fromkeys(nodes, "passed"))
    assert report.problems[0].startswith("patch: ") and calls == []


# ----------------------------------------------------------------------------------------------------------------
# Splits


@pytest.mark.parametrize("by", ["instance", "site"])
def test_splits_hold_out_templates_and_instances_or_sites(by):
    tasks = RepoTasks(seed=0, by=by)
    cells = {(s, t): tasks.ids(s, templates=t) for s in ("train", "test") for t in ("train", "test")}
    assert all(cells.values())
    flat = [iid for ids in cells.values() for iid in ids]
    assert len(flat) == len(set(flat)) and sorted(flat) == sorted(ALL_IDS)  # disjoint, and nothing left out
    train_t, test_t = set(tasks.templates("train")), set(tasks.templates("test"))
    assert not train_t & test_t and train_t | test_t == set(TEMPLATES) and len(test_t) == round(0.2 * len(TEMPLATES))
    for (split, templates), ids in cells.items():
        assert {variant(i).template.name for i in ids} <= (test_t if templates == "test" else train_t)
        assert all(tasks.cell_of(i) == (split, templates) for i in ids)
    sites = {s: {(variant(i).template.name, variant(i).site.id) for i in cells[s, "train"]} for s in ("train", "test")}
    if by == "site":  # a held-out instance's bug site never appears in training, under any package name or constant
        assert not sites["train"] & sites["test"]
    else:  # held out per template, an exact share of its instances; their bug sites recur in training
        for name in train_t:
            held = sum(variant(i).template.name == name for i in cells["test", "train"])
            assert held == max(1, round(0.2 * count(TEMPLATES[name])))
        assert sites["train"] & sites["test"]
    assert {t for t, _ in sites["test"]} == train_t  # every training template holds some out
    # deterministic given the seed; another seed splits otherwise
    assert RepoTasks(seed=0, by=by).ids("test", templates="train") == cells["test", "train"]
    assert RepoTasks(seed=1, by=by).templates("test") != tasks.templates("test")


def test_split_options():
    tasks = RepoTasks(seed=3, families=["missing_case", "off_by_one"])
    ids = tasks.ids("train") + tasks.ids("test")
    assert ids and {variant(i).site.family for i in ids} == {"missing_case", "off_by_one"}
    # choosing families never moves a site across the split
    everything = RepoTasks(seed=3)
    assert set(tasks.ids("test")) == {i for i in everything.ids("test") if i in set(ids)}
    inst = tasks.sample(np.random.default_rng(0), "test")
    assert inst.instance_id in tasks.ids("test") and tasks.get(inst.instance_id) == inst
    assert next(iter(tasks.instances("train", templates="test"))).template in tasks.templates("test")
    for bad in ({"heldout_templates": 0.0}, {"heldout": 1.0}, {"families": ["typo"]}, {"by": "file"}):
        with pytest.raises(ValueError):
            RepoTasks(**bad)


def test_hidden_test_file_is_plain_pytest(sample):
    """The hidden file imports the package and pytest only, and names each test after its site."""
    inst = sample["repo-semver-0"]
    hidden = apply_patch(inst.repo, inst.test_patch)[HIDDEN_TESTS]
    tree = ast.parse(hidden)
    imports = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    assert {getattr(n, "module", None) or n.names[0].name for n in imports} <= {"pytest", "semverlite"}
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {f"test_{s.id}" for s in TEMPLATES["semver"].sites} <= names
    assert Path(HIDDEN_TESTS).name.startswith("test_")


def test_sessions_run_while_other_threads_import():
    """Loading a package for its sessions survives other threads changing sys.modules meanwhile (an env worker's
    reset generated an instance while Ray's threads imported: "dictionary changed size during iteration")."""
    import threading

    from agentrl.tasks.repos import sessions

    files = {"pkg/__init__.py": "from .core import double\n", "pkg/core.py": "def double(x):\n    return 2 * x\n"}
    stop = threading.Event()

    def churn():
        for n in itertools.count():
            if stop.is_set():
                return
            sys.modules[f"_churn_{n % 50}"] = sys  # add and remove entries, as imports elsewhere do
            sys.modules.pop(f"_churn_{(n + 25) % 50}", None)

    thread = threading.Thread(target=churn, daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # hand the GIL over often, so the threads interleave within each load
    thread.start()
    try:
        for _ in range(300):
            outcomes, _ = sessions.run(files, "pkg", ["double(21)"], [])
            assert outcomes[0].value == 42
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
        for n in range(50):
            sys.modules.pop(f"_churn_{n}", None)
    assert not [n for n in sys.modules if n.startswith("_agentrl_repo_")]
