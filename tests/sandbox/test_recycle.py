"""Reusing a sandbox after a recycle that proves it clean (SandboxPool(reuse=N)), against real containers (and real
bubblewrap sandboxes for the recycle itself)."""

from __future__ import annotations

import pytest

from agentrl.sandbox import DockerSandbox, LocalSandbox, SandboxPool

# What an episode's program could leave for the next one, in every place the sandbox user can write.
LEAVE_BEHIND = r"""
import ctypes, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
os.makedirs("/work/a/b/c"); open("/work/a/b/c/f.txt", "w").write("x")
os.makedirs("/work/locked/inner"); os.chmod("/work/locked", 0)
os.symlink("/etc/passwd", "/work/link"); os.mkfifo("/tmp/fifo")
open("/tmp/note", "w").write("the answer"); open("/dev/shm/seg", "w").write("s")
assert libc.shmget(1234, 4096, 0o1000 | 0o600) >= 0 and libc.msgget(5678, 0o1000 | 0o600) >= 0
assert libc.semget(91011, 1, 0o1000 | 0o600) >= 0
assert ctypes.CDLL("librt.so.1").mq_open(b"/q", 0o100 | 2, 0o600, None) >= 0
subprocess.Popen(["sleep", "300"], start_new_session=True)
print("left")
"""
CHECK = "ls -A /work /tmp /dev/shm /dev/mqueue; tail -n +2 /proc/sysvipc/shm /proc/sysvipc/msg /proc/sysvipc/sem"
EMPTY = "/dev/mqueue:\n\n/dev/shm:\n\n/tmp:\n\n/work:\n"


async def test_a_recycled_sandbox_is_as_new(isolating_factory):
    """The same recycle on both backends that isolate."""
    async with SandboxPool(isolating_factory, size=1, reuse=3) as pool:
        async with pool.sandbox() as sb:
            first = sb.name
            r = await sb.run_python(LEAVE_BEHIND)
            assert r.stdout == "left\n", r.stderr
            await sb.run_cell("x = 41")
            dirty = await sb.run(["sh", "-c", CHECK])
            assert "note" in dirty.stdout and "1234" in dirty.stdout and "q" in dirty.stdout
        async with pool.sandbox() as sb:
            assert sb.name == first, "the same container, recycled"
            clean = await sb.run(["sh", "-c", CHECK + "; for p in /proc/[0-9]*; do cat $p/cmdline; echo; done"])
            assert clean.stdout.startswith(EMPTY), clean.stdout
            assert not any(key in clean.stdout for key in ("1234", "5678", "91011")), "IPC objects removed"
            assert "sleep" not in clean.stdout, "no process of the last episode left"
            assert "NameError" in (await sb.run_cell("x")).stderr  # the interpreter started over
        assert pool.stats["recycled"] == 1 and pool.stats["started"] == 1


async def test_the_work_dir_itself_is_left_as_new(isolating_factory):
    """A recycle empties /work but keeps the place: what its last episode could set on it (mode, extended attributes:
    any bytes) must not reach the next."""
    mark = (
        "import os\nfor f in (lambda: os.chmod('/work', 0o1777), lambda: os.setxattr('/work', 'user.note', b'hi')):\n"
        "    try:\n        f()\n    except OSError:\n        pass\n"
    )
    look = "import os; print(oct(os.stat('/work').st_mode), os.listxattr('/work'))"
    async with SandboxPool(isolating_factory, size=1, reuse=1) as pool:
        async with pool.sandbox() as sb:
            new = (await sb.run_python(look)).stdout
            assert (await sb.run_python(mark)).ok
        async with pool.sandbox() as again:
            assert again is sb and (await again.run_python(look)).stdout == new


async def test_what_cannot_be_proven_clean_is_discarded(isolating_factory):
    async with SandboxPool(isolating_factory, size=1, reuse=3) as pool:
        async with pool.sandbox() as sb:
            first = sb.name
            # nested deeper than the recycler descends: it cannot show the place empty
            await sb.run_python("import os\nos.makedirs('/work/' + '/'.join(['d'] * 300))")
        async with pool.sandbox() as sb:
            assert sb.name != first
            assert (await sb.run(["ls", "-A", "/work"])).stdout == ""
        assert pool.stats["recycled"] == 0 and pool.stats["discarded"] >= 1


@pytest.mark.docker
async def test_reuse_is_bounded(sandbox_image):
    async with SandboxPool(DockerSandbox.create, size=1, reuse=2) as pool:
        names = []
        for _ in range(4):
            async with pool.sandbox() as sb:
                names.append(sb.name)
        assert names[0] == names[1] == names[2] != names[3]  # the first served 1 + 2 episodes


async def test_a_local_sandbox_recycles_its_own_dirs():
    async with SandboxPool(LocalSandbox.create, size=1, reuse=1) as pool:
        async with pool.sandbox() as sb:
            await sb.write_file("left.txt", "x")
            await sb.run_python("import os; os.makedirs(os.environ['TMPDIR'] + '/t/u')")
        async with pool.sandbox() as sb2:
            assert sb2 is sb
            with pytest.raises(FileNotFoundError):
                await sb2.read_file("left.txt")
            assert (await sb2.run_python("import os; print(os.listdir(os.environ['TMPDIR']))")).stdout == "[]\n"


@pytest.mark.docker
async def test_with_reuse_the_pool_holds_size_containers_under_load(sandbox_image):
    """More episodes at once than `size`: they wait for recycled sandboxes instead of starting new ones."""
    import asyncio

    async with SandboxPool(DockerSandbox.create, size=2, reuse=100, patience_s=60) as pool:

        async def episode(i: int) -> str:
            async with pool.sandbox() as sb:
                return (await sb.run_python(f"print({i})")).stdout

        outs = await asyncio.gather(*(episode(i) for i in range(12)))
        assert outs == [f"{i}\n" for i in range(12)]
        while pool._starting:  # the last two are on their way back
            await asyncio.sleep(0.01)
        assert pool.stats["started"] == 2 and pool.stats["recycled"] == 12


@pytest.mark.docker
async def test_a_sandbox_held_for_long_does_not_starve_the_others(sandbox_image):
    """A parked episode keeps its sandbox until the next iteration; an episode that needs one meanwhile
    gets another started after `patience_s`, and the surplus is discarded on return."""
    import asyncio

    async with SandboxPool(DockerSandbox.create, size=1, reuse=100, patience_s=0.5) as pool:
        held = await pool.acquire()
        other = await asyncio.wait_for(pool.acquire(), 60)
        assert other is not held and (await other.run_python("print(2)")).stdout == "2\n"
        await pool.release(other)
        await pool.release(held)
        while pool._starting or pool._tasks:
            await asyncio.sleep(0.01)
        assert pool.stats["started"] == 2 and pool.stats["recycled"] == 1 and pool.stats["discarded"] == 1
        assert len(pool._idle) == 1


@pytest.mark.docker
async def test_a_busy_pool_does_not_grow_a_sandbox_per_waiter(sandbox_image):
    """Twelve episodes on two sandboxes, each held longer than a waiter's patience... but they keep coming
    back, so the waiters wait: no container is started beyond the pool's two."""
    import asyncio

    async with SandboxPool(DockerSandbox.create, size=2, reuse=100, patience_s=1.0) as pool:

        async def episode() -> str:
            async with pool.sandbox() as sb:
                await asyncio.sleep(0.4)
                return (await sb.run_python("print(1)")).stdout

        assert await asyncio.wait_for(asyncio.gather(*(episode() for _ in range(12))), 120) == ["1\n"] * 12
        assert pool.stats["started"] == 2 and pool.stats["discarded"] == 0


@pytest.mark.slow  # the fast tier grows a busy pool above
@pytest.mark.docker
async def test_a_starved_pool_grows_no_further_than_max_size(sandbox_image):
    """Six episodes that each hold their sandbox far past the waiters' patience (an engine slow to write
    the next turn): the pool starts extra containers, but never has more than `max_size` alive; the
    waiters past it wait for a return, and every episode still runs."""
    import asyncio

    async with SandboxPool(DockerSandbox.create, size=1, reuse=100, patience_s=0.3, max_size=2) as pool:

        async def episode() -> str:
            async with pool.sandbox() as sb:
                await asyncio.sleep(1.5)
                return (await sb.run_python("print(1)")).stdout

        assert await asyncio.wait_for(asyncio.gather(*(episode() for _ in range(6))), 120) == ["1\n"] * 6
        assert pool.stats["started"] >= 2, "a starved waiter gets a container past size"
        assert pool.stats["peak"] == 2, pool.stats
