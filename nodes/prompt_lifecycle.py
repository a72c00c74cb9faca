"""Know when a prompt starts and ends, so models in use by a running prompt are never evicted.

ComfyUI 0.3.75 has no server-side prompt lifecycle hook. Every prompt, however it ends, is
closed by an `executing` message with `node: None` (sent by the prompt worker), and starts
with `execution_start`. Watching the server's outgoing messages is the one signal present in
all versions, so we wrap `send_sync` once, feature-detected, and pass every call through
unchanged.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)

_listeners: list[Callable[[str | None], None]] = []
_lock = threading.Lock()


def on_prompt_end(fn: Callable[[str | None], None]) -> None:
    """Call fn(prompt_id) after every prompt, whether it succeeded, failed or was interrupted."""
    with _lock:
        _listeners.append(fn)


def current_prompt_id() -> str | None:
    from server import PromptServer

    return getattr(PromptServer.instance, "last_prompt_id", None)


def _notify_end(prompt_id: str | None) -> None:
    with _lock:
        listeners = list(_listeners)
    for fn in listeners:
        try:
            fn(prompt_id)
        except Exception:
            log.exception("tiered offload: prompt-end listener failed")


def install() -> None:
    from server import PromptServer

    server = PromptServer.instance
    original = server.send_sync
    if getattr(original, "_tiered_offload_wrapped", False):
        return

    def send_sync(event, data, sid=None):
        original(event, data, sid)
        if event == "executing" and isinstance(data, dict) and data.get("node") is None:
            _notify_end(data.get("prompt_id"))

    send_sync._tiered_offload_wrapped = True
    server.send_sync = send_sync
