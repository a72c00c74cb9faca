"""Byte alignment: what every room that lays out, reads or caches bytes rounds to. No torch, so
the pipeline model, which plays the disk cache's rule without running it, can use it too."""
from __future__ import annotations

# Direct reads need offsets, lengths and addresses in multiples of the logical block; the disk
# cache's entries and the spill file's units are laid out on it.
PAGE = 4096


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def align_down(n: int, a: int) -> int:
    return n // a * a
