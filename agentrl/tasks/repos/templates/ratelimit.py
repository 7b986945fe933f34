"""A rate limiter: token buckets, a sliding window, per-key limits from specs such as "10/min"."""

from agentrl.tasks.repos.template import Site, Template

TEMPLATE = Template(
    name="ratelimit",
    about="a rate-limiting library (clocks are injected)",
    packages=("ratelimit", "throttle", "quota"),
    modules={
        "__init__.py": r'''"""Rate limiting with injectable clocks."""

from .bucket import TokenBucket
from .limiter import RateLimiter
from .spec import parse_rate
from .window import SlidingWindow
''',
        "bucket.py": r'''"""A token bucket: up to `capacity` tokens, refilled at `rate` tokens per second."""


class TokenBucket:
    def __init__(self, capacity, rate, clock):
        self.capacity = capacity
        self.rate = rate
        self.clock = clock
        self.tokens = capacity
        self.updated = clock()

    def _refill(self):
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
        self.updated = now

    def take(self, n=1):
        """Take `n` tokens if there are that many; whether it did."""
        self._refill()
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False
''',
        "window.py": r'''"""A sliding window: at most `limit` events in any `period` seconds."""


class SlidingWindow:
    def __init__(self, limit, period, clock):
        self.limit, self.period, self.clock = limit, period, clock
        self.events = []

    def allow(self):
        """Whether an event may happen now (if so, it is counted)."""
        now = self.clock()
        self.events = [t for t in self.events if t > now - self.period]
        if len(self.events) < self.limit:
            self.events.append(now)
            return True
        return False
''',
        "spec.py": r'''"""Rate specs: "<count>/<unit>", the unit one of s, sec, min, h, hour, day."""

UNITS = {"s": 1, "sec": 1, "min": 60, "h": 3600, "hour": 3600, "day": 86400}


def parse_rate(spec):
    """(count, seconds) of a spec such as "10/min"; ValueError for anything else."""
    count, sep, unit = spec.replace(" ", "").partition("/")
    if not sep or unit not in UNITS or not count.isdigit():
        raise ValueError(f"bad rate {spec!r}")
    return int(count), UNITS[unit]
''',
        "limiter.py": r'''"""Per-key rate limiting."""

from .bucket import TokenBucket
from .spec import parse_rate


class RateLimiter:
    """A token bucket per key, each allowing `spec` (such as "10/min") with bursts up to `burst`."""

    def __init__(self, spec, clock, burst=None):
        self.count, self.per_seconds = parse_rate(spec)
        self.burst = burst or self.count
        self.clock = clock
        self.buckets = {}

    def allow(self, key):
        if key not in self.buckets:
            self.buckets[key] = TokenBucket(self.burst, self.count / self.per_seconds, self.clock)
        return self.buckets[key].take()
''',
    },
    tests={
        "test_limits.py": r"""from @pkg@ import RateLimiter, SlidingWindow, TokenBucket, parse_rate


def test_parse_rate():
    assert parse_rate("10/min") == (10, 60)


def test_bad_rate():
    try:
        parse_rate("ten")
    except ValueError:
        return
    raise AssertionError("no ValueError")


def test_bucket_starts_full():
    b = TokenBucket(2, 1, lambda: 0)
    assert b.take() and b.take()


def test_bucket_empties():
    b = TokenBucket(1, 1, lambda: 0)
    b.take()
    assert not b.take()


def test_window_limit():
    w = SlidingWindow(1, 10, lambda: 0)
    assert w.allow() and not w.allow()


def test_keys_are_separate():
    lim = RateLimiter("1/min", lambda: 0)
    assert lim.allow("a") and lim.allow("b")
""",
    },
    sites=(
        Site(
            "last_token",
            "off_by_one",
            "bucket.py",
            "if self.tokens >= n:",
            "if self.tokens > n:",
            "The last token of a bucket can never be taken",
            "b = TokenBucket(3, 1, lambda: 0)\n[b.take() for _ in range(4)]",
            ('lim = RateLimiter("2/min", lambda: 0)\n[lim.allow("k") for _ in range(3)]',),
        ),
        Site(
            "window_edge",
            "off_by_one",
            "window.py",
            "if t > now - self.period]",
            "if t >= now - self.period]",
            "An event exactly one period old still counts against the window",
            "now = [0]\nw = SlidingWindow(1, 10, lambda: now[0])\nw.allow()\nnow[0] = 10\nw.allow()",
        ),
        Site(
            "refill_cap",
            "wrong_operator_or_constant",
            "bucket.py",
            "self.tokens = min(self.capacity,",
            "self.tokens = max(self.capacity,",
            "A bucket saves up more tokens than its capacity",
            "now = [0]\nb = TokenBucket(2, 1, lambda: now[0])\nnow[0] = 100\n[b.take() for _ in range(4)]",
        ),
        Site(
            "bucket_args",
            "wrong_cross_module_call",
            "limiter.py",
            "TokenBucket(self.burst, self.count / self.per_seconds, self.clock)",
            "TokenBucket(self.count / self.per_seconds, self.burst, self.clock)",
            "RateLimiter allows far fewer requests than its spec",
            'lim = RateLimiter("5/min", lambda: 0)\n[lim.allow("k") for _ in range(6)]',
        ),
        Site(
            "unit_check",
            "missing_case",
            "spec.py",
            "if not sep or unit not in UNITS or not count.isdigit():",
            "if not sep or not count.isdigit():",
            "parse_rate() raises KeyError for an unknown unit",
            'parse_rate("5/week")',
        ),
        Site(
            "spec_separator",
            "parsing_or_config",
            "spec.py",
            'spec.replace(" ", "").partition("/")',
            'spec.replace(" ", "").partition(":")',
            "parse_rate() rejects a valid spec",
            'parse_rate("100/h")',
            ('RateLimiter("3 / s", lambda: 0).per_seconds',),
        ),
        Site(
            "minute_seconds",
            "parsing_or_config",
            "spec.py",
            '"min": 60,',
            '"min": 100,',
            "A per-minute rate refills too slowly",
            'parse_rate("30/min")',
        ),
    ),
)
