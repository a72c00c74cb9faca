"""What bounded a pass, by one rule for the pipeline model's prediction (layerwise/pipeline.py) and
the picture of a measured pass (timeline.py), so that the reason a plan gives and the verdict the
picture shows can never disagree on the same figures."""
from __future__ import annotations

# Waits below this share of the pass's compute time leave it bound by compute.
WAIT_SHARE_BOUND = 0.1


def bound_by(compute_ms: float, link_wait_ms: float, disk_wait_ms: float, *, blocking: bool) -> str:
    """'compute' (waits under WAIT_SHARE_BOUND of the compute; 'compute_between_copies' where the
    copies ran on the sampling thread, between the blocks), else 'disk' where compute waited
    longer for reads than for copies, else 'link', or 'copies' where the copies ran on the
    sampling thread (a CPU has no link)."""
    if link_wait_ms + disk_wait_ms < WAIT_SHARE_BOUND * compute_ms:
        return "compute_between_copies" if blocking else "compute"
    if disk_wait_ms > link_wait_ms:
        return "disk"
    return "copies" if blocking else "link"
