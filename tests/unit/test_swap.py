"""ModuleSwap: load / park / close round trip with identical outputs and honest byte tiers."""

from __future__ import annotations

import pytest
import torch
from toy_models import ToyDiT, assert_restored, inputs, snapshot

from offload_core import ModuleSwap


def _in(t: torch.Tensor, buf: torch.Tensor) -> bool:
    return buf.data_ptr() <= t.data_ptr() < buf.data_ptr() + buf.numel()


def test_load_park_close_round_trip():
    model = ToyDiT(depth=3)
    x, t = inputs()
    with torch.no_grad():
        ref = model(x, t)
    before, keys = snapshot(model), list(model.state_dict())
    swap = ModuleSwap(model, pin=False, part_bytes=64 << 10)
    packed = sum(p.nbytes for p in swap._packs)
    assert len(swap._packs) > 1  # a few large parts, not one buffer per tensor
    assert swap.bytes_by_tier() == {"vram": 0, "pinned": 0, "pageable": packed}
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)  # parked: runs straight from the host master

    swap.load("cpu")
    assert swap.bytes_by_tier()["vram"] == packed
    assert _in(model.blocks[1].qkv.weight, swap._device_buf)
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
    swap.load("cpu")  # already there: no-op
    host_before = [p.host.clone() for p in swap._packs]

    swap.park()
    assert swap.bytes_by_tier() == {"vram": 0, "pinned": 0, "pageable": packed}
    assert not _in(model.blocks[1].qkv.weight, torch.empty(0)) and swap._device_buf is None
    assert all(torch.equal(a, p.host) for a, p in zip(host_before, swap._packs))  # master untouched
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)

    swap.load(torch.device("cpu"))
    swap.close()
    assert swap.bytes_by_tier() == {"vram": 0, "pinned": 0, "pageable": 0}
    assert_restored(model, before, keys)
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
    with pytest.raises(RuntimeError, match="closed"):
        swap.load("cpu")
    swap.close()  # idempotent


def test_unpackable_module_is_left_untouched():
    model = ToyDiT(depth=2)
    model.blocks[0].register_buffer("sparse", torch.eye(4).to_sparse())
    before, keys = snapshot(model), list(model.state_dict())
    with pytest.raises(TypeError, match="blocks.0.sparse"):
        ModuleSwap(model, pin=False)
    assert_restored(model, before, keys)


def test_invalid_device_and_part_size():
    model = ToyDiT(depth=1)
    with pytest.raises(ValueError, match="part_bytes"):
        ModuleSwap(model, part_bytes=0)
    swap = ModuleSwap(model, pin=False)
    with pytest.raises(ValueError, match="not supported"):
        swap.load("meta")
    swap.close()
