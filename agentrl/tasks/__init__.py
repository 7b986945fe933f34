"""Task records and task sets: what episodes are about."""

from agentrl.tasks.base import (
    AssertTests,
    CallCase,
    CallTests,
    CheckTests,
    IOCase,
    IOTests,
    ListTaskSet,
    RepoTests,
    Split,
    Task,
    TaskSet,
    Tests,
    in_test_split,
    test_count,
)

__all__ = [
    "AssertTests",
    "CallCase",
    "CallTests",
    "CheckTests",
    "IOCase",
    "IOTests",
    "ListTaskSet",
    "RepoTests",
    "Split",
    "Task",
    "TaskSet",
    "Tests",
    "in_test_split",
    "test_count",
]
