"""The architecture as checked facts: the layers and the absence of import cycles (import-linter contracts
in pyproject.toml), the engine contract respected outside the engine package, what the wheel installs,
and no file pointing outside the repository."""

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parents[1]


def python_files(*folders: str) -> list[Path]:
    return [p for f in folders for p in (ROOT / f).rglob("*.py")]


def test_the_layers_hold_and_no_package_imports_in_a_cycle():
    r = subprocess.run(
        [Path(sys.executable).parent / "lint-imports", "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "2 kept, 0 broken" in r.stdout


def test_nothing_outside_the_engine_package_probes_an_engine():
    """Callers read `engine.capabilities`; hasattr / getattr / isinstance on an engine (any name holding
    "engine" or "eng") belong inside agentrl/engine/ only."""
    probe = re.compile(r"\b(hasattr|getattr|isinstance)\(\s*[\w.]*\beng\w*\b")
    found = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in python_files("agentrl", "benchmarks", "tests", "scripts")
        if not p.is_relative_to(ROOT / "agentrl" / "engine") and p != Path(__file__)
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if probe.search(line)
    ]
    assert not found, "\n".join(found)
    assert probe.search("if hasattr(self.engine, 'paused'):") and probe.search("isinstance(eng, HFEngine)")


DRIVER = [
    "agentrl/train/loop.py",
    "agentrl/train/build.py",
    "agentrl/train/driver.py",
    "agentrl/train/pipeline.py",
    "agentrl/train/weight_sync.py",
    "agentrl/cli",
    "agentrl/eval",
    "agentrl/rollout",
]
"""the one process that runs the loop: its modules know no rank (docs/design.md §3)"""


def uses_torch_distributed(path: Path) -> list[int]:
    """The lines of `path` that import torch.distributed or name it."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            hit = any(a.name.startswith("torch.distributed") for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            hit = module.startswith("torch.distributed") or (
                module == "torch" and any(a.name == "distributed" for a in node.names)
            )
        else:
            hit = isinstance(node, ast.Attribute) and node.attr == "distributed"
        if hit:
            lines.append(node.lineno)
    return lines


def test_the_driver_never_calls_torch_distributed():
    """The loop, its setup, the pipeline, weight sync, the command line, evaluation and rollouts leave ranks to the
    learner (agentrl/train/learner.py and the learners beside it), which alone use torch.distributed."""
    driver = [p for d in DRIVER for p in ((ROOT / d).rglob("*.py") if (ROOT / d).is_dir() else [ROOT / d])]
    assert len(driver) > 20
    found = [f"{p.relative_to(ROOT)}:{n}" for p in driver for n in uses_torch_distributed(p)]
    assert not found, found
    learners = ["learner.py", "torchrun_learner.py", "ray_learner.py", "trainer.py", "checkpoint.py", "policy.py"]
    assert all(uses_torch_distributed(ROOT / "agentrl" / "train" / name) for name in learners)


def test_the_wheel_installs_only_the_agentrl_package(tmp_path):
    """Built-in envs live under agentrl/ (agentrl.envs): no top-level `envs` (or anything else) is installed."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("agentrl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {
        "agentrl",
        f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info",
    }
    assert "agentrl/envs/code_sandbox.py" in names and "agentrl/_configs/code_sandbox.yaml" in names


def test_no_file_of_the_project_points_outside_it():
    """Code, tests and docs cite docs/design.md; a file a user of the project cannot open is never cited."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    outside = re.compile(r"(?<!docs/)\bDESIGN\.md|\.\./shared|STYLE\.md")
    found = [
        f"{name}:{n}"
        for name in tracked.splitlines()
        if name.endswith((".py", ".md", ".toml", ".yaml", ".sh"))
        and name != "tests/test_layers.py"
        and (ROOT / name).exists()
        for n, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1)
        if outside.search(line)
    ]
    assert not found, found
