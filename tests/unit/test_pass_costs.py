"""What a pass is measured to cost (measure.py ``pass_costs``), where it did not measure a unit's
copy: a resident unit is not copied in a pass, so its copy stands as measured in an earlier pass,
scaled by how much this pass's copies moved since. Held to: a link that slowed to a quarter makes
the resident units' copies four times dearer too (taken unscaled, a plan made after the link
slowed keeps fewer units resident than it should, its copies underpriced, and is then rolled back
as slower than predicted); where no copy of this pass was measured before, nothing is scaled."""
from __future__ import annotations

import pytest

from offload_core.layerwise.measure import pass_costs
from offload_core.layerwise.pipeline import Costs

UNITS = [{"block": b, "bytes": 1000} for b in range(4)]


def picture(copy_ms: float) -> dict:
    """Units 0 and 1 resident (no span); 2 and 3 streamed: each copied, then computed."""
    spans = []
    t = 0.0
    for u in (2, 3):
        spans.append({"unit": u, "kind": "copy", "start_ms": t, "end_ms": t + copy_ms})
        spans.append({"unit": u, "kind": "compute", "start_ms": t + copy_ms, "end_ms": t + copy_ms + 1.0})
        t += copy_ms + 1.0
    return {"spans": spans}


@pytest.mark.parametrize("factor", [4.0, 0.5])
def test_a_resident_units_copy_moves_with_the_streamed_ones(factor):
    before = Costs((1.0,) * 4, (2.0,) * 4, (1000,) * 4, tuple(range(4)), 0, 0.0, True)
    costs = pass_costs(picture(2.0 * factor), {0: 1.0, 1: 1.0}, 12.0, UNITS, 0, True, previous=before)
    assert costs.copy_ms == pytest.approx((2.0 * factor,) * 4)


def test_without_an_earlier_measure_of_this_pass_s_copies_nothing_is_scaled():
    before = Costs((1.0,) * 4, (2.0, 2.0, 0.0, 0.0), (1000,) * 4, tuple(range(4)), 0, 0.0, True)
    costs = pass_costs(picture(8.0), {0: 1.0, 1: 1.0}, 20.0, UNITS, 0, True, previous=before)
    assert costs.copy_ms == pytest.approx((2.0, 2.0, 8.0, 8.0))
