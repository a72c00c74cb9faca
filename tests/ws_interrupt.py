"""Interrupt a prompt at an exact point of its progress, seen on ComfyUI's websocket.

ComfyUI reports every `comfy.utils.ProgressBar` update as a "progress" message to the prompt's
client, and checks for an interrupt on the next update. Interrupting right after a chosen message
therefore stops the prompt inside the step that message belongs to, without timing guesses.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from typing import Callable

import aiohttp

ENDS = ("execution_success", "execution_error", "execution_interrupted")


def queue_and_interrupt(url: str, workflow: dict, when: Callable[[dict], bool],
                        timeout: float = 300) -> tuple[str, bool]:
    """Queue ``workflow`` and POST /interrupt right after the first progress message for which
    ``when(data)`` is true. Returns (prompt id, whether the interrupt was sent)."""
    return asyncio.run(asyncio.wait_for(_run(url, workflow, when), timeout))


async def _run(url: str, workflow: dict, when: Callable[[dict], bool]) -> tuple[str, bool]:
    client_id = str(uuid.uuid4())
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{url}/ws?clientId={client_id}") as ws:
            async with session.post(f"{url}/prompt",
                                    json={"prompt": workflow, "client_id": client_id}) as resp:
                body = await resp.json()
                assert resp.status == 200, body
                prompt_id = body["prompt_id"]
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    continue
                event = json.loads(msg.data)
                data = event.get("data") or {}
                if event.get("type") == "progress" and data.get("prompt_id") == prompt_id \
                        and when(data):
                    async with session.post(f"{url}/interrupt", json={}) as resp:
                        assert resp.status == 200
                    return prompt_id, True
                if event.get("type") in ENDS and data.get("prompt_id") == prompt_id:
                    return prompt_id, False
    raise AssertionError("the websocket closed before the prompt ended")
