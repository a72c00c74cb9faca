"""One engine object per nn.Module, closed when that module is freed.

Engine objects (a layerwise session, a swap master) change a module's tensors, and every user
of that module (in ComfyUI, all clones of a ModelPatcher) shares it, so they are keyed by the
module itself. When the host application frees the module, its object is closed and its pinned
memory goes with it.

The weakref callback that says so may run on any thread at any allocation, the garbage collector
included, and so in the middle of this registry's own locked section on the same thread (a
module freed while another's object is being created). It never waits for the lock: it queues
the freed module, and whoever holds the lock, or the next call, closes its object.
"""
from __future__ import annotations

import queue
import threading
import weakref
from typing import Callable, Generic, Protocol, TypeVar

import torch


class Closable(Protocol):
    def close(self) -> None: ...


T = TypeVar("T", bound=Closable)


class PerModule(Generic[T]):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, tuple[weakref.ref, T]] = {}
        self._freed: queue.SimpleQueue[tuple[int, weakref.ref]] = queue.SimpleQueue()  # safe in a callback

    def get(self, module: torch.nn.Module) -> T | None:
        self._sweep()
        with self._lock:
            entry = self._entries.get(id(module))
        return entry[1] if entry is not None and entry[0]() is module else None

    def get_or_create(self, module: torch.nn.Module, create: Callable[[], T],
                      reuse: Callable[[T], bool] = lambda _: True) -> T:
        """The module's object if `reuse` accepts it; otherwise close it and create another."""
        try:
            with self._lock:
                key = id(module)
                entry = self._entries.get(key)
                if entry is not None and entry[0]() is module and reuse(entry[1]):
                    return entry[1]
                if entry is not None:  # refused, or a freed module's whose id this one reuses
                    del self._entries[key]  # gone even if create() below fails
                    entry[1].close()
                value = create()
                self._entries[key] = (weakref.ref(module, lambda dead: self._drop(key, dead)), value)
                return value
        finally:
            self._sweep()  # what was freed while the lock was held, create() included

    def discard(self, module: torch.nn.Module) -> T | None:
        """Forget and close the module's object, if it has one; return it."""
        self._sweep()
        with self._lock:
            entry = self._entries.get(id(module))
            if entry is None or entry[0]() is not module:
                return None
            del self._entries[id(module)]
        entry[1].close()
        return entry[1]

    def values(self) -> list[T]:
        self._sweep()
        with self._lock:
            return [value for _, value in self._entries.values()]

    def items(self) -> list[tuple[torch.nn.Module, T]]:
        """(module, object) of every module still alive."""
        self._sweep()
        with self._lock:
            entries = list(self._entries.values())
        return [(module, value) for ref, value in entries if (module := ref()) is not None]

    def _sweep(self) -> None:
        """Close the objects of the modules freed since the last call."""
        with self._lock:
            closing = self._take_freed()
        _close(closing)

    def _take_freed(self) -> list[T]:
        """The objects of the modules freed since the last call, out of the registry (lock held)."""
        taken = []
        while True:
            try:
                key, dead = self._freed.get_nowait()
            except queue.Empty:
                return taken
            entry = self._entries.get(key)
            # id() values are reused: drop the entry only if it still belongs to the dead module.
            if entry is not None and entry[0] is dead:
                del self._entries[key]
                taken.append(entry[1])

    def _drop(self, key: int, dead: weakref.ref) -> None:
        self._freed.put((key, dead))
        if not self._lock.acquire(blocking=False):
            return  # held, maybe by this very thread: the next call (or this one's end) closes it
        try:
            closing = self._take_freed()
        finally:
            self._lock.release()
        _close(closing)


def _close(objects: list) -> None:
    for obj in objects:
        obj.close()
