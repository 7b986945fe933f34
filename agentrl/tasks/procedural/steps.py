"""What every family builds its tasks from: steps, conditions, programs and pipelines.

A step is one primitive with random parameters, said three ways (an English sentence, a Python
expression of `{v}`, a callable), with the wrong functions a statement must rule out: ablations
(part of the step left out) and near misses (plausible misreadings, also as code). A program is
the function a task asks for; `_pipeline` chains steps into one.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_Fn = Callable[[Any], Any]

_RANDOM_INPUTS = 24
"""random inputs drawn per draft, besides the edge cases"""


@dataclass(frozen=True)
class _Step:
    """One operation of a pipeline."""

    text: str
    """an English sentence, e.g. `Reverse it.`"""
    code: str
    """the same operation as a Python expression of the variable `{v}`"""
    fn: _Fn
    """the same operation as a callable"""
    ablations: tuple[_Fn, ...] = ()
    """simpler operations the statement rules out (one half of `even and positive`); some input must tell them apart"""
    near_misses: tuple[_Fn, ...] = ()
    """plausible misreadings; hidden cases tell them apart where some input can"""
    misreadings: tuple[str, ...] = ()
    """the near misses as code of `{v}`, in the same order (a sloppy demonstrator writes these)"""

    def __post_init__(self) -> None:
        assert len(self.misreadings) in (0, len(self.near_misses)), f"{self.text}: misreadings and near misses differ"


@dataclass(frozen=True)
class _Pred:
    """A condition on an integer, said three ways as a _Step is."""

    text: str
    """e.g. `even and greater than 3`"""
    code: str
    """a Python condition on the variable `{x}`"""
    fn: Callable[[int], bool]
    ablations: tuple[Callable[[int], bool], ...] = ()
    near_misses: tuple[Callable[[int], bool], ...] = ()
    misreadings: tuple[str, ...] = ()
    """the near misses as conditions on `{x}`, in the same order"""

    def on(self, var: str) -> str:
        return self.code.replace("{x}", var)


def _pred_step(text: str, code: str, make: Callable[[Callable[[int], bool]], _Fn], p: _Pred) -> _Step:
    """A step built around a condition; the condition's wrong readings become the step's."""
    return _Step(
        text.replace("{p}", p.text),
        code.replace("{p}", p.on("x")),
        make(p.fn),
        tuple(make(a) for a in p.ablations),
        tuple(make(m) for m in p.near_misses),
        tuple(code.replace("{p}", m.replace("{x}", "x")) for m in p.misreadings),
    )


@dataclass(frozen=True)
class _Program:
    """A function to write: its statement, reference source, and the right and wrong callables."""

    signature: str
    """e.g. `transform(s: str) -> str`"""
    statement: str
    body: tuple[str, ...]
    """the reference solution's body, one line each"""
    fn: _Fn
    """the right function, called with the case's arguments"""
    ablations: tuple[_Fn, ...]
    """statement parts left out: a draft is redrawn unless some input tells each apart"""
    near_misses: tuple[_Fn, ...]
    misread_bodies: tuple[tuple[tuple[str, ...], ...], ...] = ()
    """per step, the body lines it can be written as: first the right one, then its misreadings"""

    @property
    def entry_point(self) -> str:
        return self.signature.split("(")[0]

    def source(self, body: Sequence[str] | None = None) -> str:
        return f"def {self.signature}:\n" + "".join(f"    {line}\n" for line in body or self.body)

    def misread_sources(self) -> list[str]:
        """One source per near miss, in `near_misses` order: one step misread, the rest right."""
        right = [lines[0] for lines in self.misread_bodies]
        return [
            self.source([*right[:i], wrong, *right[i + 1 :]])
            for i, lines in enumerate(self.misread_bodies)
            for wrong in lines[1:]
        ]

    def sloppy_source(self, rng: random.Random, misread: float) -> str:
        """As a sloppy reader writes it: each step that can be misread is, with probability `misread`."""
        return self.source(
            [
                rng.choice(lines[1:]) if len(lines) > 1 and rng.random() < misread else lines[0]
                for lines in self.misread_bodies
            ]
        )

    def starter(self) -> str:
        doc = "\n    ".join(self.statement.splitlines())
        return f'def {self.signature}:\n    """{doc}\n    """\n'


def _signed(c: int) -> str:
    """` + c` or ` - |c|`, to append to an expression."""
    return f" + {c}" if c >= 0 else f" - {-c}"


def _add_text(c: int, what: str = "it") -> str:
    return f"add {c} to {what}" if c > 0 else f"subtract {-c} from {what}"


# ---- conditions on integers ----


def _atom(r: random.Random) -> _Pred:
    t = r.randint(-5, 10)
    k = r.randint(3, 5)
    return r.choice(
        [
            _Pred("even", "{x} % 2 == 0", lambda x: x % 2 == 0),
            _Pred("odd", "{x} % 2 == 1", lambda x: x % 2 == 1),
            _Pred("positive", "{x} > 0", lambda x: x > 0, near_misses=(lambda x: x >= 0,), misreadings=("{x} >= 0",)),
            _Pred("negative", "{x} < 0", lambda x: x < 0, near_misses=(lambda x: x <= 0,), misreadings=("{x} <= 0",)),
            _Pred(
                f"greater than {t}",
                f"{{x}} > {t}",
                lambda x: x > t,
                near_misses=(lambda x: x >= t,),
                misreadings=(f"{{x}} >= {t}",),
            ),
            _Pred(
                f"less than {t}",
                f"{{x}} < {t}",
                lambda x: x < t,
                near_misses=(lambda x: x <= t,),
                misreadings=(f"{{x}} <= {t}",),
            ),
            _Pred(
                f"at least {t}",
                f"{{x}} >= {t}",
                lambda x: x >= t,
                near_misses=(lambda x: x > t,),
                misreadings=(f"{{x}} > {t}",),
            ),
            _Pred(f"divisible by {k}", f"{{x}} % {k} == 0", lambda x: x % k == 0),
        ]
    )


def _compound(r: random.Random) -> _Pred:
    """`a and b` or `a or b`; each half alone must be told apart from the whole."""
    a, b = _atom(r), _atom(r)
    if r.random() < 0.5:
        return _Pred(
            f"{a.text} and {b.text}",
            f"{a.code} and {b.code}",
            lambda x: a.fn(x) and b.fn(x),
            ablations=(a.fn, b.fn),
            near_misses=(lambda x: a.fn(x) or b.fn(x),),
            misreadings=(f"{a.code} or {b.code}",),
        )
    return _Pred(
        f"{a.text} or {b.text}",
        f"{a.code} or {b.code}",
        lambda x: a.fn(x) or b.fn(x),
        ablations=(a.fn, b.fn),
        near_misses=(lambda x: a.fn(x) and b.fn(x),),
        misreadings=(f"{a.code} and {b.code}",),
    )


# ---- steps that strings and lists share ----


def _rotate(xs: Any, k: int) -> Any:
    """xs rotated left by k (right when k < 0); works on strings and lists."""
    if not xs:
        return xs
    k %= len(xs)
    return xs[k:] + xs[:k]


def _rotation(r: random.Random, noun: str, container: str) -> _Step:
    """Rotate left or right by k; strings and lists rotate alike."""
    k = r.randint(1, 4)
    times = "once" if k == 1 else f"{k} times"
    keep = f"(an empty {container} stays empty)"
    left = f"{{v}}[{k} % len({{v}}):] + {{v}}[:{k} % len({{v}})] if {{v}} else {{v}}"
    right = f"{{v}}[len({{v}}) - {k} % len({{v}}):] + {{v}}[:len({{v}}) - {k} % len({{v}})] if {{v}} else {{v}}"
    if r.random() < 0.5:
        return _Step(
            f"Rotate it left by {k}: move its first {noun} to the end, {times} {keep}.",
            left,
            lambda xs: _rotate(xs, k),
            near_misses=(lambda xs: _rotate(xs, -k), lambda xs: xs[k:] + xs[:k]),
            misreadings=(right, f"{{v}}[{k}:] + {{v}}[:{k}]"),
        )
    return _Step(
        f"Rotate it right by {k}: move its last {noun} to the front, {times} {keep}.",
        right,
        lambda xs: _rotate(xs, -k),
        near_misses=(lambda xs: _rotate(xs, k), lambda xs: xs[-k:] + xs[:-k]),
        misreadings=(left, f"{{v}}[-{k}:] + {{v}}[:-{k}]"),
    )


def _slice(r: random.Random, noun: str) -> _Step:
    """Keep or delete a prefix or suffix; strings and lists slice alike."""
    k = r.randint(1, 4)
    part = noun if k == 1 else f"{k} {noun}s"
    return r.choice(
        [
            _Step(f"Keep only its first {part} (all of them if it is shorter).", f"{{v}}[:{k}]", lambda xs: xs[:k]),
            _Step(f"Keep only its last {part} (all of them if it is shorter).", f"{{v}}[-{k}:]", lambda xs: xs[-k:]),
            _Step(f"Delete its first {part} (all of them if it is shorter).", f"{{v}}[{k}:]", lambda xs: xs[k:]),
        ]
    )


# ---- pipelines ----


def _pipeline(signature: str, var: str, what: str, steps: Sequence[_Step]) -> _Program:
    """Steps applied in order; the last one's value is returned. `what` ends the statement's first line."""

    def chain(fns: Sequence[_Fn]) -> _Fn:
        return lambda x: functools.reduce(lambda acc, f: f(acc), fns, x)

    fns = [s.fn for s in steps]
    swapped = [(i, alt) for i, s in enumerate(steps) for alt in s.ablations]
    ablations = [chain(fns[:i] + fns[i + 1 :]) for i in range(len(fns))]  # one step left out
    ablations += [chain([*fns[:i], alt, *fns[i + 1 :]]) for i, alt in swapped]
    if len(steps) > 1:
        ablations.append(chain([]))  # steps that together undo each other
    near_misses = [chain([*fns[:i], m, *fns[i + 1 :]]) for i, s in enumerate(steps) for m in s.near_misses]

    def line(k: int, code: str) -> str:
        return f"return {code.replace('{v}', var)}" if k == len(steps) - 1 else f"{var} = {code.replace('{v}', var)}"

    variants = tuple(tuple(line(k, c) for c in (s.code, *s.misreadings)) for k, s in enumerate(steps))
    intro = "Apply this step" if len(steps) == 1 else "Apply these steps in order"
    return _Program(
        signature=signature,
        statement=f"{intro} {what}:\n" + "\n".join(f"{i}. {s.text}" for i, s in enumerate(steps, 1)),
        body=tuple(v[0] for v in variants),
        fn=chain(fns),
        ablations=tuple(ablations),
        near_misses=tuple(near_misses),
        misread_bodies=variants if all(len(s.misreadings) == len(s.near_misses) for s in steps) else (),
    )
