"""Residency planning at run start: the budget that fits the device, and re-planning a kept pack."""

from __future__ import annotations

import pytest
import torch
from toy_models import ToyDiT, inputs

from offload_core import LayerwiseStreamer
from offload_core.device.residency import fit_budget

LEAST, MOST = 100, 1000


@pytest.mark.parametrize("requested,available,expected", [
    (None, 5000, MOST),      # auto, room for everything: every block resident
    (None, 400, 400),        # auto takes what is there
    (None, LEAST, LEAST),    # exactly enough to stream
    (None, LEAST - 1, None), # not even streaming fits
    (None, -50, None),       # the rest of the run alone does not fit
    (300, 5000, 300),        # a budget that fits is kept
    (300, 200, 200),         # a budget larger than the card is lowered to it
    (300, 50, None),
    (50, 5000, 50),          # below LEAST: the caller refuses it with the node's own words
])
def test_fit_budget(requested, available, expected):
    got = fit_budget(requested, available, LEAST, MOST)
    if expected is None or expected < LEAST:
        assert got is None
    else:
        assert got == expected


def test_replan_changes_residency_of_a_kept_pack_and_stays_bit_identical():
    model = ToyDiT(depth=6)
    x, t = inputs()
    with torch.no_grad():
        ref = model(x, t)
    st = LayerwiseStreamer(model.blocks, "cpu", prefetch=1)
    least, most = st.bound_range()
    assert st.resident_indices == [] and st.bound_bytes() == least
    st.replan(vram_budget_bytes=most)
    assert st.streamed_indices == [] and st.bound_bytes() == most
    for budget in (most, least, (least + most) // 2):
        st.replan(vram_budget_bytes=budget)
        assert st.bound_bytes() <= budget
        st.attach()
        with torch.no_grad():
            assert torch.equal(model(x, t), ref)
        with pytest.raises(RuntimeError, match="detached"):
            st.replan(resident=0)
        st.detach(keep_pack=True)
    with pytest.raises(ValueError, match="too small"):
        st.replan(vram_budget_bytes=least - 1)
    assert st.bound_bytes() <= (least + most) // 2  # a refused plan changes nothing
    st.replan(resident=2)
    assert st.resident_indices == [1, 4]
    st.close()
