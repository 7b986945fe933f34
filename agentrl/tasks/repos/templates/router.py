"""A URL router: patterns with typed parameters, method matching, and URLs built back from route names."""

from agentrl.tasks.repos.template import Site, Template

TEMPLATE = Template(
    name="router",
    about="a URL routing library",
    packages=("router", "urlroutes", "pathmatch"),
    modules={
        "__init__.py": r'''"""Route URLs to names and back."""

from .build import url_for
from .pattern import compile_pattern, match
from .routes import Router
''',
        "pattern.py": r'''"""Route patterns such as "/users/<id:int>/posts/<slug>"."""

CONVERTERS = {"int": int, "str": str}


def compile_pattern(pattern):
    """(literal, name, converter) per path segment: a literal, or None and a parameter's name and type."""
    segments = []
    for part in pattern.strip("/").split("/"):
        if part.startswith("<") and part.endswith(">"):
            name, _, kind = part[1:-1].partition(":")
            segments.append((None, name, CONVERTERS[kind or "str"]))
        else:
            segments.append((part, None, None))
    return segments


def match(segments, path):
    """{name: value} when `path` matches the segments, else None."""
    parts = path.strip("/").split("/")
    if len(parts) != len(segments):
        return None
    params = {}
    for part, (literal, name, convert) in zip(parts, segments):
        if literal is not None:
            if part != literal:
                return None
        else:
            try:
                params[name] = convert(part)
            except ValueError:
                return None
    return params
''',
        "routes.py": r'''"""A router: the first route that matches wins."""

from .pattern import compile_pattern, match


class Router:
    def __init__(self):
        self.routes = []

    def add(self, method, pattern, name):
        self.routes.append((method.upper(), compile_pattern(pattern), name))

    def resolve(self, method, url):
        """(route name, params) for `method` and `url` (its query is ignored); None when no route matches."""
        path = url.partition("?")[0]
        for route_method, segments, name in self.routes:
            if route_method != method.upper():
                continue
            params = match(segments, path)
            if params is not None:
                return name, params
        return None
''',
        "build.py": r'''"""URLs from route names."""

from .pattern import match


def url_for(router, name, **params):
    """The path of route `name` with `params` filled in; KeyError for an unknown route or a missing param,
    ValueError for a value that its parameter's type refuses."""
    for _, segments, route_name in router.routes:
        if route_name == name:
            parts = [literal if literal is not None else str(params[pname]) for literal, pname, _ in segments]
            path = "/" + "/".join(parts)
            if match(segments, path) is None:
                raise ValueError(f"{params} do not fit route {name!r}")
            return path
    raise KeyError(name)
''',
    },
    tests={
        "test_routes.py": r"""from @pkg@ import Router, url_for


def make():
    r = Router()
    r.add("GET", "/users/<id:int>", "user")
    r.add("GET", "/posts/<slug>", "post")
    r.add("POST", "/users", "create_user")
    return r


def test_resolve_int():
    assert make().resolve("GET", "/users/7") == ("user", {"id": 7})


def test_no_match():
    assert make().resolve("GET", "/nothing") is None


def test_method_matters():
    assert make().resolve("DELETE", "/users") is None


def test_post():
    assert make().resolve("POST", "/users") == ("create_user", {})


def test_url_for():
    assert url_for(make(), "user", id=3) == "/users/3"
""",
    },
    sites=(
        Site(
            "param_brackets",
            "off_by_one",
            "pattern.py",
            'name, _, kind = part[1:-1].partition(":")',
            'name, _, kind = part[1:].partition(":")',
            "Adding a route with a typed parameter fails",
            'r = Router()\nr.add("GET", "/items/<n:int>", "item")\nr.resolve("GET", "/items/4")',
        ),
        Site(
            "leading_slash",
            "wrong_operator_or_constant",
            "build.py",
            'path = "/" + "/".join(parts)',
            'path = "/".join(parts)',
            "url_for() returns relative paths",
            'r = Router()\nr.add("GET", "/a/<x>", "a")\nurl_for(r, "a", x="b")',
        ),
        Site(
            "bad_int",
            "missing_case",
            "pattern.py",
            """            try:
                params[name] = convert(part)
            except ValueError:
                return None""",
            "            params[name] = convert(part)",
            "A non-numeric value for an int parameter raises instead of not matching",
            'r = Router()\nr.add("GET", "/users/<id:int>", "user")\nr.add("GET", "/users/<name>", "by_name")\n'
            'r.resolve("GET", "/users/ann")',
        ),
        Site(
            "method_case",
            "missing_case",
            "routes.py",
            "if route_method != method.upper():",
            "if route_method != method:",
            "resolve() ignores routes when the method is lower case",
            'r = Router()\nr.add("get", "/", "home")\nr.resolve("get", "/")',
        ),
        Site(
            "query_path",
            "wrong_cross_module_call",
            "routes.py",
            "params = match(segments, path)",
            "params = match(segments, url)",
            "URLs with a query string do not resolve",
            'r = Router()\nr.add("GET", "/posts/<slug>", "post")\nr.resolve("GET", "/posts/hi?page=2")',
        ),
        Site(
            "default_converter",
            "parsing_or_config",
            "pattern.py",
            'CONVERTERS[kind or "str"]',
            'CONVERTERS[kind or "int"]',
            "Untyped parameters only match numbers",
            'r = Router()\nr.add("GET", "/posts/<slug>", "post")\nr.resolve("GET", "/posts/hello")',
        ),
    ),
)
