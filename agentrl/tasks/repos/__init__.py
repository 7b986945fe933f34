"""Repository-level tasks (SWE-bench style): a planted bug in a small Python repository, an issue that shows
the symptom, a gold patch, and hidden tests that grade a fix.

- `instance`: `RepoInstance` (SWE-bench's fields), `apply_patch` and `make_patch`;
- `template` and `templates/`: the repository templates and the bug sites each declares;
- `generate`: `generate(instance_id)`, deterministic per id (`repo-<template>-<n>`);
- `names`: the per-instance spelling of a package's names (an alpha-renaming with synonyms);
- `validate`: `validate(instance, runner)`, with `LocalRunner` (pytest in a temporary folder);
- `tasks`: `RepoTasks`, the instances split by template and by bug site.
"""

from agentrl.tasks.repos.generate import HIDDEN_TESTS, count, generate, instance_id
from agentrl.tasks.repos.instance import PatchError, RepoInstance, apply_patch, content_hash, make_patch
from agentrl.tasks.repos.tasks import RepoTasks
from agentrl.tasks.repos.template import FAMILIES, Family, Site, Template
from agentrl.tasks.repos.templates import TEMPLATES
from agentrl.tasks.repos.validate import LocalRunner, Runner, TestOutcome, ValidationReport, validate

__all__ = [
    "FAMILIES",
    "HIDDEN_TESTS",
    "TEMPLATES",
    "Family",
    "LocalRunner",
    "PatchError",
    "RepoInstance",
    "RepoTasks",
    "Runner",
    "Site",
    "Template",
    "TestOutcome",
    "ValidationReport",
    "apply_patch",
    "content_hash",
    "count",
    "generate",
    "instance_id",
    "make_patch",
    "validate",
]
