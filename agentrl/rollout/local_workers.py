"""Env workers as processes of the driver, without a Ray runtime (`rollout.env_workers: local`).

A worker is a Python process running `main()` here with FD as its argument: an asyncio loop hosting one `EnvWorker`
(`agentrl.rollout.workers`), started by `LocalEnvWorkerPool` (`agentrl.rollout.pool`) with one end of a Unix
socket pair as FD. Both ends speak frames, a 4-byte length and then a pickle (the driver and its own child, one
user and one checkout): first the `EnvWorker`'s arguments, then requests (id, method, args), each run as a task of
its own, so that one worker serves every episode in flight at once, each answered when it is done, in any order,
with (id, True, value) or (id, False, the error in one line).

The driver alone holds the other end: however it ends (SIGKILL too), the worker reads EOF, closes its envs and its
sandbox pool, and exits, so no worker outlives its driver and no sandbox its worker. A worker killed outright is
covered by its backend: bwrap sandboxes die with it (--die-with-parent), Docker's watchdog removes its containers
(`SandboxConfig.watch`), and the pool removes what is left once its process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import socket
import struct
import sys
from typing import Any

from agentrl.rollout.workers import EnvWorker

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("!I")
SHUTDOWN_S = 60.0
"""how long a worker whose driver is gone may take to close its envs and sandboxes before it exits anyway"""


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next frame's object; `asyncio.IncompleteReadError` at the end of the stream."""
    (n,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    return pickle.loads(await reader.readexactly(n))


def write_frame(writer: asyncio.StreamWriter, obj: Any) -> None:
    """Queue one frame: a single write, so frames of concurrent tasks never interleave."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(_LENGTH.pack(len(data)) + data)


async def serve(fd: int) -> None:
    """Host an `EnvWorker` for the driver at the other end of socket `fd` until that end closes."""
    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)  # the sandboxes this worker starts must not hold the driver's line open
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    worker = EnvWorker(*await read_frame(reader))
    calls: set[asyncio.Task] = set()

    async def answer(call_id: int, method: str, args: tuple) -> None:
        try:
            reply = (call_id, True, await getattr(worker, method)(*args))
        except Exception as e:  # the env's error, for the driver's WorkerError
            reply = (call_id, False, f"{type(e).__name__}: {e}")
        except asyncio.CancelledError as e:
            if asyncio.current_task().cancelling():  # the worker is shutting down: nobody awaits the answer
                raise
            # raised by the env's own code (a timeout of its own, say): unanswered, the driver would wait forever
            reply = (call_id, False, f"CancelledError raised in {method}: {e}")
        try:
            write_frame(writer, reply)
        except Exception as e:  # a value that does not pickle
            write_frame(writer, (call_id, False, f"{method}'s answer cannot be sent: {type(e).__name__}: {e}"))
        with contextlib.suppress(ConnectionError):  # the driver is gone: the loop below ends
            await writer.drain()

    try:
        while True:
            try:
                call_id, method, args = await read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                break  # the driver closed its end, or died
            task = asyncio.create_task(answer(call_id, method, args))
            calls.add(task)
            task.add_done_callback(calls.discard)
    finally:
        for task in calls:
            task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        try:
            await asyncio.wait_for(worker.shutdown(), SHUTDOWN_S)
        except Exception as e:  # exit anyway: the backend's own clean-up (atexit, watchdog, orphans) covers the rest
            log.warning("env worker: its sandboxes did not all close (%s: %s)", type(e).__name__, e)
        writer.close()


def main() -> None:
    """A worker process's entry point (`python -c`, not `-m`: the package imports this module before `-m` would run
    it); sys.argv[1] is its end of the socket pair."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(int(sys.argv[1])))
