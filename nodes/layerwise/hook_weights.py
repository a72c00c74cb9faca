"""Core's hook LoRAs (CreateHookLora and the like, set on a conditioning) on streamed blocks.

Core applies a hook's weight patches while it samples: before each call of the model for a group
of conditionings it patches the hooked weights in place (`ModelPatcher.patch_hooks`: the weight
as loaded, in fp32, `calculate_weight` with the hooks' patches at their current strengths,
stochastic rounding seeded by the key) and puts the old ones back when the group changes. It
finds the weights by key in the model's state dict. A resident block's weights are there (the
engine's device copies), and core patches them as it would its own. A streamed block holds no
tensors between its passes, so core would skip its keys ("Key does not exist in model") and sample
without the hook.

So for the run the streamed blocks' keys are taken out of the patcher's hook patches (core then
patches only what it can see, and says nothing of the rest), kept here, and the engine's
transform applies them to each streamed copy with core's arithmetic, on top of the regular LoRA
merge, for the hook group core applied last. Core tells of every change of group or of a hook's
strength (keyframes) by what it holds as applied (`current_hooks`), which is read as each call of
the model starts: when it changed, the engine copies again the streamed units it had prefetched
with the old weights. The patcher gets its hook patches back at
the run's end, however the run ends.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

log = logging.getLogger(__name__)


def hooked_keys(patcher, keys: Iterable[str]) -> set[str]:
    """Those of ``keys`` that some registered hook patches."""
    keys = set(keys)
    found: set[str] = set()
    for patches in (getattr(patcher, "hook_patches", None) or {}).values():
        found |= keys & set(patches)
    return found


class StreamedHooks:
    """The hook patches of the streamed blocks' keys for one run, out of core's reach.

    ``take`` moves them out of the patcher once the streamed keys are known; ``snapshot`` gives
    the combined patches of each key under the hook group core applied last (as core's
    `get_combined_hook_patches` combines them). ``close`` gives the patcher its hook patches back.
    """

    @classmethod
    def for_keys(cls, patcher, root: torch.nn.Module, keys: Iterable[str]) -> StreamedHooks | None:
        """For a run of the blocks whose weights are ``keys``: None unless a hook patches one."""
        hooked = hooked_keys(patcher, keys)
        return cls(patcher, root, hooked) if hooked else None

    def __init__(self, patcher, root: torch.nn.Module, hooked: set[str]) -> None:
        self._hooked = hooked  # the blocks' keys some hook patches
        self._patcher = patcher
        self._root = root  # the module whose call is one call of the model
        self._full: dict | None = None  # the patcher's own hook patches, while ours stand in
        self._filtered: dict | None = None
        self._streamed: dict[Any, dict[str, list]] = {}  # hook_ref -> key -> patches
        self._current: dict[str, list] = {}
        self._signature: tuple = ()
        self._on_change: Callable[[], int] | None = None
        self._handle = None

    @property
    def keys(self) -> set[str]:
        return {k for patches in self._streamed.values() for k in patches}

    def take_unseen(self, on_change: Callable[[], int]) -> int:
        """``take`` the hooked keys the model's state dict lacks now (its streamed units')."""
        present = set(self._patcher.model.state_dict())
        return self.take({k for k in self._hooked if k not in present}, on_change)

    def take(self, streamed_keys: set[str], on_change: Callable[[], int]) -> int:
        """Move the hook patches of ``streamed_keys`` out of the patcher; ``on_change`` is called
        (as a call of the model starts) whenever the patches in force change. Returns how many keys."""
        patcher = self._patcher
        full = patcher.hook_patches
        streamed = {ref: {k: v for k, v in patches.items() if k in streamed_keys} for ref, patches in full.items()}
        streamed = {ref: patches for ref, patches in streamed.items() if patches}
        if not streamed:
            return 0
        self._full, self._streamed, self._on_change = full, streamed, on_change
        self._filtered = {ref: {k: v for k, v in patches.items() if k not in streamed_keys}
                          for ref, patches in full.items()}
        patcher.hook_patches = self._filtered
        self._handle = self._root.register_forward_pre_hook(self._call_starts)
        count = len(self.keys)
        log.info("[tiered offload] Apply Layerwise Offload: hook LoRAs patch %d weights of streamed blocks; the engine "
                 "applies them to the streamed copies", count)
        return count

    def _call_starts(self, module, args) -> None:
        """A call of the model starts: the streamed weights follow the hooks core holds as applied
        (core applies a group before the call; a keyframe that changes resets it to none)."""
        current_patcher = getattr(self._patcher.model, "current_patcher", None) or self._patcher
        self.follow(getattr(current_patcher, "current_hooks", None))

    def follow(self, hooks) -> None:
        """``hooks`` (a HookGroup, or None) are in force now."""
        signature = ()
        current: dict[str, list] = {}
        if hooks is not None:
            for hook in hooks.hooks:
                patches = self._streamed.get(hook.hook_ref)
                if not patches:
                    continue
                strength = hook.strength
                signature += ((id(hook.hook_ref), strength),)
                for key, items in patches.items():
                    combined = current.setdefault(key, [])
                    if math.isclose(strength, 1.0):
                        combined.extend(items)
                    else:
                        for item in items:
                            scaled = list(item)
                            scaled[0] *= strength
                            combined.append(tuple(scaled))
        if signature == self._signature:
            return
        self._signature, self._current = signature, current
        copied = self._on_change() if self._on_change is not None else 0
        log.debug("[tiered offload] hook patches of streamed blocks changed (%d weights); %d prefetched units "
                  "copied again",
                  len(current), copied)

    def snapshot(self) -> dict[str, list]:
        """The patches in force now, for a copy queued now and rewritten later."""
        return self._current

    def close(self) -> None:
        """Give the patcher its hook patches back (unless someone replaced ours since) and stop
        following core's changes."""
        patcher = self._patcher
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._full is not None:
            if patcher.hook_patches is self._filtered:
                patcher.hook_patches = self._full
            else:
                log.warning("[tiered offload] Apply Layerwise Offload: the model's hook patches were replaced "
                            "during the run; the streamed blocks' patches are left out of the new ones")
        self._full = self._filtered = None
        self._streamed, self._current, self._signature = {}, {}, ()
        self._on_change = None
