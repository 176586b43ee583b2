"""KV transfer over NIXL (UCX backend, DRAM), the pattern SGLang's NIXL connector uses.

The decode registers one DRAM buffer; for each request it takes a slot and sends, in the
handshake, its agent name and metadata and the slot's serialized descriptors. The prefill
adds the remote agent once, WRITEs the KV bytes with a notification that carries the
request header (room, first token, CRC), and polls ``check_xfer_state`` until DONE; the
decode polls its notifications and checks the CRC. Agents run with
``enable_prog_thread=False``: progress is driven from the worker's event loop.

What NIXL does when a peer dies or freezes is what the worker shows: a killed peer makes
``transfer()``/``check_xfer_state()`` raise (nixlRemoteDisconnectError) -> TransferFailed;
a frozen peer can leave the handle in PROC forever -> the request stays inflight.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from engine.sim.kv import TransferFailed, kv_payload

log = logging.getLogger("engine.sim.nixl")

try:  # optional extra: pip install --no-deps nixl nixl-cu12 numpy
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError:  # pragma: no cover - depends on the environment
    nixl_agent = None


def available() -> bool:
    return nixl_agent is not None


def _agent(name: str) -> Any:
    if nixl_agent is None:
        raise SystemExit("--transfer-backend nixl needs the nixl extra: pip install --no-deps nixl nixl-cu12 numpy")
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


async def _poll(check: Callable[[], bool]) -> None:
    """Drive progress from the event loop: spin a few times, then back off to 1 ms."""
    delay = 0.0
    while not check():
        await asyncio.sleep(delay)
        delay = min(0.001, delay * 2 or 0.0001)


class NixlSender:
    """Prefill side."""

    def __init__(self, name: str, buffer_bytes: int) -> None:
        self.agent = _agent(name)
        self.src = np.frombuffer(kv_payload(buffer_bytes, 0), dtype=np.uint8).copy()
        self.agent.register_memory([(self.src.ctypes.data, self.src.nbytes, 0, "")], "DRAM")
        self._remotes: dict[str, bytes] = {}  # agent name -> metadata it was added with

    def _remote(self, dest: dict[str, Any]) -> str:
        name, meta = dest["agent"], base64.b64decode(dest["metadata"])
        if self._remotes.get(name) != meta:
            if name in self._remotes:  # same name, new process: NIXL needs remove before add
                self.agent.remove_remote_agent(name)
            self.agent.add_remote_agent(meta)
            self._remotes[name] = meta
        return str(name)

    async def send(self, dest: dict[str, Any], header: dict[str, Any], payload: bytes) -> None:
        n = len(payload)
        if n > self.src.nbytes:
            raise TransferFailed(f"KV of {n} bytes exceeds the sender buffer ({self.src.nbytes})")
        view = memoryview(self.src)[:n]
        header = {**header, "nbytes": n, "crc": zlib.crc32(view)}
        handle = None
        try:
            peer = self._remote(dest)
            local = self.agent.get_xfer_descs([(self.src.ctypes.data, n, 0)], "DRAM")
            remote = self.agent.deserialize_descs(base64.b64decode(dest["descs"]))
            handle = self.agent.initialize_xfer("WRITE", local, remote, peer, orjson.dumps(header))
            state = self.agent.transfer(handle)
            if state == "ERR":
                raise TransferFailed("NIXL transfer() returned ERR")
            result: list[str] = []

            def done() -> bool:
                s = self.agent.check_xfer_state(handle)
                result.append(s)
                return bool(s in ("DONE", "ERR"))

            await _poll(done)
            if result[-1] == "ERR":
                raise TransferFailed("NIXL transfer state ERR")
        except TransferFailed:
            raise
        except Exception as exc:  # nixlRemoteDisconnectError and friends, from the C++ binding
            raise TransferFailed(f"NIXL transfer failed: {exc.__class__.__name__}: {exc}") from None
        finally:
            if handle is not None:
                try:
                    self.agent.release_xfer_handle(handle)
                except Exception:  # a handle to a dead peer may refuse release
                    log.debug("release_xfer_handle failed", exc_info=True)

    async def fail(self, dest: dict[str, Any], room: int, reason: str) -> None:
        """A failed room is not told over NIXL here: its decode waits out its own timeout."""

    def close(self) -> None:
        pass


class NixlReceiver:
    """Decode side: slots in one registered buffer; notifications delivered to waiting requests."""

    def __init__(self, name: str, buffer_bytes: int, deliver: Callable[[dict[str, Any]], bool],
                 before_data: Callable[[], Awaitable[None]], drop_ack: Callable[[], bool], crash: Callable[[], bool]) -> None:
        self.name = name
        self.agent = _agent(name)
        self.buf = np.zeros(buffer_bytes, dtype=np.uint8)
        self.agent.register_memory([(self.buf.ctypes.data, self.buf.nbytes, 0, "")], "DRAM")
        self.meta = _b64(self.agent.get_agent_metadata())
        self._deliver, self._before_data, self._drop, self._crash = deliver, before_data, drop_ack, crash
        self._slots: dict[int, tuple[int, int]] = {}  # room -> (offset, size)
        self._free = asyncio.Condition()
        self._waiting = asyncio.Event()  # set while some slot waits for its KV: poll only then
        self._poller: asyncio.Task[None] | None = None

    async def start(self, host: str) -> None:
        self._poller = asyncio.create_task(self._poll_notifs())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()

    def _find(self, size: int) -> int | None:
        off = 0
        for o, s in sorted(self._slots.values()):
            if o - off >= size:
                return off
            off = o + s
        return off if self.buf.nbytes - off >= size else None

    async def destination(self, room: int, size: int) -> dict[str, Any]:
        if size > self.buf.nbytes:
            raise TransferFailed(f"KV of {size} bytes exceeds the receive buffer ({self.buf.nbytes})")
        async with self._free:
            await self._free.wait_for(lambda: self._find(max(size, 1)) is not None)
            off = self._find(max(size, 1))
            assert off is not None
            self._slots[room] = (off, max(size, 1))
            self._waiting.set()
        descs = self.agent.get_xfer_descs([(self.buf.ctypes.data + off, max(size, 1), 0)], "DRAM")
        if self._crash():  # dies between handshake and transfer: the prefill sees a disconnected peer
            asyncio.get_running_loop().call_later(0.05, os._exit, 3)
        return {"backend": "nixl", "agent": self.name, "metadata": self.meta,
                "descs": _b64(self.agent.get_serialized_descs(descs))}

    async def release(self, room: int) -> None:
        async with self._free:
            self._slots.pop(room, None)
            if not self._slots:
                self._waiting.clear()
            self._free.notify_all()

    async def _poll_notifs(self) -> None:
        while True:
            await self._waiting.wait()
            await self._before_data()  # a frozen decode stops polling
            for msgs in self.agent.get_new_notifs().values():
                for raw in msgs:
                    self._on_notif(orjson.loads(raw))
            await asyncio.sleep(0.0005)

    def _on_notif(self, header: dict[str, Any]) -> None:
        slot = self._slots.get(header.get("room", -1))
        if slot is None:
            return
        off, _ = slot
        data = memoryview(self.buf)[off : off + header["nbytes"]]
        if zlib.crc32(data) != header["crc"]:
            log.error("KV for room %s failed its CRC check", header.get("room"))
            return
        if self._drop():
            log.warning("fault ack_loss: dropped the transfer-done notification for room %s", header.get("room"))
            return
        self._deliver(header)
