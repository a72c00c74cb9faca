"""Byte figures as a person reads them: binary units (GiB = 2^30 bytes, MiB, KiB), switched so
that a small figure never reads 0.00 and two figures a message compares show their difference."""
from __future__ import annotations

_KiB = 1 << 10
_MiB = 1 << 20
_GiB = 1 << 30


def size_text(n: float) -> str:
    """GiB with two decimals, MiB with one, whole KiB, and bytes below 1 KiB."""
    if n >= _GiB:
        return f"{n / _GiB:.2f} GiB"
    if n >= _MiB:
        return f"{n / _MiB:.1f} MiB"
    if n >= _KiB:
        return f"{n / _KiB:.0f} KiB"
    return "1 byte" if int(n) == 1 else f"{int(n)} bytes"
