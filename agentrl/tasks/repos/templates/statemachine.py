"""A finite state machine: guarded transitions, wildcard sources, a history, and machines read from text."""

from agentrl.tasks.repos.template import Site, Template

TEMPLATE = Template(
    name="statemachine",
    about="a finite state machine library",
    packages=("statemachine", "fsmkit", "workflow"),
    params={"START": ("idle", "ready")},
    modules={
        "__init__.py": r'''"""Finite state machines."""

from .machine import Machine
from .spec import build, parse_spec
from .transitions import Transition
''',
        "transitions.py": r'''"""Transitions and how one is chosen."""


class Transition:
    def __init__(self, source, event, target, guard=None):
        self.source, self.event, self.target, self.guard = source, event, target, guard


def find_transition(transitions, state, event, context):
    """The first transition from `state` (or from `*`, any state) on `event` whose guard accepts `context`."""
    for t in transitions:
        if t.event != event or t.source not in (state, "*"):
            continue
        if t.guard is None or t.guard(context):
            return t
    return None
''',
        "history.py": r'''"""The states a machine went through."""


class History:
    def __init__(self, initial):
        self.steps = [(None, initial)]

    def record(self, event, state):
        self.steps.append((event, state))

    def states(self):
        return [s for _, s in self.steps]

    def events(self):
        return [e for e, _ in self.steps[1:]]

    def last(self, n):
        """The last `n` states, oldest first."""
        return self.states()[-n:]
''',
        "machine.py": r'''"""A state machine."""

from .history import History
from .transitions import find_transition


class Machine:
    def __init__(self, initial, transitions):
        self.state = initial
        self.transitions = list(transitions)
        self.history = History(initial)

    def fire(self, event, **context):
        """Take the transition for `event` from the current state; ValueError when none applies."""
        t = find_transition(self.transitions, self.state, event, context)
        if t is None:
            raise ValueError(f"no transition for {event!r} from {self.state!r}")
        self.state = t.target
        self.history.record(event, t.target)
        return self.state

    def can_fire(self, event, **context):
        return find_transition(self.transitions, self.state, event, context) is not None
''',
        "spec.py": r'''"""Machines from text: one `source --event--> target` per line; `#` starts a comment."""

from .machine import Machine
from .transitions import Transition


def parse_spec(text):
    """The transitions of `text`, in order."""
    transitions = []
    for raw in text.splitlines():
        line = raw.split("#")[0].strip()
        if not line:
            continue
        source, rest = line.split("--", 1)
        event, target = rest.split("-->", 1)
        transitions.append(Transition(source.strip(), event.strip(), target.strip()))
    return transitions


def build(text, initial=None):
    """A Machine of the spec, starting in `initial`, by default the first transition's source."""
    transitions = parse_spec(text)
    return Machine(initial or transitions[0].source, transitions)
''',
    },
    tests={
        "test_machine.py": r'''from @pkg@ import Machine, Transition, build

SPEC = """
@START@ --start--> running
running --pause--> paused
paused --resume--> running
"""


def test_fire():
    m = build(SPEC)
    assert m.fire("start") == "running"


def test_initial_state():
    assert build(SPEC).state == "@START@"


def test_unknown_event():
    m = build(SPEC)
    try:
        m.fire("pause")
    except ValueError:
        return
    raise AssertionError("no ValueError")


def test_can_fire():
    assert build(SPEC).can_fire("start")


def test_guard_allows():
    m = Machine("a", [Transition("a", "go", "b", guard=lambda c: c.get("ok"))])
    assert m.fire("go", ok=True) == "b"
''',
    },
    sites=(
        Site(
            "history_tail",
            "off_by_one",
            "history.py",
            "return self.states()[-n:]",
            "return self.states()[-n - 1 :]",
            "history.last(n) returns more than n states",
            'm = build("a --x--> b\\nb --y--> c")\nm.fire("x")\nm.fire("y")\nm.history.last(2)',
        ),
        Site(
            "wildcard",
            "missing_case",
            "transitions.py",
            't.source not in (state, "*")',
            "t.source != state",
            "Transitions from `*` never fire",
            'm = build("a --go--> b\\n* --reset--> a")\nm.fire("go")\nm.fire("reset")',
        ),
        Site(
            "guard",
            "missing_case",
            "transitions.py",
            """        if t.guard is None or t.guard(context):
            return t""",
            "        return t",
            "A guarded transition fires although its guard refuses",
            'm = Machine("a", [Transition("a", "go", "b", guard=lambda c: c.get("ok"))])\nm.can_fire("go", ok=False)',
        ),
        Site(
            "record_args",
            "wrong_cross_module_call",
            "machine.py",
            "self.history.record(event, t.target)",
            "self.history.record(t.target, event)",
            "The history lists events where states should be",
            'm = build("a --go--> b")\nm.fire("go")\nm.history.states()',
            ('m = build("a --go--> b\\nb --back--> a")\nm.fire("go")\nm.fire("back")\nm.history.events()',),
        ),
        Site(
            "comment_char",
            "parsing_or_config",
            "spec.py",
            'line = raw.split("#")[0].strip()',
            'line = raw.split("//")[0].strip()',
            "A spec with comments cannot be read",
            'm = build("# door\\nclosed --open--> opened")\nm.fire("open")',
        ),
        Site(
            "initial_default",
            "parsing_or_config",
            "spec.py",
            "initial or transitions[0].source",
            "initial or transitions[-1].source",
            "build() starts the machine in the wrong state",
            'build("a --go--> b\\nb --back--> a\\nb --stop--> c").state',
        ),
    ),
)
