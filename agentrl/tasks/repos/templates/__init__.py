"""The repository templates, one module each, by name.

Each module defines `TEMPLATE`. Template code lives in raw strings (`@pkg@` and `@NAME@` markers make it a
template, not Python), so ruff never sees it; the generator runs every template's own tests, and
`tests/tasks/test_repos.py` validates its sites with pytest.
"""

from agentrl.tasks.repos.template import Template
from agentrl.tasks.repos.templates import (
    calc,
    cart,
    csvtable,
    durations,
    gradebook,
    inifile,
    inventory,
    ledger,
    lrucache,
    matrix,
    mdtable,
    minitemplate,
    pqueue,
    querystring,
    ratelimit,
    roman,
    router,
    semver,
    statemachine,
    units,
    wordfreq,
    wraptext,
)

_MODULES = (calc, cart, csvtable, durations, gradebook, inifile, inventory, ledger, lrucache, matrix, mdtable)
_MODULES += (minitemplate, pqueue, querystring, ratelimit, roman, router, semver, statemachine, units, wordfreq)
_MODULES += (wraptext,)

TEMPLATES: dict[str, Template] = {m.TEMPLATE.name: m.TEMPLATE for m in _MODULES}
"""every template by name; a new one is a module here, imported and listed above"""
