import pytest
import ray


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray for one test module (2 CPUs, no dashboard), shut down after it."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
