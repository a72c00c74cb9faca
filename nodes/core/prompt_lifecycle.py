"""Know when a prompt starts and ends, so models in use by a running prompt are never evicted.

ComfyUI has no server-side prompt lifecycle hook, and its `execution_start` / `executing(None)`
messages go only to prompts queued with a `client_id` (core's own API example sends none). The
execution itself is visible in every version through the prompt queue the worker thread drives
(`main.py: prompt_worker`, 0.3.75 to 0.33): `get()` hands out the next prompt before any node runs
or any cache is checked, and `task_done()` is called once for it however it ended (success, error,
interrupt), before the next `get()`. We wrap those two methods on the queue instance, feature-
detected, and call the listeners from the worker thread: start listeners after `get()` returns a
prompt, end listeners before `task_done()` records it, so by the time `/history` shows a prompt
finished, its models are released.

Where the queue lacks those methods, the fallback watches the server's outgoing messages, which
sees only prompts queued with a `client_id`; a warning says so.

The same two points keep the panel's moves out of a prompt's way (`between_prompts`): core's
model management (`current_loaded_models`, its free-memory decisions) is written for the prompt
worker's thread alone, and a load from a REST worker thread while a prompt samples could make
core unload the very model that prompt runs on. A move is refused while a prompt runs, and a
prompt waits at its start for a move already under way to finish.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

from ...offload_core.models.tier_errors import TierError
from . import host_sharing

log = logging.getLogger(__name__)

_end_listeners: list[Callable[[str | None], None]] = []
_start_listeners: list[Callable[[str, dict], None]] = []
_lock = threading.Lock()
_running: dict[str, Any] = {"prompt_id": None, "graph": None}


class PromptRunningError(TierError):
    """A move that calls into core's model management was asked for while a prompt runs."""


class _Gate:
    """Moves from outside the prompt worker and prompts take turns (see the module's notes)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._moves = 0
        self._prompt = False

    @contextmanager
    def between_prompts(self, what: str) -> Iterator[None]:
        """Context for a move made outside the prompt worker (REST): PromptRunningError while a
        prompt runs; a prompt that starts meanwhile waits until the move is done."""
        with self._cond:
            if self._prompt or _queue_is_running():
                raise PromptRunningError(f"a prompt is running; {what} is done between prompts only: "
                                         "try again when it ends")
            self._moves += 1
        try:
            yield
        finally:
            with self._cond:
                self._moves -= 1
                self._cond.notify_all()

    def prompt_started(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._moves == 0)
            self._prompt = True

    def prompt_ended(self) -> None:
        with self._cond:
            self._prompt = False


_GATE = _Gate()
between_prompts = _GATE.between_prompts


def _queue_is_running() -> bool:
    """Whether core's queue has handed out a prompt (it may not have reached our hook yet)."""
    from server import PromptServer

    running = getattr(getattr(PromptServer.instance, "prompt_queue", None), "currently_running", None)
    return bool(running) if isinstance(running, dict) else False


def on_prompt_start(fn: Callable[[str, dict], None]) -> None:
    """Call fn(prompt_id, prompt_graph) before a prompt's first node runs."""
    with _lock:
        _start_listeners.append(fn)


def on_prompt_end(fn: Callable[[str | None], None]) -> None:
    """Call fn(prompt_id) after every prompt, whether it succeeded, failed or was interrupted."""
    with _lock:
        _end_listeners.append(fn)


def current_prompt_id() -> str | None:
    """The prompt the worker is running now (the server's last prompt id as a fallback)."""
    if _running["prompt_id"] is not None:
        return _running["prompt_id"]
    from server import PromptServer

    return getattr(PromptServer.instance, "last_prompt_id", None)


def current_prompt_graph() -> dict | None:
    """The graph (API form) of the prompt the worker is running now, None between prompts."""
    graph = _running["graph"]
    return graph if isinstance(graph, dict) else None


def _notify(listeners: list[Callable], *args) -> None:
    with _lock:
        listeners = list(listeners)
    for fn in listeners:
        try:
            fn(*args)
        except Exception:
            log.exception("[tiered offload] prompt lifecycle listener failed")


def _started(prompt_id: str | None, graph: Any) -> None:
    _GATE.prompt_started()
    _running["prompt_id"] = prompt_id
    _running["graph"] = graph
    if prompt_id is not None and isinstance(graph, dict):
        _notify(_start_listeners, prompt_id, graph)


def _ended(prompt_id: str | None) -> None:
    try:
        _notify(_end_listeners, prompt_id)
        host_sharing.sweep(if_due=True)  # a store whose last holder was killed goes now, not at a restart
    finally:
        _running["prompt_id"] = None
        _running["graph"] = None
        _GATE.prompt_ended()


def _item_fields(item: Any) -> tuple[str | None, Any]:
    """(prompt_id, graph) of a queue item: (number, prompt_id, prompt, extra_data, outputs, ...)."""
    if isinstance(item, (tuple, list)) and len(item) > 2:
        return item[1], item[2]
    return None, None


def _wrap_queue(queue: Any) -> bool:
    """Wrap the queue instance's get/task_done; False if it does not have them."""
    get, task_done = getattr(queue, "get", None), getattr(queue, "task_done", None)
    if not callable(get) or not callable(task_done):
        return False
    if getattr(get, "tiered_offload_wrapped", False):
        return True
    ids: dict[Any, str | None] = {}

    def wrapped_get(*args, **kwargs):
        got = get(*args, **kwargs)
        if isinstance(got, tuple) and len(got) == 2:
            item, item_id = got
            prompt_id, graph = _item_fields(item)
            ids[item_id] = prompt_id
            _started(prompt_id, graph)
        return got

    def wrapped_task_done(item_id, *args, **kwargs):
        try:
            _ended(ids.pop(item_id, None))
        finally:
            done = task_done(item_id, *args, **kwargs)
        return done

    wrapped_get.tiered_offload_wrapped = True
    queue.get = wrapped_get
    queue.task_done = wrapped_task_done
    return True


def _watch_messages(server: Any) -> None:
    """Fallback: prompt start and end from the messages sent to a prompt's client."""
    original = server.send_sync
    if getattr(original, "tiered_offload_wrapped", False):
        return

    def running_graph(prompt_id: str | None) -> Any:
        running = getattr(getattr(server, "prompt_queue", None), "currently_running", None)
        for item in list(running.values()) if isinstance(running, dict) else []:
            if _item_fields(item)[0] == prompt_id:
                return _item_fields(item)[1]
        return None

    def send_sync(event, data, sid=None):
        if event == "execution_start" and isinstance(data, dict):
            _started(data.get("prompt_id"), running_graph(data.get("prompt_id")))
        original(event, data, sid)
        if event == "executing" and isinstance(data, dict) and data.get("node") is None:
            _ended(data.get("prompt_id"))

    send_sync.tiered_offload_wrapped = True
    server.send_sync = send_sync


def install() -> None:
    from server import PromptServer

    server = PromptServer.instance
    if _wrap_queue(getattr(server, "prompt_queue", None)):
        log.info("[tiered offload] prompt start and end tracked from the prompt queue")
        return
    log.warning("[tiered offload] this ComfyUI's prompt queue has no get/task_done to follow; "
                "prompt start and end come from messages to clients, so models used by prompts "
                "queued without a client_id are not released")
    _watch_messages(server)
