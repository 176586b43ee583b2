"""The ``redis-server`` a group of gateway processes shares when no ``[store] url`` is set: its own, on a Unix
socket in the group's private directory (mode 0700), nothing on disk, restarted if it dies (the processes'
heartbeats fill it again), ended with the supervisor (``pdgate.planes.multi``)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import shutil
import signal
from pathlib import Path
from typing import Any

from pdgate.core.config import ConfigError, StoreConfig

log = logging.getLogger("pdgate.multi")


def die_with_parent() -> None:
    """In a child before it runs its program: SIGTERM when the supervisor dies, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing: the store then outlives a killed supervisor)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


async def registered(store: StoreConfig) -> dict[str, dict[str, Any]] | None:
    """The live instances' registry entries in the store (None: it does not answer)."""
    from pdgate.store.redis import registry  # the redis client, only where a group runs

    return await registry(store)


class RedisServer:
    """One ``redis-server`` in ``directory``; ``store`` is the config that reaches it once started."""

    def __init__(self, directory: Path, store: StoreConfig, n: int) -> None:
        self.sock, self.log_file, self.n = directory / "redis.sock", directory / "redis.log", n
        self.store = dataclasses.replace(store, url=f"unix:{self.sock}")
        self.proc: asyncio.subprocess.Process | None = None
        self.stopping = False

    async def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise ConfigError("--workers", self.n, "the processes share their state through Redis: install "
                              "Debian's redis-server package (apt-get install redis-server), or set [store] url")
        # its banner and warnings go to a log file of its own, not the operator's console
        self.proc = await asyncio.create_subprocess_exec(
            exe, "--port", "0", "--unixsocket", str(self.sock), "--unixsocketperm", "700", "--save", "",
            "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning", "--logfile", str(self.log_file),
            stdin=asyncio.subprocess.DEVNULL, preexec_fn=die_with_parent)
        for _ in range(100):
            if await registered(self.store) is not None:
                return
            await asyncio.sleep(0.05)
        raise ConfigError("--workers", self.n, f"the group's redis-server did not answer on {self.sock}")

    async def watch(self) -> None:
        """Start it again whenever it exits, until ``stopping``."""
        while not self.stopping and self.proc is not None:
            rc = await self.proc.wait()
            if self.stopping:
                return
            log.warning("the group's redis-server exited with %s: started again (the processes fill it again)", rc)
            with contextlib.suppress(OSError):
                self.sock.unlink()
            await asyncio.sleep(0.5)
            if self.stopping:  # the group began to stop meanwhile (an operator's Ctrl-C reaches both at once)
                return
            with contextlib.suppress(ConfigError):
                await self.start()

    async def stop(self) -> None:
        self.stopping = True
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 5)
