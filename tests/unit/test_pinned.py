"""HostStorage: exact sizes, chunking, budget refusal, pageable fallback, release."""

from __future__ import annotations

import logging

import pytest
import torch

from offload_core import HostStorage, available_ram_bytes, pinned_bytes
from offload_core.pinned import ALIGN, PAGE


def test_exact_sizes_and_chunks_never_split_an_item():
    sizes = [1000, 3000, 5000, 200, 9000, 0, 10]
    hs = HostStorage(sizes, pin=False, chunk_bytes=6000)
    bufs = [hs.buffer(i) for i in range(len(sizes))]
    assert [b.numel() for b in bufs] == sizes
    assert all(b.dtype == torch.uint8 and b.device.type == "cpu" for b in bufs)
    assert all(b.data_ptr() % ALIGN == 0 for b in bufs)
    for i, b in enumerate(bufs):  # items never overlap
        for j, c in enumerate(bufs):
            if i < j and b.numel() and c.numel():
                assert b.data_ptr() + b.numel() <= c.data_ptr() or c.data_ptr() + c.numel() <= b.data_ptr()
    chunks = hs._chunks
    assert [c.items for c in chunks] == [[0, 1], [2, 3], [4], [5, 6]]  # the 9000-byte item gets its own chunk
    assert all(c.data.data_ptr() % PAGE == 0 for c in chunks)
    assert hs.total_bytes == hs.allocated_bytes <= sum(sizes) + len(chunks) * ALIGN
    assert hs.pageable_bytes == hs.allocated_bytes and hs.pinned_bytes == 0


def test_chunks_are_allocated_lazily():
    hs = HostStorage([4096, 4096], pin=False, chunk_bytes=4096)
    assert hs.allocated_bytes == 0
    hs.buffer(1)
    assert hs.allocated_bytes == 4096
    hs.release()
    assert hs.allocated_bytes == 0


def test_pinning_impossible_falls_back_to_pageable_and_says_so(caplog):
    base = pinned_bytes()
    with caplog.at_level(logging.INFO, logger="offload_core.pinned"):
        hs = HostStorage([1 << 16], pin=True)
        hs.buffer(0).fill_(7)
    if not torch.cuda.is_available():
        assert "stay pageable" in caplog.text
        assert pinned_bytes() == base and not hs.is_pinned(0)
        assert hs.pageable_bytes == 1 << 16
    hs.release()
    assert pinned_bytes() == base


def test_refuses_before_exhausting_ram():
    hs = HostStorage([1 << 20], pin=False, reserve_bytes=available_ram_bytes() + (1 << 30))
    with pytest.raises(MemoryError, match="refusing to allocate"):
        hs.buffer(0)
    assert hs.allocated_bytes == 0


@pytest.mark.parametrize(
    "kwargs,match",
    [({"chunk_bytes": 0}, "chunk_bytes"), ({"ram_budget_bytes": -1}, "ram_budget_bytes")],
)
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HostStorage([10], **kwargs)
    with pytest.raises(ValueError, match="sizes"):
        HostStorage([-1])


def test_release_item_frees_a_chunk_once_all_its_items_are_done():
    hs = HostStorage([3000, 3000, 3000], pin=False, chunk_bytes=6400)
    for i in range(3):
        hs.buffer(i)
    full = hs.allocated_bytes
    hs.release_item(0)
    assert hs.allocated_bytes == full
    hs.release_item(1)  # chunk [0, 1] is now unused
    assert hs.allocated_bytes == full - hs._chunks[0].nbytes
    hs.release_item(2)
    assert hs.allocated_bytes == 0
