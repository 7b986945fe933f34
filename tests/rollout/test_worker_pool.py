"""The env-worker pool's contract on real Ray actors: a failed call raises `WorkerError`, a dead worker's
`WorkerDied` after the pool has replaced it in its slot."""

import asyncio

import pytest
import ray

from agentrl.rollout import RolloutConfig, WorkerDied, WorkerError
from agentrl.rollout.pool import RayEnvWorkerPool

pytestmark = pytest.mark.docker  # a replacement removes the dead worker's sandboxes on this host's daemon

TASKS = {"tasks": "procedural:levels=1;families=lists"}


async def test_a_killed_worker_is_replaced_and_its_callers_see_worker_died(ray_local):
    pool = RayEnvWorkerPool(RolloutConfig(env="code_sandbox", env_kwargs=TASKS, num_workers=2))
    await pool.start()
    try:
        a, b = pool.workers
        assert [pool.pick() for _ in range(4)] == [a, b, a, b]  # round robin
        tasks, again = await asyncio.gather(a.sample_tasks(3, 7), b.sample_tasks(3, 7))
        assert tasks == again  # the same draw from any worker

        # the env raising in a live worker (no such episode) is a WorkerError, and nothing is replaced
        with pytest.raises(WorkerError) as err:
            await a.step("no-such-episode", "hi")
        assert not isinstance(err.value, WorkerDied) and "no-such-episode" in str(err.value)
        assert pool.workers == [a, b]

        # a worker that died idle: the pool's task sampling meets it first, replaces it and asks the new one
        ray.kill(a.actor)
        assert await pool.sample_tasks(3, 7) == tasks
        fresh = pool.workers[0]
        assert fresh is not a and pool.workers[1] is b  # its slot, a new actor
        # a call still holding the dead worker: WorkerDied, and it is not replaced twice
        with pytest.raises(WorkerDied):
            await a.step("no-such-episode", "hi")
        await a.close("no-such-episode")  # its envs went with it: closing one is a no-op
        assert pool.workers == [fresh, b]
    finally:
        await pool.close()
    assert pool.workers == []
    await pool.close()  # safe twice
