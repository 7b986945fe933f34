"""Unbounded task sets whose tasks are generated from their ids.

A generated task is named `{name}/{family}/{level}/{n}` and built from a `random.Random`
seeded with a SHA-256 of that id, so any process regenerates the same task from its id alone:
no task list is stored, and `get` works for any n. (Python's `hash()` is salted per process,
and numpy's `Generator` streams may change between numpy versions; `random.Random` seeded
with an int is stable.)
"""

from __future__ import annotations

import abc
import copy
import hashlib
import itertools
import random
import re
from collections.abc import Iterator, Sequence
from typing import ClassVar, Self

import numpy as np

from agentrl.tasks.base import Split, Task, TaskSet, check_split, in_test_split

N_RANGE = 2**31
"""`sample` draws task numbers n below this"""


def task_rng(name: str, family: str, level: int, n: int) -> random.Random:
    """The generator that builds task `{name}/{family}/{level}/{n}`."""
    digest = hashlib.sha256(f"{name}/{family}/{level}/{n}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _restrict(what: str, chosen: Sequence | None, valid: tuple) -> tuple:
    """The chosen subset of `valid` (all of it for None), deduplicated; ValueError naming the valid values."""
    if chosen is None:
        return valid
    if not chosen:
        raise ValueError(f"no {what} chosen; choose among {list(valid)}")
    unknown = [c for c in chosen if c not in valid]
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; choose among {list(valid)}")
    return tuple(dict.fromkeys(chosen))


class GeneratedTaskSet(TaskSet):
    """Tasks generated from (family, level, n); unbounded, so it has no `len`.

    Set these in ALL subclasses, besides `name` and `description`: `FAMILIES`, and `_build`,
    which makes a task from its id and generator. A split keeps a task on its side iff
    `in_test_split(self.split_key(task), seed, test_fraction)` says so; `sample` and `__iter__`
    skip (and draw again past) tasks of the other side, so a test task never reaches training,
    even when two ids give the same content. Expect 1 / fraction draws per task of a side.
    """

    FAMILIES: ClassVar[tuple[str, ...]]
    LEVELS: ClassVar[tuple[int, ...]] = (1, 2, 3)

    def __init__(self, *, families: Sequence[str] | None = None, levels: Sequence[int] | None = None):
        self.families: tuple[str, ...] = _restrict("families", families, self.FAMILIES)
        self.levels: tuple[int, ...] = _restrict("levels", levels, self.LEVELS)
        self._sides: tuple[tuple[Split, int, float], ...] = ()
        """(split, seed, test_fraction) of every split applied, so a split of a split stays inside it"""

    @abc.abstractmethod
    def _build(self, task_id: str, family: str, level: int, rng: random.Random) -> Task:
        """Task `task_id`, drawing everything random from `rng` (and nothing from anywhere else)."""

    @classmethod
    def _parse(cls, task_id: str) -> tuple[str, int, int]:
        """(family, level, n) of a task id; KeyError when it is not one of this set's ids."""
        # ASCII digits without leading zeros: one task, one id (`\d` alone takes "1٣" for 13).
        m = re.fullmatch(rf"{re.escape(cls.name)}/(\w+)/(0|[1-9]\d*)/(0|[1-9]\d*)", task_id, re.ASCII)
        if m is None or m[1] not in cls.FAMILIES or int(m[2]) not in cls.LEVELS:
            raise KeyError(task_id)
        return m[1], int(m[2]), int(m[3])

    def generate(self, family: str, level: int, n: int) -> Task:
        """Task number n (any int >= 0) of a family and level; ignores this set's restrictions and split."""
        if family not in self.FAMILIES or level not in self.LEVELS or n < 0:
            raise ValueError(f"no task ({family!r}, {level}, {n}): families {self.FAMILIES}, levels {self.LEVELS}")
        # The class name, not `self.name`, which a split decorates.
        name = type(self).name
        return self._build(f"{name}/{family}/{level}/{n}", family, level, task_rng(name, family, level, n))

    def split_key(self, task: Task) -> str:
        """What decides a task's side: its content. Subclasses may key on less (the problem without its inputs)."""
        return task.content_hash()

    def _keeps(self, task: Task) -> bool:
        key = self.split_key(task)
        return all(in_test_split(key, seed, fraction) == (side == "test") for side, seed, fraction in self._sides)

    def __iter__(self) -> Iterator[Task]:
        """Forever: n = 0, 1, 2, ..., and for each n every (family, level) in turn."""
        for n in itertools.count():
            for family, level in itertools.product(self.families, self.levels):
                task = self.generate(family, level, n)
                if self._keeps(task):
                    yield task

    def sample(self, rng: np.random.Generator) -> Task:
        while True:
            family = self.families[int(rng.integers(len(self.families)))]
            level = self.levels[int(rng.integers(len(self.levels)))]
            task = self.generate(family, level, int(rng.integers(N_RANGE)))
            if self._keeps(task):
                return task

    def get(self, task_id: str) -> Task:
        family, level, n = self._parse(task_id)
        if family not in self.families or level not in self.levels:
            raise KeyError(f"{task_id!r}: this set has families {self.families}, levels {self.levels}")
        task = self.generate(family, level, n)
        if not self._keeps(task):
            raise KeyError(f"{task_id!r} is on the other side of this set's split")
        return task

    def split(self, split: Split, *, seed: int = 0, test_fraction: float = 0.2) -> Self:
        check_split(split, test_fraction)
        sides = (*self._sides, (split, seed, test_fraction))
        # per seed, a task keeps every side when its hash is at or above each train side's fraction and below each
        # test side's: sides that leave no such hash keep no task (and `sample` would draw forever)
        train = max((f for sp, sd, f in sides if sd == seed and sp == "train"), default=0.0)
        test = min((f for sp, sd, f in sides if sd == seed and sp == "test"), default=1.0)
        if train >= test:
            raise ValueError(
                f"task set {self.name!r}: its {split} side at seed {seed} (test fraction {test_fraction}) holds no "
                "task, as an earlier split at that seed kept only the other side: split with another seed"
            )
        part = copy.copy(self)
        part._sides = sides
        part.name = f"{self.name}[{split}]"
        return part
