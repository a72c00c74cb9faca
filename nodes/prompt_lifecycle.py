"""Know when a prompt starts and ends, so models in use by a running prompt are never evicted.

ComfyUI 0.3.75 has no server-side prompt lifecycle hook. Every prompt starts with an
`execution_start` message (sent before any node runs or any cache is checked) and, however it
ends, is closed by an `executing` message with `node: None` (sent by the prompt worker).
Watching the server's outgoing messages is the one signal present in all versions, so we wrap
`send_sync` once and pass every call through unchanged. At the start, the running prompt's graph
is read from the queue's `currently_running` entries (feature-detected).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)

_listeners: list[Callable[[str | None], None]] = []
_start_listeners: list[Callable[[str, dict], None]] = []
_lock = threading.Lock()


def on_prompt_start(fn: Callable[[str, dict], None]) -> None:
    """Call fn(prompt_id, prompt_graph) before a prompt's first node runs."""
    with _lock:
        _start_listeners.append(fn)


def on_prompt_end(fn: Callable[[str | None], None]) -> None:
    """Call fn(prompt_id) after every prompt, whether it succeeded, failed or was interrupted."""
    with _lock:
        _listeners.append(fn)


def current_prompt_id() -> str | None:
    from server import PromptServer

    return getattr(PromptServer.instance, "last_prompt_id", None)


def _notify(listeners: list[Callable], *args) -> None:
    with _lock:
        listeners = list(listeners)
    for fn in listeners:
        try:
            fn(*args)
        except Exception:
            log.exception("tiered offload: prompt lifecycle listener failed")


def _running_graph(server, prompt_id: str) -> dict | None:
    """The API-format graph of the running prompt, from the queue's running entries."""
    running = getattr(getattr(server, "prompt_queue", None), "currently_running", None)
    if not isinstance(running, dict):
        return None
    for item in list(running.values()):
        if isinstance(item, (tuple, list)) and len(item) > 2 and item[1] == prompt_id \
                and isinstance(item[2], dict):
            return item[2]
    return None


def install() -> None:
    from server import PromptServer

    server = PromptServer.instance
    original = server.send_sync
    if getattr(original, "_tiered_offload_wrapped", False):
        return

    def send_sync(event, data, sid=None):
        if event == "execution_start" and isinstance(data, dict):
            graph = _running_graph(server, data.get("prompt_id"))
            if graph is not None:
                _notify(_start_listeners, data.get("prompt_id"), graph)
        original(event, data, sid)
        if event == "executing" and isinstance(data, dict) and data.get("node") is None:
            _notify(_listeners, data.get("prompt_id"))

    send_sync._tiered_offload_wrapped = True
    server.send_sync = send_sync
