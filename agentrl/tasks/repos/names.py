"""Per-instance names: the identifiers of a template's package (its functions, classes, variables, attributes and
module files) renamed word by word with synonyms, so that two instances of a template read differently.

Why: instances of a template otherwise differ only in the package's name, a few constants and the bug, so a policy
fine-tuned on some of them can recall their code instead of reading the repository in front of it; with names
drawn per instance, an edit's `old` text or a module path is right only when copied from what `view` showed.

The renaming is an alpha-renaming of the package's own names in code, applied alike to its modules, its tests,
the sessions the issue and hidden tests run, the bug sites' text and the issue's title, so it changes no
behaviour. What it leaves alone keeps it so:
- string literals and comments (data keeps its bytes: an input's order, lengths and keys are unchanged), except
  `backticked` names in a module's docstrings, which follow the code;
- every name that also occurs inside a string literal (a namedtuple's fields, a `getattr`, an f-string's braces);
- names of the language and its libraries: builtins, keywords, the attributes of the builtin types and of the
  modules the package imports, attributes the package reads but never defines, keyword arguments given to a
  callable it does not define;
- a name whose draw would collide with any word already in use.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import keyword
import random
import re
import sys
from collections.abc import Iterable, Mapping

# A word's synonyms, for the words that make up the templates' identifiers. A word not listed keeps its spelling.
SYNONYMS: dict[str, tuple[str, ...]] = {
    "accounts": ("wallets",),
    "aggregate": ("combine", "reduce"),
    "align": ("justify_to",),
    "allow": ("permit",),
    "amount": ("sum_cents", "value"),
    "annual": ("yearly",),
    "apply": ("perform", "run"),
    "args": ("params",),
    "average": ("mean_of",),
    "balance": ("funds", "holding"),
    "binds": ("goes",),
    "book": ("register", "journal"),
    "bucket": ("pail", "reservoir"),
    "build": ("make", "assemble"),
    "bump": ("raise", "increment"),
    "burst": ("peak",),
    "cache": ("store", "memo_table"),
    "calculate": ("compute", "evaluate_text"),
    "capacity": ("max_size", "limit_size"),
    "cart": ("basket", "trolley"),
    "catalog": ("pricelist", "listing"),
    "cell": ("box", "entry"),
    "cells": ("boxes", "entries"),
    "cents": ("pennies",),
    "center": ("middle",),
    "ch": ("char", "c0"),
    "child": ("kid", "sub"),
    "clock": ("timer", "now_fn"),
    "code": ("token_code", "voucher"),
    "codes": ("vouchers",),
    "column": ("col", "field_of"),
    "columns": ("cols_of",),
    "compare": ("cmp", "order_of"),
    "compile": ("translate",),
    "config": ("settings", "conf"),
    "context": ("scope", "env"),
    "convert": ("transform",),
    "converters": ("casters",),
    "core": ("base_triplet",),
    "count": ("tally", "number_of"),
    "counts": ("tallies",),
    "current": ("active", "open"),
    "cutoff": ("threshold", "boundary"),
    "cutoffs": ("thresholds", "boundaries"),
    "data": ("store",),
    "date": ("day_tuple",),
    "dates": ("day_tuples",),
    "day": ("dday",),
    "days": ("ndays",),
    "deadline": ("due", "due_time"),
    "default": ("fallback", "preset"),
    "delimiter": ("sep_char", "divider"),
    "deposit": ("credit", "pay_in"),
    "determinant": ("det",),
    "digits": ("numerals",),
    "dimension": ("kind_of",),
    "dimensions": ("kinds_of",),
    "discounts": ("offers", "promotions"),
    "done": ("finished", "handled"),
    "dot": ("inner_product",),
    "drop": ("discard", "omit"),
    "duration": ("span", "period_text"),
    "entries": ("records",),
    "entry": ("record",),
    "escape": ("encode",),
    "eval": ("run",),
    "evaluate": ("compute", "reduce"),
    "event": ("signal", "trigger"),
    "events": ("signals", "triggers"),
    "every": ("each",),
    "evictions": ("dropped", "removals"),
    "expires": ("expiry", "dies_at"),
    "expr": ("expression",),
    "extra": ("surplus", "additional"),
    "factor": ("multiplier", "ratio"),
    "field": ("cell_text", "item_text"),
    "fields": ("cell_texts", "items_text"),
    "fill": ("flow", "pack"),
    "filter": ("pipe",),
    "filters": ("pipes",),
    "find": ("lookup", "search"),
    "fire": ("trigger", "send"),
    "fn": ("func",),
    "format": ("render", "show"),
    "found": ("matched",),
    "frac": ("fraction",),
    "frequencies": ("freqs",),
    "gap": ("spacing",),
    "gaps": ("spaces",),
    "grade": ("mark",),
    "grades": ("marks_of",),
    "guard": ("condition",),
    "have": ("on_hand",),
    "head": ("first_rows", "top_rows"),
    "header": ("heading",),
    "heap": ("tree", "binheap"),
    "history": ("log", "journal"),
    "hit": ("found",),
    "hits": ("found_count",),
    "hours": ("hrs",),
    "identity": ("eye", "unit_matrix"),
    "index": ("position", "col_index"),
    "initial": ("start",),
    "inner": ("wrapped",),
    "interest": ("yield",),
    "inventory": ("stock_book",),
    "item": ("article", "element"),
    "items": ("articles", "elements"),
    "justify": ("stretch",),
    "keep": ("retain",),
    "kept": ("retained",),
    "key": ("name_key", "k"),
    "kind": ("sort", "category"),
    "known": ("seen",),
    "last": ("final",),
    "left": ("remaining",),
    "letter": ("symbol",),
    "letters": ("symbols", "glyphs"),
    "level": ("amount_left",),
    "levels": ("amounts_left",),
    "lexer": ("scanner", "splitter"),
    "limit": ("cap", "ceiling"),
    "limiter": ("throttle",),
    "line": ("row_text", "ln"),
    "lines": ("rows_text", "text_lines"),
    "lists": ("seqs",),
    "literal": ("fixed", "constant"),
    "load": ("read", "ingest"),
    "lookup": ("resolve_name",),
    "low": ("short",),
    "lowest": ("worst", "min_score"),
    "machine": ("fsm", "automaton"),
    "major": ("big",),
    "mass": ("weight",),
    "match": ("recognise",),
    "matrix": ("grid", "mat"),
    "mean": ("avg", "average_of"),
    "median": ("middle_value",),
    "memo": ("note", "label"),
    "memoize": ("cached", "remember"),
    "merge": ("combine", "meld"),
    "merged": ("combined",),
    "method": ("verb", "http_method"),
    "minimum": ("min_width",),
    "minor": ("submatrix",),
    "minutes": ("mins",),
    "misses": ("miss_count",),
    "money": ("currency", "amounts"),
    "month": ("mon",),
    "monthly": ("per_month",),
    "multibuy": ("bulk", "bundle"),
    "multiply": ("matmul", "times"),
    "normalize": ("clean", "canonical"),
    "number": ("num", "numeral"),
    "numbers": ("nums", "numerals_of"),
    "op": ("operator", "sym"),
    "operators": ("symbols", "op_table"),
    "ops": ("arithmetic", "binops"),
    "order": ("seq", "tie"),
    "ordered": ("sorted_scores",),
    "out": ("result", "acc"),
    "overdraft": ("credit_line",),
    "pad": ("fill_to",),
    "pair": ("kv", "couple"),
    "paragraphs": ("blocks", "paras"),
    "params": ("fields", "args"),
    "parent": ("up_index",),
    "parse": ("read", "decode"),
    "parser": ("reader", "grammar"),
    "part": ("piece", "chunk"),
    "parts": ("pieces", "chunks"),
    "path": ("route_path",),
    "pattern": ("template", "shape"),
    "peek": ("look",),
    "percent": ("pct",),
    "period": ("span",),
    "pname": ("param_name",),
    "pop": ("take_next",),
    "pos": ("offset",),
    "power": ("matpow",),
    "pre": ("prerelease",),
    "precedence": ("priority_of", "strength"),
    "prefix": ("lead", "marker"),
    "prefixes": ("leads", "markers"),
    "price": ("cost",),
    "prices": ("costs",),
    "priority": ("rank", "urgency"),
    "product": ("sku_name",),
    "punctuation": ("marks",),
    "push": ("enqueue",),
    "put": ("store",),
    "quantity": ("qty", "units_of"),
    "query": ("qstring",),
    "queue": ("pq", "backlog"),
    "quote": ("percent_encode", "escape"),
    "quoted": ("in_quotes",),
    "rank": ("standing",),
    "ranking": ("standings",),
    "rate": ("ratio",),
    "raw": ("unparsed", "source_text"),
    "read": ("load",),
    "reader": ("loader",),
    "receive": ("restock", "take_in"),
    "record": ("log",),
    "records": ("dicts",),
    "remove": ("delete", "take_out"),
    "render": ("draw", "format"),
    "report": ("summary", "overview"),
    "resolve": ("lookup_path", "dispatch"),
    "rest": ("remainder", "tail"),
    "result": ("res", "answer"),
    "right": ("far",),
    "roman": ("numeral",),
    "route": ("endpoint",),
    "router": ("dispatcher", "url_map"),
    "routes": ("endpoints", "table"),
    "row": ("record", "line"),
    "rows": ("records", "lines"),
    "run": ("drain",),
    "saving": ("reduction",),
    "scale": ("scalar_mul",),
    "scales": ("factors",),
    "schedule": ("timetable",),
    "scheduler": ("planner",),
    "score": ("points",),
    "scores": ("points_list", "results"),
    "seconds": ("secs_total",),
    "secs": ("sec",),
    "section": ("group", "block"),
    "sections": ("groups", "blocks"),
    "segments": ("steps",),
    "separator": ("sep",),
    "share": ("fraction_of",),
    "ship": ("dispatch", "send_out"),
    "sift": ("bubble", "move"),
    "sign": ("prefix_sign",),
    "sku": ("code",),
    "sliding": ("moving", "rolling"),
    "smallest": ("least", "minimal"),
    "source": ("origin", "src"),
    "spare": ("leftover",),
    "spec": ("description", "definition"),
    "stack": ("pending", "held"),
    "start": ("begin", "first"),
    "state": ("status", "node"),
    "statement": ("report_of",),
    "states": ("nodes",),
    "stats": ("metrics", "counters"),
    "steps": ("moves",),
    "stock": ("supply", "holdings"),
    "stop": ("skip",),
    "strip": ("drop",),
    "subtotal": ("gross", "pre_tax"),
    "subtract": ("minus",),
    "summary": ("digest",),
    "table": ("sheet", "grid"),
    "tables": ("registry",),
    "take": ("consume", "use"),
    "target": ("dest", "to_state"),
    "tax": ("vat", "levy"),
    "temperature": ("temp", "heat"),
    "text": ("src", "source", "string"),
    "texts": ("strings",),
    "threshold": ("reorder_level", "minimum"),
    "time": ("clock_time", "now"),
    "tok": ("token", "tk"),
    "tokenize": ("lex", "scan"),
    "tokens": ("lexemes", "toks"),
    "top": ("peak", "head"),
    "total": ("sum", "overall"),
    "trace": ("diag_sum",),
    "transfer": ("move_funds",),
    "transition": ("edge", "arc"),
    "transitions": ("edges", "arcs"),
    "transpose": ("flip",),
    "ttl": ("lifetime", "max_age"),
    "unit": ("measure", "suffix"),
    "units": ("measures",),
    "unquote": ("decode",),
    "until": ("through",),
    "updated": ("last_refill",),
    "url": ("address", "link"),
    "urlencode": ("encode_query",),
    "value": ("val", "amount"),
    "values": ("vals", "amounts"),
    "vector": ("vec", "column_vec"),
    "version": ("release",),
    "versions": ("releases",),
    "where": ("select", "filter"),
    "whole": ("units_part",),
    "width": ("size", "measure"),
    "widths": ("sizes",),
    "window": ("frame", "interval"),
    "withdraw": ("debit", "take_out"),
    "word": ("term", "token_word"),
    "words": ("terms", "tokens"),
    "wrap": ("break_lines", "fold"),
    "write": ("emit",),
    "year": ("yr",),
}

_STRING = r"""[rRbBuUfF]{0,2}(?:\"\"\"[\s\S]*?\"\"\"|'''[\s\S]*?'''|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')"""
_TOKEN = re.compile(rf"(?P<string>{_STRING})|(?P<comment>#[^\n]*)|(?P<name>[A-Za-z_]\w*)")
_WORD = re.compile(r"[A-Za-z_]\w*")
_BACKTICKED = re.compile(r"`([A-Za-z_]\w*)`")
_BUILTIN_TYPES = (str, list, dict, set, frozenset, tuple, int, float, bool, bytes, object, BaseException, type)


def rename(text: str, names: Mapping[str, str], *, docstrings: bool = False) -> str:
    """`text` (Python code, or a fragment of it) with every name in code that `names` maps renamed. String
    literals and comments keep their bytes; with `docstrings`, a triple-quoted string's `backticked` names follow."""
    if not names:
        return text

    def sub(m: re.Match[str]) -> str:
        if m["name"]:
            return names.get(m["name"], m["name"])
        if docstrings and m["string"] and m["string"].lstrip("rRbBuUfF")[:3] in ('"""', "'''"):
            return _BACKTICKED.sub(lambda b: f"`{names.get(b[1], b[1])}`", m["string"])
        return m[0]

    return _TOKEN.sub(sub, text)


def rename_path(path: str, names: Mapping[str, str]) -> str:
    """A module path `pkg/stem.py` with its stem renamed as the code's imports of it are."""
    head, _, leaf = path.rpartition("/")
    stem, dot, ext = leaf.rpartition(".")
    if not dot or ext != "py":
        return path
    return f"{head}/{names.get(stem, stem)}.py" if head else f"{names.get(stem, stem)}.py"


def renamable(modules: Mapping[str, str], others: Iterable[str], pkg: str) -> frozenset[str]:
    """The names of the package `modules` (path -> text) that may be renamed: those it defines, less those the
    renaming must leave alone (see the module docstring). `others`: more code that uses them (tests, sessions)."""
    defined: set[str] = {p.rsplit("/", 1)[-1][:-3] for p in modules if p.endswith(".py")} - {"__init__"}
    attributes_read: set[str] = set()
    foreign: set[str] = {pkg, "self", "cls", *keyword.kwlist, *keyword.softkwlist, *dir(builtins)}
    for kind in _BUILTIN_TYPES:
        foreign |= set(dir(kind))
    in_strings: set[str] = set()
    for text, own in [*((t, True) for t in modules.values()), *((t, False) for t in others)]:
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
                attributes_read.add(node.attr)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                foreign |= _imported(node, pkg)
            elif isinstance(node, ast.Call):
                foreign |= _foreign_keywords(node)
            if own:
                defined |= _defines(node)
        in_strings |= _words_in_strings(text, docstrings=own)
    foreign |= attributes_read - defined
    return frozenset(n for n in defined - foreign - in_strings if not n.startswith("__"))


def _imported(node: ast.Import | ast.ImportFrom, pkg: str) -> set[str]:
    """The names an import brings in from outside the package, and, for the standard library's modules, their
    attributes and their classes' attributes."""
    module = node.module if isinstance(node, ast.ImportFrom) else None
    if isinstance(node, ast.ImportFrom) and (node.level or (module or "").split(".")[0] == pkg):
        return set()  # the package's own names
    out = {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    for name in [module] if module else [a.name for a in node.names]:
        out |= set(name.split("."))
        if name.split(".")[0] in sys.stdlib_module_names:
            module_ = importlib.import_module(name)
            out |= set(dir(module_))
            for value in vars(module_).values():  # and its classes' attributes (a `date`'s `year`)
                if isinstance(value, type):
                    out |= set(dir(value))
    return out


def _foreign_keywords(call: ast.Call) -> set[str]:
    """Keyword names given to a builtin or to a method call (whose callee the package may not define)."""
    func = call.func
    if (isinstance(func, ast.Name) and hasattr(builtins, func.id)) or isinstance(func, ast.Attribute):
        return {k.arg for k in call.keywords if k.arg}
    return set()


def _defines(node: ast.AST) -> set[str]:
    """The name `node` defines, if any: a function, class, argument, variable or attribute."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.arg):
        return {node.arg}
    if isinstance(node, ast.Name | ast.Attribute) and isinstance(node.ctx, ast.Store):
        return {node.id if isinstance(node, ast.Name) else node.attr}
    return set()


def _words_in_strings(text: str, *, docstrings: bool) -> set[str]:
    """Words inside the string literals of `text`, less its triple-quoted ones with `docstrings` (a module's, whose
    backticked names `rename` updates): a name found here may be data or looked up by name, so never renamed."""
    out: set[str] = set()
    for m in _TOKEN.finditer(text):
        s = m["string"]
        if s and not (docstrings and s.lstrip("rRbBuUfF")[:3] in ('"""', "'''")):
            out |= set(_WORD.findall(s))
    return out


def words(texts: Iterable[str]) -> set[str]:
    """Every word (identifier-shaped) in `texts`, code, strings and comments alike: what a new name must not be."""
    return {w for text in texts for w in _WORD.findall(text)}


def draw(names: Iterable[str], in_use: set[str], rng: random.Random) -> dict[str, str]:
    """A renaming of `names`: each word of a name (snake_case, UPPER_CASE or CamelCase) keeps its spelling or takes
    one of its synonyms, the same choice for every name that word occurs in; a name whose new spelling is a word
    already in use, or another name's new spelling, keeps its own."""
    choice: dict[str, str] = {}
    out: dict[str, str] = {}
    taken = set(in_use) | set(dir(builtins)) | set(keyword.kwlist)  # a builtin's name would shadow it
    for name in sorted(names):
        parts = _split(name)
        words = []
        for part in parts:
            low = part.lower()
            if low not in choice:
                choice[low] = rng.choice((low, *SYNONYMS.get(low, ())))
            words.append(choice[low])
        new = _join(name, parts, words)
        if new != name and new not in taken and new.isidentifier() and not keyword.iskeyword(new):
            out[name] = new
            taken.add(new)
    return out


def _split(name: str) -> list[str]:
    lead = len(name) - len(name.lstrip("_"))
    body = name[lead:]
    if "_" in body or body.isupper() or body.islower():
        return [p for p in body.split("_") if p]
    return re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+", body)


def _join(name: str, parts: list[str], words: list[str]) -> str:
    """`words` spelt in `name`'s style (its leading underscores, its case)."""
    lead = name[: len(name) - len(name.lstrip("_"))]
    body = name[len(lead) :]
    if body.isupper():
        return lead + "_".join(words).upper()
    if "_" in body or body.islower():
        return lead + "_".join(words)
    # CamelCase: a synonym's own underscores become word breaks; an acronym part (LRU) stays as it was
    pairs = zip(parts, words, strict=True)
    return lead + "".join(p if p.isupper() and w == p.lower() else w.title().replace("_", "") for p, w in pairs)
