"""A websocket client of a test server, like an open browser tab: it collects every message.

ComfyUI encodes a websocket message only when a client is connected, so tests of what the
server publishes (and of payloads that must never break its publisher) keep one open.
"""
from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid
from typing import Any, Callable

import aiohttp

JOIN_S = 30.0


class WsListener:
    def __init__(self, base_url: str) -> None:
        self.client_id = str(uuid.uuid4())  # prompts queued with it send this listener their messages
        self.url = base_url.replace("http://", "ws://") + f"/ws?clientId={self.client_id}"
        self.messages: queue.Queue[dict[str, Any]] = queue.Queue()
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._task: asyncio.Task | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ws-listener", daemon=True)

    def __enter__(self) -> "WsListener":
        self._thread.start()
        if not self._ready.wait(JOIN_S) or self.error is not None:
            raise RuntimeError(f"websocket did not connect: {self.error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(JOIN_S)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._task = self._loop.create_task(self._listen())
        try:
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        finally:
            self._loop.close()

    async def _listen(self) -> None:
        try:
            async with aiohttp.ClientSession() as session:
                async with session.ws_connect(self.url, max_msg_size=0) as ws:
                    self._ready.set()
                    async for msg in ws:
                        if msg.type == aiohttp.WSMsgType.TEXT:
                            self.messages.put(json.loads(msg.data))
            self.error = ConnectionError("the server closed the websocket")
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # surfaced by __enter__ or wait_for
            self.error = e
            self._ready.set()

    def drain(self) -> list[dict[str, Any]]:
        """Every message received so far."""
        out = []
        while True:
            try:
                out.append(self.messages.get_nowait())
            except queue.Empty:
                return out

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = JOIN_S,
                 what: str = "a websocket message") -> dict[str, Any]:
        """The first message (from now on) that satisfies predicate; AssertionError if none came."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                msg = self.messages.get(timeout=0.1)
            except queue.Empty:
                if self.error is not None:
                    raise AssertionError(f"websocket closed: {self.error!r}")
                continue
            if predicate(msg):
                return msg
        raise AssertionError(f"no {what} within {timeout:.0f} s")
