"""What a measured pass says each unit costs: the pipeline model's inputs (pipeline.Costs), read off
the run's own picture of that pass (device/timeline.py) and its period.

Why from the picture: it already holds what the model needs, on the device's clock, for every
streamed unit: its copy (with its merge) and its bytes, the time compute waited for it, its
compute, its disk read. Only two figures are not in it: the resident blocks' compute (they have
no copy to draw), timed by the tuner around those blocks, and the pass's period from one model
call to the next, timed at the calls.

What was not measured is estimated from what was: the copy of a resident unit from the copy
rate of the streamed ones (or of the resident upload, when nothing streamed), the compute of a
unit not seen from the compute per byte of those seen. Where the same thing was measured before
(an earlier pass with other residents), that measurement stands instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .pipeline import Costs, DiskCosts


def read_rate(spans: Sequence[dict]) -> float | None:
    """Bytes per ms the disk delivered while it was reading in this pass (overlapping reads count
    once), None without reads."""
    reads = sorted((s["start_ms"], s["end_ms"], s.get("bytes", 0)) for s in spans if s["kind"] == "disk")
    if not reads:
        return None
    busy, reach, nbytes = 0.0, float("-inf"), 0
    for start, end, n in reads:
        nbytes += n
        start = max(start, reach)
        if end > start:
            busy += end - start
            reach = end
    return nbytes / busy if busy > 0 else None


def pass_costs(picture: Mapping, resident_ms: Mapping[int, float], period_ms: float,
               units: Sequence[Mapping], shared_bytes: int, asynchronous: bool, *,
               upload_bytes_per_ms: float | None = None, disk_cap_bytes: int | None = None,
               disk_bytes_per_ms: float | None = None, previous: Costs | None = None) -> Costs | None:
    """The costs of one pass: ``picture`` is ``Timeline.last_pass``, ``resident_ms`` each resident
    block's compute, ``units`` each unit's ``{"block", "bytes"}``; from disk, the RAM cache's size
    and the disk's rate over the run so far (a pass's own reads overlap those of the passes beside
    it), else the rate of this pass's reads. None when the pass says too little (no unit's compute
    at all, or no read from disk yet)."""
    n = len(units)
    sizes = [int(u["bytes"]) for u in units]
    blocks = [int(u["block"]) for u in units]
    compute: list[float | None] = [None] * n
    copy: list[float | None] = [None] * n
    stall = 0.0
    copied_bytes = copied_ms = 0.0
    for s in picture.get("spans", ()):
        u, length = s["unit"], s["end_ms"] - s["start_ms"]
        if s["kind"] == "compute":
            compute[u] = (compute[u] or 0.0) + length
        elif s["kind"] == "copy":
            copy[u] = length
            copied_bytes += sizes[u]
            copied_ms += length
            if s.get("blocking"):  # a copy on the sampling thread: compute waited for all of it
                stall += length
        elif s["kind"] == "wait":
            stall += max(length, 0.0) if asynchronous else max(length, s.get("host_ms", 0.0))
    for block, ms in resident_ms.items():  # a resident block's compute, shared by its units by bytes
        members = [u for u in range(n) if blocks[u] == block and compute[u] is None]
        total = sum(sizes[u] for u in members)
        for u in members:
            compute[u] = ms * (sizes[u] / total if total else 1 / len(members))
    seen = [u for u in range(n) if compute[u] is not None]
    if not seen:
        return None
    per_byte = sum(compute[u] for u in seen) / max(1, sum(sizes[u] for u in seen))
    for u in range(n):
        if compute[u] is None:
            compute[u] = previous.compute_ms[u] if previous is not None else per_byte * sizes[u]
    copy_rate = copied_bytes / copied_ms if copied_ms > 0 else upload_bytes_per_ms
    for u in range(n):
        if copy[u] is None:
            if previous is not None and previous.copy_ms[u] > 0:
                copy[u] = previous.copy_ms[u]
            else:
                copy[u] = sizes[u] / copy_rate if copy_rate else 0.0
    outside = max(0.0, period_ms - sum(compute) - stall)
    disk = None
    if disk_cap_bytes is not None:
        rate = disk_bytes_per_ms or read_rate(picture.get("spans", ()))
        if rate is None and previous is not None and previous.disk is not None:
            rate = previous.disk.bytes_per_ms
        if rate is None:
            return None  # every unit was a hit: the disk's rate is not known yet
        disk = DiskCosts(rate, disk_cap_bytes)
    return Costs(tuple(compute), tuple(copy), tuple(sizes), tuple(blocks), shared_bytes, outside,
                 asynchronous, disk)
