"""A grade book: scores read from text, averages and medians, letter grades, ranking and a report."""

from agentrl.tasks.repos.template import Site, Template

TEMPLATE = Template(
    name="gradebook",
    about="a grade book library",
    packages=("gradebook", "marks", "classroom"),
    params={"A": ("90", "93")},
    modules={
        "__init__.py": r'''"""Scores, averages and letter grades."""

from .book import GradeBook
from .grades import letter
from .report import report
from .stats import average, median
''',
        "scores.py": r'''"""Scores as text: one `name: score, score, ...` line per student."""


def parse_scores(text):
    """{name: [scores]} of `text`; blank lines are skipped."""
    book = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        name, _, rest = line.partition(":")
        book[name.strip()] = [float(s) for s in rest.split(",") if s.strip()]
    return book
''',
        "stats.py": r'''"""Statistics of score lists."""


def average(scores, drop_lowest=0):
    """The mean after dropping the `drop_lowest` lowest scores; 0.0 when none are left."""
    kept = sorted(scores)[drop_lowest:]
    if not kept:
        return 0.0
    return sum(kept) / len(kept)


def median(scores):
    ordered = sorted(scores)
    n = len(ordered)
    if n == 0:
        raise ValueError("no scores")
    mid = n // 2
    if n % 2:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2
''',
        "grades.py": r'''"""Letter grades."""

CUTOFFS = ((@A@, "A"), (80, "B"), (70, "C"), (60, "D"))


def letter(score):
    """The letter of `score` (0-100): the first cutoff it reaches, else F."""
    for cutoff, grade in CUTOFFS:
        if score >= cutoff:
            return grade
    return "F"
''',
        "book.py": r'''"""A grade book."""

from .grades import letter
from .scores import parse_scores
from .stats import average, median


class GradeBook:
    def __init__(self, text, drop_lowest=0):
        self.scores = parse_scores(text)
        self.drop_lowest = drop_lowest

    def average(self, name):
        return average(self.scores[name], self.drop_lowest)

    def grade(self, name):
        return letter(self.average(name))

    def class_median(self):
        return median([self.average(n) for n in self.scores])

    def ranking(self):
        """Names by average, best first; ties by name."""
        return sorted(self.scores, key=lambda n: (-self.average(n), n))
''',
        "report.py": r'''"""A printable report."""


def report(book):
    """One `name: average grade` line per student, best first; averages to one decimal."""
    return "\n".join(f"{n}: {book.average(n):.1f} {book.grade(n)}" for n in book.ranking())
''',
    },
    tests={
        "test_grades.py": r"""from @pkg@ import GradeBook, letter, median, report

TEXT = "ann: 90, 80, 100\nbob: 70, 75\ncat: 50, 65, 60"


def test_average():
    assert GradeBook(TEXT).average("ann") == 90


def test_letter_f():
    assert letter(12) == "F"


def test_grade_a():
    assert GradeBook("x: 100").grade("x") == "A"


def test_drop_lowest():
    assert GradeBook("x: 10, 90, 100", drop_lowest=1).average("x") == 95


def test_median_odd():
    assert median([3, 1, 2]) == 2


def test_ranking():
    assert GradeBook(TEXT).ranking() == ["ann", "bob", "cat"]


def test_report():
    assert report(GradeBook("x: 100")) == "x: 100.0 A"
""",
    },
    sites=(
        Site(
            "median_even",
            "off_by_one",
            "stats.py",
            "return (ordered[mid - 1] + ordered[mid]) / 2",
            "return (ordered[mid] + ordered[mid + 1]) / 2",
            "median() is wrong for an even number of scores",
            "median([1, 2, 3, 4, 10, 20])",
            ("median([5, 1])",),
        ),
        Site(
            "cutoff_edge",
            "off_by_one",
            "grades.py",
            "if score >= cutoff:",
            "if score > cutoff:",
            "A score exactly on a cutoff gets the lower letter",
            "letter(80)",
            ('GradeBook("x: 70, 70").grade("x")',),
        ),
        Site(
            "b_cutoff",
            "wrong_operator_or_constant",
            "grades.py",
            '(80, "B")',
            '(85, "B")',
            "Scores in the low eighties get a C",
            "letter(82)",
        ),
        Site(
            "ranking_order",
            "wrong_operator_or_constant",
            "book.py",
            "key=lambda n: (-self.average(n), n)",
            "key=lambda n: (self.average(n), n)",
            "ranking() lists the weakest student first",
            'GradeBook("a: 50\\nb: 90\\nc: 70").ranking()',
        ),
        Site(
            "empty_scores",
            "missing_case",
            "stats.py",
            """    if not kept:
        return 0.0
""",
            "",
            "A student without scores breaks average()",
            'GradeBook("new:").average("new")',
            ("average([50, 60], drop_lowest=2)",),
        ),
        Site(
            "grade_helper",
            "wrong_cross_module_call",
            "book.py",
            "return letter(self.average(name))",
            "return letter(median(self.scores[name]))",
            "grade() does not follow the student's average",
            'GradeBook("x: 40, 95, 96, 99").grade("x")',
            ('GradeBook("y: 0, 0, 0, 100, 100", drop_lowest=3).grade("y")',),
        ),
        Site(
            "name_separator",
            "parsing_or_config",
            "scores.py",
            'name, _, rest = line.partition(":")',
            'name, _, rest = line.partition(",")',
            "The scores are read wrongly from the documented format",
            'GradeBook("ann: 90, 80").scores',
        ),
    ),
)
