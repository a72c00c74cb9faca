"""One engine object per nn.Module, closed when that module is freed.

Engine objects (a layerwise session, a swap master) change a module's tensors, and every user
of that module (in ComfyUI, all clones of a ModelPatcher) shares it, so they are keyed by the
module itself. When the host application frees the module, the weakref callback closes the
engine object and its pinned memory goes with it.
"""
from __future__ import annotations

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

    def get(self, module: torch.nn.Module) -> T | None:
        with self._lock:
            entry = self._entries.get(id(module))
        return entry[1] if entry is not None and entry[0]() is module else None

    def get_or_create(self, module: torch.nn.Module, create: Callable[[], T],
                      reuse: Callable[[T], bool] = lambda _: True) -> T:
        """The module's object if `reuse` accepts it; otherwise close it and create another."""
        with self._lock:
            key = id(module)
            entry = self._entries.get(key)
            if entry is not None and entry[0]() is module:
                if reuse(entry[1]):
                    return entry[1]
                del self._entries[key]  # gone even if create() below fails
                entry[1].close()
            value = create()
            self._entries[key] = (weakref.ref(module, lambda dead: self._drop(key, dead)), value)
            return value

    def discard(self, module: torch.nn.Module) -> T | None:
        """Forget and close the module's object, if it has one; return it."""
        with self._lock:
            entry = self._entries.get(id(module))
            if entry is None or entry[0]() is not module:
                return None
            del self._entries[id(module)]
        entry[1].close()
        return entry[1]

    def values(self) -> list[T]:
        with self._lock:
            return [value for _, value in self._entries.values()]

    def items(self) -> list[tuple[torch.nn.Module, T]]:
        """(module, object) of every module still alive."""
        with self._lock:
            entries = list(self._entries.values())
        return [(module, value) for ref, value in entries if (module := ref()) is not None]

    def _drop(self, key: int, dead: weakref.ref) -> None:
        # id() values are reused: drop the entry only if it still belongs to the dead module.
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[0] is not dead:
                return
            del self._entries[key]
        entry[1].close()
