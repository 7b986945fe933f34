"""SandboxPool against real containers: warm hand-out, discard and refill, dead-container
replacement, an external `docker kill` mid-call, and start failures that do not hang."""

from __future__ import annotations

import asyncio
import time

import pytest

from agentrl.sandbox import (
    BwrapSandbox,
    CallLimits,
    DockerSandbox,
    DockerSandboxConfig,
    SandboxConfig,
    SandboxError,
    SandboxPool,
    Status,
)

CFG = DockerSandboxConfig(limits=CallLimits(timeout_s=30))


def factory():
    return DockerSandbox.create(CFG)


async def settle(pool: SandboxPool) -> None:
    while pool._starting or len(pool._idle) < pool.size:
        await asyncio.sleep(0.02)


@pytest.mark.docker
async def test_warm_pool_hands_out_fresh_sandboxes(sandbox_image, docker_client):
    async with SandboxPool(factory, size=2) as pool:
        sb = await pool.acquire()
        await sb.write_file("left.txt", "secret")
        name = sb.name
        await pool.release(sb)
        await settle(pool)
        seen = set()
        for _ in range(3):
            async with pool.sandbox() as other:
                seen.add(other.name)
                with pytest.raises(FileNotFoundError):
                    await other.read_file("left.txt")  # never a used container
        assert name not in seen and len(seen) == 3
        await settle(pool)
        assert pool.stats["started"] >= 5 and len(pool._idle) == 2
    assert not docker_client.containers.list(all=True, filters={"name": name})


@pytest.mark.docker
async def test_docker_kill_mid_call_is_an_infrastructure_error(sandbox_image, docker_client):
    async with SandboxPool(factory, size=1) as pool:
        sb = await pool.acquire()
        call = asyncio.create_task(sb.run_python("import time; time.sleep(20)"))
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        await asyncio.to_thread(docker_client.containers.get(sb.name).kill)
        with pytest.raises(SandboxError, match=r"container (exited|vanished)"):
            await call
        assert time.monotonic() - t0 < 5
        with pytest.raises(SandboxError, match="failed earlier"):  # never an exit code later either
            await sb.run_python("print(1)")
        assert not await sb.healthy()
        await pool.release(sb)
        async with pool.sandbox() as fresh:  # the pool goes on serving
            r = await fresh.run_python("print('still serving')")
            assert (r.status, r.stdout) == (Status.OK, "still serving\n")


@pytest.mark.docker
async def test_dead_idle_sandbox_is_replaced(sandbox_image, docker_client):
    async with SandboxPool(factory, size=1, health_interval_s=0.2) as pool:
        victim = pool._idle[0]
        await asyncio.to_thread(docker_client.containers.get(victim.name).kill)
        async with pool.sandbox() as sb:
            assert sb is not victim
            assert (await sb.run_python("print(2)")).stdout == "2\n"
        assert pool.stats["replaced_dead"] == 1


@pytest.mark.docker
async def test_failing_starts_raise_instead_of_hanging(sandbox_image):
    bad = DockerSandboxConfig(image="agentrl-no-such-image:0")
    pool = SandboxPool(lambda: DockerSandbox.create(bad), size=2)
    with pytest.raises(SandboxError, match=r"no sandbox could be started.*not found"):
        await pool.start()
    with pytest.raises(SandboxError, match="fail to start"):
        await asyncio.wait_for(pool.acquire(), 10)
    await pool.close()


async def test_a_bwrap_sandbox_killed_mid_call_is_an_infrastructure_error(bwrap_site):
    """The sandbox dies (its bubblewrap killed): the call raises SandboxError at once, the pool goes on serving, and
    nothing of the dead sandbox stays (its cgroup emptied and removed, its folder gone)."""
    async with SandboxPool(SandboxConfig(backend="bwrap"), size=1) as pool:  # the pool reads the sandbox setting
        sb = await pool.acquire()
        assert isinstance(sb, BwrapSandbox)
        call = asyncio.create_task(sb.run_python("import time; time.sleep(20)"))
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        sb.proc.kill()
        with pytest.raises(SandboxError, match=r"sandbox exited \(bubblewrap exit status -9\)"):
            await call
        assert time.monotonic() - t0 < 5
        assert not await sb.healthy()
        await pool.release(sb)
        async with pool.sandbox() as fresh:
            r = await fresh.run_python("print('still serving')")
            assert (r.status, r.stdout) == (Status.OK, "still serving\n")
        await settle(pool)
        assert not sb.tree.exists() and not any(d.exists() for d in sb.cgroup.dirs.values())


def test_pool_size_must_be_positive():
    with pytest.raises(ValueError, match="pool size"):
        SandboxPool(factory, size=0)
