"""A plausible wrong answer for HumanEval problems, shared by the grading and the eval tests
(importable everywhere under tests/: pytest puts this directory, where conftest.py lives, on sys.path)."""

import textwrap


def nudge_results(entry_point: str) -> str:
    """Code to append after a correct `entry_point`: it rebinds the name to a wrapper that nudges every result."""
    return textwrap.dedent(f"""

        _right = {entry_point}
        def {entry_point}(*args, **kwargs):
            r = _right(*args, **kwargs)
            if isinstance(r, bool): return not r
            if isinstance(r, (int, float)): return r + 1
            if isinstance(r, str): return r + "x"
            if isinstance(r, (list, tuple)): return type(r)(list(r) + [None])
            return 0 if r is None else None
        """)
