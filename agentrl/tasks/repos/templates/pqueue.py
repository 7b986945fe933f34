"""A priority queue: a binary heap, a stable queue on it, a deadline scheduler and k-way merging."""

from agentrl.tasks.repos.template import Site, Template

TEMPLATE = Template(
    name="pqueue",
    about="a priority queue and scheduler library",
    packages=("pqueue", "heapq2", "jobqueue"),
    modules={
        "__init__.py": r'''"""Priority queues, scheduling and merging."""

from .merge import merge, smallest
from .priority import PriorityQueue
from .scheduler import Scheduler
''',
        "heap.py": r'''"""A binary min-heap over a Python list."""


def sift_up(heap, i):
    while i > 0:
        parent = (i - 1) // 2
        if heap[i] < heap[parent]:
            heap[i], heap[parent] = heap[parent], heap[i]
            i = parent
        else:
            break


def sift_down(heap, i):
    n = len(heap)
    while True:
        smallest = i
        for child in (2 * i + 1, 2 * i + 2):
            if child < n and heap[child] < heap[smallest]:
                smallest = child
        if smallest == i:
            return
        heap[i], heap[smallest] = heap[smallest], heap[i]
        i = smallest


def push(heap, entry):
    heap.append(entry)
    sift_up(heap, len(heap) - 1)


def pop(heap):
    """Remove and return the smallest entry; IndexError when empty."""
    last = heap.pop()
    if not heap:
        return last
    top, heap[0] = heap[0], last
    sift_down(heap, 0)
    return top
''',
        "priority.py": r'''"""A stable priority queue: equal priorities leave in insertion order."""

from itertools import count

from .heap import pop, push


class PriorityQueue:
    def __init__(self):
        self._heap = []
        self._order = count()

    def __len__(self):
        return len(self._heap)

    def put(self, item, priority=0):
        """Queue `item`; lower priorities leave first."""
        push(self._heap, (priority, next(self._order), item))

    def get(self):
        """The next item; IndexError when empty."""
        if not self._heap:
            raise IndexError("get from an empty queue")
        return pop(self._heap)[2]

    def peek_priority(self):
        return self._heap[0][0] if self._heap else None
''',
        "scheduler.py": r'''"""Run jobs by deadline, then by priority."""

from .priority import PriorityQueue


class Scheduler:
    def __init__(self):
        self.queue = PriorityQueue()

    def add(self, name, deadline, priority=0):
        self.queue.put(name, (deadline, priority))

    def run_until(self, time):
        """The names of the jobs due at or before `time`, in order; they leave the queue."""
        done = []
        while len(self.queue) and self.queue.peek_priority()[0] <= time:
            done.append(self.queue.get())
        return done
''',
        "merge.py": r'''"""Merging and selection with the heap."""

from .heap import pop, push


def merge(*lists):
    """One sorted list of the items of the sorted `lists`."""
    heap, out = [], []
    for k, items in enumerate(lists):
        if items:
            push(heap, (items[0], k, 0))
    while heap:
        value, k, i = pop(heap)
        out.append(value)
        if i + 1 < len(lists[k]):
            push(heap, (lists[k][i + 1], k, i + 1))
    return out


def smallest(items, n):
    """The `n` smallest items, in order."""
    heap = []
    for item in items:
        push(heap, item)
    return [pop(heap) for _ in range(min(n, len(heap)))]
''',
    },
    tests={
        "test_queue.py": r"""from @pkg@ import PriorityQueue, Scheduler, merge, smallest


def test_lowest_first():
    q = PriorityQueue()
    q.put("b", 2)
    q.put("a", 1)
    assert q.get() == "a"


def test_len():
    q = PriorityQueue()
    q.put("x", 1)
    q.put("y", 1)
    assert len(q) == 2


def test_empty_get():
    try:
        PriorityQueue().get()
    except IndexError:
        return
    raise AssertionError("no IndexError")


def test_scheduler_runs_due_jobs():
    s = Scheduler()
    s.add("late", 50)
    s.add("soon", 5)
    assert s.run_until(10) == ["soon"]


def test_merge_two():
    assert merge([1, 4], [2, 3]) == [1, 2, 3, 4]


def test_smallest():
    assert smallest([5, 1, 4], 2) == [1, 4]
""",
    },
    sites=(
        Site(
            "merge_tail",
            "off_by_one",
            "merge.py",
            "if i + 1 < len(lists[k]):",
            "if i + 2 < len(lists[k]):",
            "merge() loses the last item of each list",
            "merge([1, 3, 5], [2, 4])",
            ("merge([7], [1, 2])",),
        ),
        Site(
            "due_now",
            "off_by_one",
            "scheduler.py",
            ".peek_priority()[0] <= time:",
            ".peek_priority()[0] < time:",
            "run_until(t) leaves out jobs due exactly at t",
            's = Scheduler()\ns.add("a", 5)\ns.add("b", 9)\ns.run_until(5)',
        ),
        Site(
            "child_index",
            "wrong_operator_or_constant",
            "heap.py",
            "for child in (2 * i + 1, 2 * i + 2):",
            "for child in (2 * i + 1, 2 * i + 3):",
            "Items come out of the queue in the wrong order",
            "smallest([5, 3, 8, 1, 9, 2, 7], 7)",
            ("q = PriorityQueue()\nfor p in (4, 1, 3, 2, 5, 0):\n    q.put(p, p)\n[q.get() for _ in range(6)]",),
        ),
        Site(
            "empty_list",
            "missing_case",
            "merge.py",
            "        if items:\n            push(heap, (items[0], k, 0))",
            "        push(heap, (items[0], k, 0))",
            "merge() fails when one of the lists is empty",
            "merge([1, 2], [])",
            ("merge([], [3])",),
        ),
        Site(
            "deadline_order",
            "wrong_cross_module_call",
            "scheduler.py",
            "self.queue.put(name, (deadline, priority))",
            "self.queue.put(name, (priority, deadline))",
            "The scheduler runs jobs in the wrong order",
            's = Scheduler()\ns.add("a", 5, priority=0)\ns.add("b", 1, priority=2)\ns.run_until(10)',
        ),
        Site(
            "default_priority",
            "parsing_or_config",
            "priority.py",
            "def put(self, item, priority=0):",
            "def put(self, item, priority=10):",
            "Items put without a priority leave after prioritised ones",
            'q = PriorityQueue()\nq.put("plain")\nq.put("urgent", 5)\nq.get()',
        ),
    ),
)
