"""`agentrl envs new NAME`: a package with one env, its entry point and its test (`--agent`: an agent program)."""

from __future__ import annotations

import re
import string
from pathlib import Path

TEMPLATE = Path(__file__).parent / "template"
AGENT_TEMPLATE = Path(__file__).parent / "agent_template"


def scaffold(name: str, parent: Path, *, agent: bool = False) -> Path:
    """Write the package for env `name` into parent/name and return that directory; `agent`: an agent program
    (`agentrl.env.agents`) instead of an env."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"env name {name!r} must be lowercase letters, digits and _ (a Python identifier)")
    root = parent / name
    if root.exists():
        raise FileExistsError(f"{root} already exists")
    values = {
        "name": name,
        "pkg": f"{name}_agent" if agent else f"{name}_env",
        "dist": f"agentrl-{'agent' if agent else 'env'}-{name.replace('_', '-')}",
        "cls": "".join(part.title() for part in name.split("_")) + "Env",
    }
    template = AGENT_TEMPLATE if agent else TEMPLATE
    for src in sorted(template.rglob("*.tmpl")):
        rel = src.relative_to(template).with_suffix("").as_posix().replace("__PKG__", values["pkg"])
        dest = root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(string.Template(src.read_text()).substitute(values))
    return root
