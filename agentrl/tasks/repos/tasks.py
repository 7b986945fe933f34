"""The generated instances as a task set, split two ways: by template and, within a template, by bug site.

`RepoTasks.ids(split, templates=...)` names one of four disjoint cells:

| | `templates="train"` | `templates="test"` |
|---|---|---|
| `split="train"` | what training sees | (for adapting to a new template, if wanted) |
| `split="test"` | held-out instances of training templates | held-out instances of held-out templates |

A held-out instance is held out by its bug site: no instance with the same planted bug (under any package
name or constant) is on the other side, so a fix cannot be remembered, only found. Held-out templates are
never seen in training at all; evaluate on both `split="train"` and `split="test"` of them for all of it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import numpy as np

from agentrl.tasks.base import Split
from agentrl.tasks.repos.generate import count, generate, instance_id, variant
from agentrl.tasks.repos.instance import RepoInstance
from agentrl.tasks.repos.template import FAMILIES, Family
from agentrl.tasks.repos.templates import TEMPLATES


def _rank(seed: int, key: str) -> bytes:
    return hashlib.sha256(f"{seed}:{key}".encode()).digest()


def _held_out(keys: Sequence[str], seed: int, fraction: float) -> set[str]:
    """The round(fraction * len(keys)) keys (at least one) that rank first under the seed's hash: an exact
    share, so even a template with five sites holds some out, and a key's side depends on the seed and its
    peers only, never on the order they come in."""
    k = max(1, round(fraction * len(keys)))
    return set(sorted(keys, key=lambda key: _rank(seed, key))[:k])


class RepoTasks:
    """Generated `repo_fix` instances (`agentrl.tasks.repos.generate`), split by template and by bug site.

    Finite: every id of every template is in exactly one cell, listed in template, then number, order.
    `families` keeps the instances of those bug families only.
    """

    name = "repos"
    description = "a planted bug in a small generated Python repository, graded by hidden pytest tests"

    def __init__(
        self,
        *,
        seed: int = 0,
        heldout_templates: float = 0.2,
        heldout_sites: float = 0.2,
        families: Sequence[Family] | None = None,
    ):
        for what, fraction in (("heldout_templates", heldout_templates), ("heldout_sites", heldout_sites)):
            if not 0.0 < fraction < 1.0:
                raise ValueError(f"{what} must be in (0, 1), got {fraction}")
        unknown = sorted(set(families or ()) - set(FAMILIES))
        if unknown:
            raise ValueError(f"unknown bug families {unknown}; choose among {list(FAMILIES)}")
        self.seed = seed
        self.families = tuple(families) if families else FAMILIES
        self._test_templates = _held_out(sorted(TEMPLATES), seed, heldout_templates)
        # Sites are split over all of a template's sites before the family filter, so that choosing families
        # never moves a site from one side to the other.
        self._test_sites = {
            name: _held_out([s.id for s in t.sites], seed, heldout_sites) for name, t in TEMPLATES.items()
        }
        self._cells: dict[tuple[Split, Split], list[str]] = {}

    def templates(self, split: Split) -> list[str]:
        """The template names on one side of the template split."""
        return sorted(n for n in TEMPLATES if (n in self._test_templates) == (split == "test"))

    def ids(self, split: Split = "train", *, templates: Split = "train") -> list[str]:
        """The instance ids of one cell: `split` picks the side of the site split, `templates` the side of the
        template split."""
        if (split, templates) not in self._cells:
            self._cells[split, templates] = [
                instance_id(name, n)
                for name in self.templates(templates)
                for n in range(count(TEMPLATES[name]))
                if self._keeps(instance_id(name, n), split)
            ]
        return self._cells[split, templates]

    def _keeps(self, iid: str, split: Split) -> bool:
        site = variant(iid).site
        return site.family in self.families and self.cell_of(iid)[0] == split

    def instances(self, split: Split = "train", *, templates: Split = "train") -> Iterator[RepoInstance]:
        for iid in self.ids(split, templates=templates):
            yield generate(iid)

    def sample(self, rng: np.random.Generator, split: Split = "train", *, templates: Split = "train") -> RepoInstance:
        """An instance of one cell, drawn with the caller's generator."""
        ids = self.ids(split, templates=templates)
        return generate(ids[int(rng.integers(len(ids)))])

    def get(self, iid: str) -> RepoInstance:
        """Any generated instance by id, whatever its cell; ValueError for an id that names none."""
        return generate(iid)

    def cell_of(self, iid: str) -> tuple[Split, Split]:
        """(split, templates) of an instance id."""
        v = variant(iid)
        return (
            "test" if v.site.id in self._test_sites[v.template.name] else "train",
            "test" if v.template.name in self._test_templates else "train",
        )
