"""Caches: an LRU cache with statistics, a memoizing decorator and a TTL cache with an injected clock."""

from agentrl.tasks.repos.template import Site, Template

TEMPLATE = Template(
    name="lrucache",
    about="a caching library",
    packages=("lrucache", "memokit", "cachebox"),
    params={"CAP": ("128", "256")},
    modules={
        "__init__.py": r'''"""Least-recently-used and time-to-live caches."""

from .cache import LRUCache
from .memo import memoize
from .ttl import TTLCache
''',
        "stats.py": r'''"""Hit and miss counters."""


class Stats:
    def __init__(self):
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def hit_rate(self):
        """Hits over lookups; 0.0 before any lookup."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def summary(self):
        rate = round(self.hit_rate(), 3)
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions, "hit_rate": rate}
''',
        "cache.py": r'''"""A least-recently-used cache on a dict, which keeps insertion order."""

from .stats import Stats


class LRUCache:
    def __init__(self, capacity):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._data = {}
        self.stats = Stats()

    def get(self, key, default=None):
        """The value of `key`, which becomes the most recently used; `default` when absent."""
        if key not in self._data:
            self.stats.misses += 1
            return default
        self.stats.hits += 1
        value = self._data.pop(key)
        self._data[key] = value
        return value

    def put(self, key, value):
        """Store `value`, evicting the least recently used key when full."""
        if key in self._data:
            self._data.pop(key)
        elif len(self._data) >= self.capacity:
            self._data.pop(next(iter(self._data)))
            self.stats.evictions += 1
        self._data[key] = value

    def keys(self):
        """Keys from least to most recently used."""
        return list(self._data)
''',
        "memo.py": r'''"""Memoize a function with an LRU cache."""

from .cache import LRUCache

_MISSING = object()
DEFAULT_CAPACITY = @CAP@


def memoize(capacity=DEFAULT_CAPACITY):
    """A decorator caching results by positional arguments."""

    def wrap(fn):
        cache = LRUCache(capacity)

        def inner(*args):
            result = cache.get(args, _MISSING)
            if result is _MISSING:
                result = fn(*args)
                cache.put(args, result)
            return result

        inner.cache = cache
        return inner

    return wrap
''',
        "ttl.py": r'''"""Entries that expire `ttl` seconds after they are stored; `clock()` is the time in seconds."""


class TTLCache:
    def __init__(self, ttl, clock):
        self.ttl = ttl
        self.clock = clock
        self._data = {}

    def put(self, key, value):
        self._data[key] = (value, self.clock() + self.ttl)

    def get(self, key, default=None):
        """The value while it lives: from `put` until `ttl` seconds later, that instant excluded."""
        if key not in self._data:
            return default
        value, expires = self._data[key]
        if self.clock() >= expires:
            del self._data[key]
            return default
        return value
''',
    },
    tests={
        "test_cache.py": r"""from @pkg@ import LRUCache, TTLCache, memoize


def test_get_put():
    c = LRUCache(2)
    c.put("a", 1)
    assert c.get("a") == 1


def test_missing_default():
    assert LRUCache(1).get("x", 0) == 0


def test_stats():
    c = LRUCache(2)
    c.put("a", 1)
    c.get("a")
    c.get("b")
    assert c.stats.summary()["hit_rate"] == 0.5


def test_bad_capacity():
    try:
        LRUCache(0)
    except ValueError:
        return
    raise AssertionError("no ValueError")


def test_memoize_result():
    @memoize()
    def double(x):
        return 2 * x

    assert double(4) == 8


def test_ttl_alive():
    now = [0]
    c = TTLCache(10, lambda: now[0])
    c.put("k", "v")
    now[0] = 5
    assert c.get("k") == "v"
""",
    },
    sites=(
        Site(
            "capacity_edge",
            "off_by_one",
            "cache.py",
            "elif len(self._data) >= self.capacity:",
            "elif len(self._data) > self.capacity:",
            "The cache holds one entry more than its capacity",
            'c = LRUCache(2)\nc.put("a", 1)\nc.put("b", 2)\nc.put("c", 3)\nc.keys()',
        ),
        Site(
            "ttl_expiry",
            "off_by_one",
            "ttl.py",
            "if self.clock() >= expires:",
            "if self.clock() > expires:",
            "A TTL entry is still returned at the moment it expires",
            'now = [0]\nc = TTLCache(10, lambda: now[0])\nc.put("k", "v")\nnow[0] = 10\nc.get("k")',
        ),
        Site(
            "ttl_sign",
            "wrong_operator_or_constant",
            "ttl.py",
            "self.clock() + self.ttl)",
            "self.clock() - self.ttl)",
            "TTLCache forgets entries immediately",
            'now = [100]\nc = TTLCache(30, lambda: now[0])\nc.put("k", 1)\nc.get("k")',
        ),
        Site(
            "recency",
            "missing_case",
            "cache.py",
            """        value = self._data.pop(key)
        self._data[key] = value
""",
            "        value = self._data[key]\n",
            "Reading a key does not protect it from eviction",
            'c = LRUCache(2)\nc.put("a", 1)\nc.put("b", 2)\nc.get("a")\nc.put("c", 3)\nc.keys()',
        ),
        Site(
            "update_existing",
            "missing_case",
            "cache.py",
            """        if key in self._data:
            self._data.pop(key)
        elif len""",
            "        if len",
            "Updating a key in a full cache evicts another key",
            'c = LRUCache(2)\nc.put("a", 1)\nc.put("b", 2)\nc.put("b", 3)\nc.keys()',
        ),
        Site(
            "memo_args",
            "wrong_cross_module_call",
            "memo.py",
            "cache.put(args, result)",
            "cache.put(result, args)",
            "memoize() calls the function again for arguments it has seen",
            "calls = []\n@memoize()\ndef square(x):\n    calls.append(x)\n    return x * x\n"
            "square(3)\nsquare(3)\nlen(calls)",
        ),
        Site(
            "memo_capacity",
            "parsing_or_config",
            "memo.py",
            "def memoize(capacity=DEFAULT_CAPACITY):",
            "def memoize(capacity=1):",
            "memoize() keeps only the last result",
            "calls = []\n@memoize()\ndef f(x):\n    calls.append(x)\n    return x\nf(1)\nf(2)\nf(1)\nlen(calls)",
        ),
    ),
)
