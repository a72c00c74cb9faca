"""SideTensors: a transform's side tensors (a LoRA's factors) brought to the device per group."""

from __future__ import annotations

import pytest
import torch

from offload_core.host.side_tensors import SideTensors


def _groups() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        [torch.randn(8, 3, generator=g), torch.randn(3, 5, generator=g).bfloat16()],
        [],  # a block without patches
        [torch.randn(16, 4, generator=g).t(), torch.tensor(2.0)],  # a transposed factor, a scalar
    ]


def test_each_group_comes_back_equal_from_one_device_buffer():
    groups = _groups()
    side = SideTensors(groups, "cpu")
    largest = max(sum(-(-t.numel() * t.element_size() // 256) * 256 for t in g) for g in groups)
    assert side.device_bytes == largest
    for index in (0, 2, 1, 0):
        views = side.load(index)
        assert len(views) == len(groups[index])
        for view, original in zip(views, groups[index]):
            assert view.dtype == original.dtype and view.shape == original.shape
            assert torch.equal(view, original) and view.is_contiguous()
            assert view.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()
    storages = {v.untyped_storage().data_ptr() for i in (0, 2) for v in side.load(i)}
    assert len(storages) == 1  # every group is laid over the same device buffer


def test_a_group_is_uploaded_again_only_after_another_group():
    side = SideTensors(_groups(), "cpu")
    side.load(0)
    side.load(0)
    assert side.uploads == 1
    side.load(2)
    side.load(0)
    assert side.uploads == 3
    side.close()
    with pytest.raises(RuntimeError, match="closed"):
        side.load(0)
    side.close()  # twice is fine
