"""Word frequencies: normalising words, counting words and n-grams, top-k and shares."""

from agentrl.tasks.repos.template import Site, Template

TEMPLATE = Template(
    name="wordfreq",
    about="a word-frequency library",
    packages=("wordfreq", "wordcount", "lexistats"),
    params={"K": ("3", "5")},
    modules={
        "__init__.py": r'''"""Count words in text."""

from .count import count_words, ngrams
from .normalize import words
from .top import frequencies, top
''',
        "normalize.py": r'''"""Words of text: lower-cased, punctuation stripped, stop words dropped unless kept."""

PUNCTUATION = ".,;:!?\"'()[]"
STOP_WORDS = {"a", "an", "the", "and", "or", "of", "to", "in"}


def words(text, keep_stop_words=False):
    out = []
    for raw in text.split():
        word = raw.strip(PUNCTUATION).lower()
        if word and (keep_stop_words or word not in STOP_WORDS):
            out.append(word)
    return out
''',
        "count.py": r'''"""Counting words and n-grams."""

from .normalize import words


def count_words(text, keep_stop_words=False):
    """{word: count} in first-seen order."""
    counts = {}
    for w in words(text, keep_stop_words):
        counts[w] = counts.get(w, 0) + 1
    return counts


def ngrams(text, n=2):
    """The n-grams (tuples) of the words of `text`, stop words kept, in order."""
    ws = words(text, keep_stop_words=True)
    return [tuple(ws[i : i + n]) for i in range(len(ws) - n + 1)]
''',
        "top.py": r'''"""The most frequent words."""

from .count import count_words


def top(text, k=@K@):
    """The `k` most frequent (word, count) pairs; ties in alphabetical order."""
    counts = count_words(text)
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:k]


def frequencies(text):
    """{word: its share of the counted words, to 3 places}; {} for text without words."""
    counts = count_words(text)
    total = sum(counts.values())
    if not total:
        return {}
    share = 1 / total
    return {w: round(c * share, 3) for w, c in counts.items()}
''',
    },
    tests={
        "test_words.py": r"""from @pkg@ import count_words, frequencies, ngrams, top, words


def test_words_lowercase():
    assert words("Hello World") == ["hello", "world"]


def test_stop_words_dropped():
    assert words("the cat and the hat") == ["cat", "hat"]


def test_count():
    assert count_words("b c b") == {"b": 2, "c": 1}


def test_bigrams():
    assert ngrams("x y z")[0] == ("x", "y")


def test_top_one():
    assert top("dog cat dog", 1) == [("dog", 2)]


def test_frequencies():
    assert frequencies("x y x y") == {"x": 0.5, "y": 0.5}
""",
    },
    sites=(
        Site(
            "last_ngram",
            "off_by_one",
            "count.py",
            "for i in range(len(ws) - n + 1)]",
            "for i in range(len(ws) - n)]",
            "ngrams() misses the last n-gram",
            'ngrams("a b c")',
            ('ngrams("one two three four", 3)',),
        ),
        Site(
            "top_order",
            "wrong_operator_or_constant",
            "top.py",
            "key=lambda item: (-item[1], item[0])",
            "key=lambda item: (item[1], item[0])",
            "top() returns the rarest words",
            'top("red red red blue blue green", 2)',
        ),
        Site(
            "no_words",
            "missing_case",
            "top.py",
            """    if not total:
        return {}
""",
            "",
            "frequencies() fails on text without words",
            'frequencies("the of and")',
            ('frequencies("")',),
        ),
        Site(
            "empty_word",
            "missing_case",
            "normalize.py",
            "if word and (keep_stop_words",
            "if (keep_stop_words",
            "A lone punctuation mark is counted as a word",
            'count_words("wait - what ?")',
            ('words("! ok")',),
        ),
        Site(
            "ngram_stop_words",
            "wrong_cross_module_call",
            "count.py",
            "ws = words(text, keep_stop_words=True)",
            "ws = words(text)",
            "ngrams() drops words such as 'the'",
            'ngrams("out of the box")',
        ),
        Site(
            "punctuation",
            "parsing_or_config",
            "normalize.py",
            'PUNCTUATION = ".,;:!?\\"\'()[]"',
            'PUNCTUATION = ".,;:?\\"\'()[]"',
            "Words followed by an exclamation mark are counted apart",
            'count_words("stop! stop")',
        ),
    ),
)
