"""ModuleSwap: the module runs from the host master, parking takes device copies back without
copying, an owner's computed weights are never overwritten, and close hands everything back."""

from __future__ import annotations

import pytest
import torch
from toy_models import ToyDiT, assert_restored, inputs, snapshot

from offload_core import ModuleSwap


def _in_pack(t: torch.Tensor, swap: ModuleSwap) -> bool:
    return any(p.host.data_ptr() <= t.data_ptr() < p.host.data_ptr() + p.nbytes for p in swap._packs)


def test_park_takes_back_moved_tensors_and_leaves_computed_weights_alone():
    model = ToyDiT(depth=3)
    x, t = inputs()
    with torch.no_grad():
        ref = model(x, t)
    before, keys = snapshot(model), list(model.state_dict())
    swap = ModuleSwap(model, pin=False, part_bytes=64 << 10)
    assert len(swap._packs) > 1  # a few large parts, not one buffer per tensor
    assert swap.bytes_by_tier() == {"pinned": 0, "pageable": swap.nbytes}
    assert all(_in_pack(p, swap) for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)  # runs straight from the host master
    assert swap.park() == 0  # nothing was off the host
    host_before = [p.host.clone() for p in swap._packs]

    # The owner moves one layer to a device and back by copies (a fresh host copy stands in for
    # a device here: the objects stay, their memory is no longer the master's), puts a
    # fresh object over the master's memory in another slot (as ComfyUI does when it restores a
    # weight from its backup), and replaces a third with a weight it computed (a merged LoRA).
    moved = model.blocks[0].mlp_out
    for p in moved.parameters():
        p.data = p.data.clone()
    aliased = model.blocks[1].qkv
    original_obj = aliased.weight
    aliased.weight = torch.nn.Parameter(original_obj.data, requires_grad=False)
    merged = model.blocks[2].qkv
    base_obj = merged.weight
    merged_weight = torch.nn.Parameter(base_obj.detach() * 2, requires_grad=False)
    merged.weight = merged_weight

    taken_back = swap.park()
    assert taken_back == 2  # mlp_out's weight and bias
    assert all(_in_pack(p, swap) for p in moved.parameters())
    assert aliased.weight is original_obj and _in_pack(aliased.weight, swap)
    assert merged.weight is merged_weight and not _in_pack(merged.weight, swap)
    assert all(torch.equal(a, p.host) for a, p in zip(host_before, swap._packs))  # master untouched

    # The owner restores its base weight from its backup (the master's object): parking then
    # puts our object back, and close hands every original back.
    merged.weight = torch.nn.Parameter(base_obj, requires_grad=False)
    assert swap.park() == 0 and merged.weight is base_obj
    swap.close()
    assert swap.bytes_by_tier() == {"pinned": 0, "pageable": 0}
    assert_restored(model, before, keys)
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
    with pytest.raises(RuntimeError, match="closed"):
        swap.park()
    swap.close()  # idempotent


def test_unpackable_module_is_left_untouched():
    model = ToyDiT(depth=2)
    model.blocks[0].register_buffer("sparse", torch.eye(4).to_sparse())
    before, keys = snapshot(model), list(model.state_dict())
    with pytest.raises(TypeError, match="blocks.0.sparse"):
        ModuleSwap(model, pin=False)
    assert_restored(model, before, keys)


def test_invalid_part_size():
    with pytest.raises(ValueError, match="part_bytes"):
        ModuleSwap(ToyDiT(depth=1), part_bytes=0)


def test_close_waits_only_for_the_devices_that_read_the_master(monkeypatch):
    """Freeing a pinned master waits for the devices that may still copy out of it: the one its
    owner declared and those its tensors were taken back from, never every GPU (waiting on a
    device creates a CUDA context there)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with four GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    model = ToyDiT(depth=2)
    swap = ModuleSwap(model, pin=False)
    swap.note_reader(torch.device("cuda", 2))
    host = swap._host
    swap.park()
    swap.close()
    assert host.readers == {2}
