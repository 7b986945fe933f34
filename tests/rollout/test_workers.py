"""An env worker under more concurrent calls than it has sandboxes, through a real Ray actor and real containers."""

import asyncio
import time

import pytest
import ray

from agentrl.rollout.workers import RemoteEnvWorker

RUN = '<tool_call>\n{"name": "run_python", "arguments": {"code": "print(1)"}}\n</tool_call>'


@pytest.mark.docker
@pytest.mark.slow  # 1100 episodes; the fast tier's env workers run in tests/rollout/test_controller.py
async def test_waiters_for_a_sandbox_never_crowd_out_the_episodes_holding_one(ray_local, sandbox_image):
    """1100 episodes want a sandbox at once from a pool of 1 (2 at most): more calls than Ray's default
    concurrency for an async actor (1000). The two episodes holding the sandboxes close only after the
    others' steps are all waiting; their close must still get in, and every episode then runs in turn."""
    n = 1100
    worker = RemoteEnvWorker.remote("code_sandbox", {"tasks": "procedural:levels=1;families=lists"}, 1, 100)
    try:
        ids = [f"e{i}" for i in range(n)]
        task = (await worker.sample_tasks.remote(1, 0))[0]
        await asyncio.gather(*(worker.reset.remote(e, task, 0) for e in ids))
        holders, others = ids[:2], ids[2:]
        assert all(not r[2] for r in await asyncio.gather(*(worker.step.remote(e, RUN) for e in holders)))

        async def episode(e: str) -> str:
            obs, *_ = await worker.step.remote(e, RUN)
            await worker.close.remote(e)
            return obs[0]["content"]

        t0 = time.monotonic()
        waiting = [asyncio.ensure_future(episode(e)) for e in others]
        await asyncio.sleep(3)  # every step sent and waiting for a sandbox
        await asyncio.wait_for(asyncio.gather(*(worker.close.remote(e) for e in holders)), 60)
        outputs = await asyncio.wait_for(asyncio.gather(*waiting), 300)
        assert all("1" in o for o in outputs), outputs[:3]
        print(f"{len(others)} episodes on 2 sandboxes in {time.monotonic() - t0:.1f} s")
    finally:
        await worker.shutdown.remote()
        ray.kill(worker)
