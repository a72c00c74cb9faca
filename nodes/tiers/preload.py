"""Models warmed up at start-up: the "preload" list of the pack's settings file.

Each entry names a Tiered loader and its inputs (the file as the loader names it in its model
folder) and the tier to warm it into; the models are registered at once and loaded in the
background, so start-up never waits for them.
"""
from __future__ import annotations

import logging
from typing import Any

from ...offload_core.models.tier_entries import Tier
from ..core import budgets, settings_file, state
from .loaders import LOADERS

log = logging.getLogger(__name__)


def _register_preload_entry(item: Any) -> tuple[str, str]:
    """(manager id, tier) of one preload entry; ValueError or the loader's error if it is bad."""
    if not isinstance(item, dict):
        raise ValueError("an entry must be a JSON object")
    name = item.get("loader")
    loader = LOADERS.get(name) if isinstance(name, str) else None
    if loader is None:
        raise ValueError(f"loader must be one of {', '.join(LOADERS)}")
    inputs = item.get("inputs")
    if not isinstance(inputs, dict):
        raise ValueError("inputs must be a JSON object of the loader's inputs")
    tier = item.get("tier", Tier.RAM.value)
    if tier not in (Tier.RAM.value, Tier.VRAM.value):
        raise ValueError('tier must be "ram" or "vram"')
    return loader.register(**inputs), tier


def preload_from_settings() -> None:
    """Register and warm the models named in the settings file, in the background.

    Format: {"preload": [{"loader": "TieredUNETLoader", "inputs": {...}, "tier": "ram"}]}.
    A bad file or entry, whatever its content, is logged and skipped; start-up never waits for
    or fails on the warm-up.
    """
    try:
        items = settings_file.read().get("preload", [])
        if not isinstance(items, list):
            raise ValueError('expected {"preload": [...]}')
    except (OSError, ValueError) as e:
        log.error("[tiered offload] cannot read %s: %s", settings_file.path(), budgets.shorten(e, 300))
        return
    by_tier: dict[str, list[str]] = {}
    for item in items:
        try:
            key, tier = _register_preload_entry(item)
        except Exception as e:
            log.error("[tiered offload] skipping preload entry %s: %s",
                      budgets.shorten(repr(item), 300), budgets.shorten(e, 300))
            continue
        by_tier.setdefault(tier, []).append(key)
    for tier, keys in by_tier.items():
        log.info("[tiered offload] preloading %d model(s) into %s", len(keys), tier)
        state.MANAGER.preload(keys, tier, background=True)
