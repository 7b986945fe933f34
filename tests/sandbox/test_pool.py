"""SandboxPool against real containers: warm hand-out, discard and refill, dead-container
replacement, an external `docker kill` mid-call, start failures that do not hang or leak, and leases
given back twice."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from agentrl.sandbox import (
    BwrapSandbox,
    CallLimits,
    DockerSandbox,
    DockerSandboxConfig,
    LocalSandbox,
    SandboxConfig,
    SandboxError,
    SandboxPool,
    Status,
    reaper,
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


def containers_of_this_process(client) -> set[str]:
    # ignore_removed: the list inspects each container, and one may be removed between the two (the test waits for it)
    labels = {"label": f"{reaper.PID_LABEL}={os.getpid()}"}
    return {c.name for c in client.containers.list(all=True, filters=labels, ignore_removed=True)}


@pytest.mark.docker
async def test_a_container_that_fails_to_start_is_removed(sandbox_image, docker_client):
    """Made but not started (here: a network that does not exist, as an OCI runtime error would): removed, not left
    behind at every retry of the pool's."""
    before = containers_of_this_process(docker_client)
    with pytest.raises(SandboxError, match="could not start a sandbox container"):
        await DockerSandbox.create(DockerSandboxConfig(network="container:agentrl-no-such-container"))
    assert containers_of_this_process(docker_client) == before


@pytest.mark.docker
async def test_a_cancelled_start_leaves_no_container(sandbox_image, docker_client):
    """The caller of a start is cancelled (an episode past its limit making a sandbox to grade in): the container the
    start goes on making is removed once it is up, not left running until the process exits."""
    before = containers_of_this_process(docker_client)
    start = asyncio.create_task(DockerSandbox.create(CFG))
    await asyncio.sleep(0)  # its thread has begun
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    made: set[str] = set()
    deadline = time.monotonic() + 60
    while not made or containers_of_this_process(docker_client) - before:
        made |= containers_of_this_process(docker_client) - before
        assert time.monotonic() < deadline, f"left running: {made}"
        await asyncio.sleep(0.02)


async def test_a_sandbox_given_back_twice_is_leased_once():
    """A second release of one lease is left alone: two recycles would put the sandbox in the pool twice, and two
    waiters would then share it."""
    gate = asyncio.Event()
    starts = 0

    async def factory():  # real sandboxes; the starts after the first wait for the gate (a loaded machine)
        nonlocal starts
        starts += 1
        if starts > 1:
            await gate.wait()
        return await LocalSandbox.create()

    async with SandboxPool(factory, size=1, reuse=5, patience_s=0.1, max_size=4) as pool:
        first = await pool.acquire()
        waiter = asyncio.create_task(pool.acquire())
        while not pool._starved:  # past its patience: a start is on its way for it
            await asyncio.sleep(0.01)
        await pool.release(first)
        await pool.release(first)
        gate.set()
        a = await waiter
        b = await asyncio.wait_for(pool.acquire(), 30)
        assert a is not b and pool.stats["recycled"] == 1
        await pool.release(a)
        await pool.release(b)


async def test_a_sandbox_given_back_goes_to_a_waiter():
    """A clean sandbox comes back while an episode waits (not yet past its patience) for one: it is recycled for
    it, not discarded to have the waiter start another."""
    async with SandboxPool(LocalSandbox.create, size=1, reuse=5, patience_s=0.3) as pool:
        a = await pool.acquire()
        b = await pool.acquire()  # past its patience: started for it
        waiter = asyncio.create_task(pool.acquire())
        await asyncio.sleep(0.05)
        await pool.release(a)
        assert await asyncio.wait_for(waiter, 30) is a
        assert (pool.stats["started"], pool.stats["discarded"]) == (2, 0)
        await pool.release(a)
        await pool.release(b)
