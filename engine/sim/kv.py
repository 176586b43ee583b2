"""KV-cache transfer between a prefill and a decode worker over TCP (asyncio streams).

Connections are pooled per decode receiver (as transfer engines keep theirs open); one
transfer at a time per connection. Prefill sends a JSON header line, then ``nbytes`` of KV
data; decode checks the CRC, hands the data to the waiting request and answers ``OK``.
Failure cases match what NIXL shows (reference/peers.md): a peer that dies resets the
connection (the sender fails within milliseconds); a peer that freezes with its socket
open never acknowledges (the sender waits forever unless something above it gives up).
"""

from __future__ import annotations

import asyncio
import logging
import os
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

log = logging.getLogger("engine.sim.kv")

ACK = b"OK\n"
NACK = b"NO\n"
_CHUNK = 1 << 20


class TransferFailed(Exception):
    """The KV transfer cannot complete (reset, refused, negative acknowledgement)."""


def kv_payload(nbytes: int, seed: int) -> bytes:
    """Deterministic KV bytes (a repeated 4 KiB block derived from ``seed``)."""
    block = zlib.crc32(seed.to_bytes(8, "little")).to_bytes(4, "little") * 1024
    reps, rest = divmod(nbytes, len(block))
    return block * reps + block[:rest]


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class KVSender:
    """Prefill side: a pool of idle connections per decode receiver."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[Conn]] = {}

    async def send(self, dest: dict[str, Any], header: dict[str, Any], payload: bytes) -> None:
        """Send one request's KV bytes to ``dest`` and wait for the acknowledgement."""
        key = (dest["host"], int(dest["port"]))
        idle = self._idle.setdefault(key, [])
        fresh = not idle
        try:
            reader, writer = idle.pop() if idle else await asyncio.open_connection(*key)
        except OSError as exc:
            raise TransferFailed(f"connect to decode KV receiver failed: {exc}") from exc
        ok = False
        try:
            header = {**header, "nbytes": len(payload), "crc": zlib.crc32(payload)}
            writer.write(orjson.dumps(header) + b"\n")
            view = memoryview(payload)
            for off in range(0, len(view), _CHUNK):
                writer.write(view[off : off + _CHUNK])
                await writer.drain()
            await writer.drain()
            line = await reader.readline()
            ok = line == ACK
        except (OSError, asyncio.IncompleteReadError) as exc:
            if not fresh:  # a pooled connection the peer closed (it restarted): drop the pool, say why
                self.drop(key)
            raise TransferFailed(f"KV transfer broke: {exc!r}") from exc
        finally:
            if ok:
                idle.append((reader, writer))
            else:
                writer.close()
        if not ok:
            raise TransferFailed(f"decode refused the KV transfer ({line!r})")

    async def fail(self, dest: dict[str, Any], room: int, reason: str) -> None:
        """Tell the decode at ``dest`` that ``room``'s transfer failed on this side (best effort)."""
        if dest.get("backend") != "tcp":
            return
        try:
            reader, writer = await asyncio.open_connection(dest["host"], int(dest["port"]))
        except OSError:
            return
        try:
            writer.write(orjson.dumps({"room": room, "failed": reason[:200], "nbytes": 0, "crc": zlib.crc32(b"")})
                         + b"\n")
            await writer.drain()
            await reader.readline()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def drop(self, key: tuple[str, int]) -> None:
        for _, w in self._idle.pop(key, []):
            w.close()

    def close(self) -> None:
        for key in list(self._idle):
            self.drop(key)


Deliver = Callable[[dict[str, Any]], bool]


class KVReceiver:
    """Decode side: accepts KV transfers and hands them to waiting requests."""

    def __init__(
        self,
        deliver: Deliver,
        before_data: Callable[[], Awaitable[None]],
        drop_ack: Callable[[], bool],
        crash: Callable[[], bool],
    ) -> None:
        self._deliver = deliver
        self._before_data = before_data
        self._drop_ack = drop_ack
        self._crash = crash
        self._server: asyncio.Server | None = None
        self.host = "127.0.0.1"
        self.port = 0

    async def start(self, host: str) -> None:
        self._server = await asyncio.start_server(self._handle, host, 0)
        self.host = host
        self.port = self._server.sockets[0].getsockname()[1]

    async def destination(self, room: int, size: int) -> dict[str, Any]:
        """Where the prefill sends this room's KV (one listener for all rooms)."""
        return {"backend": "tcp", "host": self.host, "port": self.port}

    async def release(self, room: int) -> None:
        return None

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                header = orjson.loads(line)
                if self._crash():
                    log.error("fault decode_crash: exiting mid-transfer (room %s)", header.get("room"))
                    os._exit(3)
                await self._before_data()  # a frozen decode stops reading here, socket open
                data = await reader.readexactly(header["nbytes"])
                ok = zlib.crc32(data) == header["crc"] and self._deliver(header)
                if ok and self._drop_ack():
                    await reader.read()  # hold the connection, never acknowledge
                    return
                writer.write(ACK if ok else NACK)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError, orjson.JSONDecodeError, KeyError):
            pass
        finally:
            writer.close()
