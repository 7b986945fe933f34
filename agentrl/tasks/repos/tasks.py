"""The generated instances as a task set, split two ways: by template and, within a template, by instance.

`RepoTasks.ids(split, templates=...)` names one of four disjoint cells:

| | `templates="train"` | `templates="test"` |
|---|---|---|
| `split="train"` | what training sees | (for adapting to a new template, if wanted) |
| `split="test"` | held-out instances of training templates | held-out instances of held-out templates |

`by` says what a held-out instance is held out by:
- `instance` (the default): the instance itself. The same planted bug may be in training under another package
  name or constants, as a project's recurring kinds of bugs are: a held-out instance is a new repository of a
  known kind, and the agent must still find the file, make the edit and check it there;
- `site`: its bug site. No instance with the same planted bug is on the other side, so a fix cannot be
  remembered, only found.

Held-out templates are never seen in training at all: their instances, of either side, are all new.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Literal

import numpy as np

from agentrl.tasks.base import Split
from agentrl.tasks.repos.generate import base_id, count, generate, instance_id, variant
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
    """Generated `repo_fix` instances (`agentrl.tasks.repos.generate`), split by template and by instance (or bug
    site: `by`).

    Finite: every id of every template is in exactly one cell, listed in template, then number, order.
    `families` keeps the instances of those bug families only. `template_seed` (default: `seed`) seeds the template
    split alone, so that the instances can be split again while the held-out templates stay those of the spec.
    """

    name = "repos"
    description = "a planted bug in a small generated Python repository, graded by hidden pytest tests"

    def __init__(
        self,
        *,
        seed: int = 0,
        heldout_templates: float = 0.2,
        heldout: float = 0.2,
        by: Literal["instance", "site"] = "instance",
        families: Sequence[Family] | None = None,
        template_seed: int | None = None,
    ):
        if by not in ("instance", "site"):
            raise ValueError(f"by must be instance or site, got {by!r}")
        for what, fraction in (("heldout_templates", heldout_templates), ("heldout", heldout)):
            if not 0.0 < fraction < 1.0:
                raise ValueError(f"{what} must be in (0, 1), got {fraction}")
        unknown = sorted(set(families or ()) - set(FAMILIES))
        if unknown:
            raise ValueError(f"unknown bug families {unknown}; choose among {list(FAMILIES)}")
        self.seed, self.by, self.heldout, self.heldout_templates = seed, by, heldout, heldout_templates
        self.template_seed = seed if template_seed is None else template_seed
        self.families = tuple(families) if families else FAMILIES
        self._test_templates = _held_out(sorted(TEMPLATES), self.template_seed, heldout_templates)
        # Held out per template, over all of its instances (or sites) before the family filter, so that choosing
        # families never moves an instance from one side to the other.
        if by == "site":
            self._held = {name: _held_out([s.id for s in t.sites], seed, heldout) for name, t in TEMPLATES.items()}
        else:
            self._held = {
                name: _held_out([instance_id(name, n) for n in range(count(t))], seed, heldout)
                for name, t in TEMPLATES.items()
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
        """(split, templates) of an instance id; a spelling's are its instance's."""
        v = variant(iid)
        return (
            "test" if (v.site.id if self.by == "site" else base_id(iid)) in self._held[v.template.name] else "train",
            "test" if v.template.name in self._test_templates else "train",
        )
