"""Repository instances as task sets, for the `repo_fix` env: generated ones (`repos`) and loaded ones
(`swebench:PATH`, `agentrl.tasks.repos.swebench`).

A task carries what every episode needs to know up front (the issue as its prompt, the test node ids as its
`RepoTests`); the repository, the hidden test files and the known fix stay with the set, which hands them out
by id (`instance`), so tasks stay small where they travel (an env worker rebuilds or reloads its own).
"""

from __future__ import annotations

import abc
import functools
import hashlib
from collections.abc import Iterator, Sequence

import numpy as np

from agentrl.tasks.base import RepoTests, Split, Task, TaskSet, check_split, in_test_split
from agentrl.tasks.repos.generate import generate, spelling
from agentrl.tasks.repos.instance import RepoInstance
from agentrl.tasks.repos.tasks import RepoTasks


def repo_task(instance: RepoInstance) -> Task:
    """The task of an instance: its issue, and the tests that grade it (node ids only)."""
    metadata = {"base_commit": instance.base_commit}
    metadata |= {k: v for k, v in (("template", instance.template), ("family", instance.family)) if v is not None}
    return Task(
        id=instance.instance_id,
        prompt=instance.problem_statement,
        tests=RepoTests(FAIL_TO_PASS=instance.FAIL_TO_PASS, PASS_TO_PASS=instance.PASS_TO_PASS),
        metadata=metadata,
    )


class RepoTaskSet(TaskSet):
    """A task set of repository instances. `instance(task_id)` is the whole instance (KeyError when there is none);
    the reference solution of a task is its instance's gold patch."""

    @abc.abstractmethod
    def ids(self) -> Sequence[str]:
        """The instance ids of this set, in its iteration order."""

    @abc.abstractmethod
    def instance(self, task_id: str) -> RepoInstance: ...

    def __iter__(self) -> Iterator[Task]:
        return (repo_task(self.instance(i)) for i in self.ids())

    def __len__(self) -> int:
        return len(self.ids())

    def sample(self, rng: np.random.Generator) -> Task:
        ids = self.ids()
        return repo_task(self.instance(ids[int(rng.integers(len(ids)))]))

    def get(self, task_id: str) -> Task:
        return repo_task(self.instance(task_id))

    def reference_solution(self, task: Task) -> str:
        return self.instance(task.id).patch


def _mixed(ids: Sequence[str]) -> list[str]:
    """A fixed order that interleaves templates: "the first N" of a set spans its templates."""
    return sorted(ids, key=lambda i: hashlib.sha256(i.encode()).digest())


def in_part(task_id: str, part: tuple[int, int]) -> bool:
    """Whether an id is in part k of n (1 <= k <= n): disjoint parts by a hash of the id, so about equal and the
    same whatever set the id is listed in."""
    k, n = part
    return int.from_bytes(hashlib.sha256(f"part:{task_id}".encode()).digest()[:8], "big") % n == k - 1


class GeneratedRepos(RepoTaskSet):
    """The generated instances (`RepoTasks`) of one side of the template split: both instance sides, or one after
    `split`. Iterated in a fixed order that mixes the templates.

    `part=(k, n)` keeps part k of n of the training instances (`in_part`) and all the held-out ones: demonstrations
    for SFT from one part and RL on another, so that RL samples instances the starting policy has not memorised,
    both evaluated on the same held-out instances. `spellings=k` lists each training instance with its spellings
    1 .. k-1 (`generate.spelling`): SFT data where a bug's paths and names differ from one demonstration to the
    next, so that only reading them off the observations fits it. Held-out instances stay as they are.
    `within`: only these ids (what a split keeps of the set it splits)."""

    name = "repos"
    description = "a planted bug in a small generated Python repository, graded by hidden pytest tests"

    def __init__(
        self,
        catalogue: RepoTasks | None = None,
        *,
        templates: Split = "train",
        split: Split | None = None,
        part: tuple[int, int] | None = None,
        spellings: int = 1,
        within: frozenset[str] | None = None,
    ):
        if part is not None and not 1 <= part[0] <= part[1]:
            raise ValueError(f"part k of n needs 1 <= k <= n, got {part[0]}/{part[1]}")
        if spellings < 1:
            raise ValueError(f"spellings must be at least 1, got {spellings}")
        self.catalogue = catalogue or RepoTasks()
        self.templates, self.side, self.part, self.spellings = templates, split, part, spellings
        sides: tuple[Split, ...] = (split,) if split else ("train", "test")
        self._ids = _mixed(
            [
                j
                for s in sides
                for i in self.catalogue.ids(s, templates=templates)
                if part is None or s == "test" or in_part(i, part)
                for j in (spelling(i, k) for k in range(spellings if s == "train" else 1))
                if within is None or j in within
            ]
        )
        if not self._ids:
            raise ValueError(f"no generated repository instances in this cell (templates={templates}, split={split})")
        self._known = frozenset(self._ids)

    def ids(self) -> Sequence[str]:
        return self._ids

    def instance(self, task_id: str) -> RepoInstance:
        if task_id not in self._known:
            raise KeyError(f"{task_id!r} is not an instance of {self.name} (templates={self.templates}, {self.side})")
        return _generated(task_id)

    def split(self, split: Split, *, seed: int = 0, test_fraction: float = 0.2) -> GeneratedRepos:
        """The instances on one side of a split by `seed`. The seed splits instances, not templates: the held-out
        templates stay this set's, so `repos:templates=test` is never trained on whatever the seed; and a split of a
        split stays inside it."""
        check_split(split, test_fraction)
        c = self.catalogue
        catalogue = RepoTasks(
            seed=seed,
            heldout_templates=c.heldout_templates,
            heldout=test_fraction,
            by=c.by,
            families=c.families,
            template_seed=c.template_seed,
        )
        return GeneratedRepos(
            catalogue,
            templates=self.templates,
            split=split,
            part=self.part,
            spellings=self.spellings,
            # an unsplit set is its spec's, split anew by each seed (its part k too); a split is kept inside
            within=self._known if self.side else None,
        )


@functools.lru_cache(maxsize=1024)
def _generated(task_id: str) -> RepoInstance:
    return generate(task_id)


class LoadedRepos(RepoTaskSet):
    """Instances held in memory (a loaded file), split by a seeded hash of their ids."""

    def __init__(self, instances: Sequence[RepoInstance], *, name: str, description: str):
        if not instances:
            raise ValueError(f"task set {name!r} is empty")
        self._by_id = {i.instance_id: i for i in instances}
        if len(self._by_id) != len(instances):
            raise ValueError(f"task set {name!r}: duplicate instance ids")
        self.name, self.description = name, description

    def ids(self) -> Sequence[str]:
        return list(self._by_id)

    def instance(self, task_id: str) -> RepoInstance:
        return self._by_id[task_id]

    def split(self, split: Split, *, seed: int = 0, test_fraction: float = 0.2) -> LoadedRepos:
        check_split(split, test_fraction)
        part = [
            i for i in self._by_id.values() if in_test_split(i.instance_id, seed, test_fraction) == (split == "test")
        ]
        return LoadedRepos(part, name=f"{self.name}[{split}]", description=self.description)
