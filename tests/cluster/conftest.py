"""`ray_cluster`: a real Ray cluster on this machine for the tests of this folder (tests/ray_cluster.py): a head on
the main Docker daemon and two worker nodes, "a" and "b", each with {"docker": 1} and its own empty dockerd."""

from __future__ import annotations

import time

import pytest
from ray_cluster import NodeSpec, RayCluster


@pytest.fixture(scope="module")
def ray_cluster():
    """Shared by a module's tests (a test that kills a node comes last in its module); stopped after it."""
    t0 = time.monotonic()
    cluster = RayCluster.start({"a": NodeSpec(docker=True), "b": NodeSpec(docker=True)})
    stages = ", ".join(f"{k} {v:.1f} s" for k, v in cluster.setup_s.items())
    print(f"\nray_cluster: up in {time.monotonic() - t0:.1f} s ({stages})")
    try:
        yield cluster
    finally:
        cluster.stop()
