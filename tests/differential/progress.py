"""Run one prompt while watching its progress websocket, and interrupt it at a chosen moment.

ComfyUI sends `progress` messages ({value, max, node, prompt_id}) only to the client that queued
the prompt, so the watcher connects with its own client id before queueing. Apply Layerwise
Offload reports its packing through a progress bar on the sampler node that counts blocks (its
total is the block count, or one more where the bar also counts the final step), which is how
"interrupt while packing" is timed; sampling reports one step per sampler step.
The interrupt names the prompt, so it can never hit the next prompt.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, Callable

import aiohttp

from comfy_server import ComfyServer

Predicate = Callable[[dict[str, Any]], bool]
DONE = {"execution_success", "execution_error", "execution_interrupted"}


def packing(blocks: int) -> Predicate:
    """The engine has packed at least one, but not every, block of a model with `blocks` blocks."""
    return lambda data: data.get("max") in (blocks, blocks + 1) and 1 <= data.get("value", 0) < blocks


def first_progress(data: dict[str, Any]) -> bool:
    """Any node reported progress: the sampler is packing or sampling."""
    return data.get("value", 0) >= 1


async def _watch(server: ComfyServer, workflow: dict, when: Predicate, timeout: float
                 ) -> tuple[str | None, dict[str, Any]]:
    client_id = str(uuid.uuid4())
    ws_url = server.url.replace("http://", "ws://") + f"/ws?clientId={client_id}"
    record: dict[str, Any] = {"requested": False}
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(ws_url, heartbeat=30) as ws:
            status, resp = await asyncio.to_thread(
                server.request, "POST", "/prompt", {"prompt": workflow, "client_id": client_id})
            if status != 200:
                return None, {"rejected": resp}
            prompt_id = resp["prompt_id"]
            record["node_errors"] = resp.get("node_errors") or {}

            async def read() -> None:
                async for msg in ws:
                    if msg.type != aiohttp.WSMsgType.TEXT:
                        continue
                    event = json.loads(msg.data)
                    kind, data = event.get("type"), event.get("data") or {}
                    if data.get("prompt_id") not in (None, prompt_id):
                        continue
                    if kind == "progress" and not record["requested"] and when(data):
                        record.update(requested=True, at=data)
                        await asyncio.to_thread(server.request, "POST", "/interrupt",
                                                {"prompt_id": prompt_id})
                    if kind in DONE or (kind == "executing" and data.get("node") is None
                                        and data.get("prompt_id") == prompt_id):
                        return

            try:
                await asyncio.wait_for(read(), timeout)
            except asyncio.TimeoutError:
                record["watch_timed_out"] = True
    return prompt_id, record


def run_with_interrupt(server: ComfyServer, workflow: dict, when: Predicate, timeout: float = 600
                       ) -> tuple[str | None, dict[str, Any]]:
    """Queue `workflow`, interrupt it at the first progress message `when` accepts; return the
    prompt id (None if /prompt rejected it) and what happened. The caller reads /history."""
    return asyncio.run(_watch(server, workflow, when, timeout))
