"""Measure RSS around packing a ~1 GiB block stack; run in its own process by test_pinned.py.

Prints one JSON object of byte figures. Before building, one mid-size tensor is freed: glibc
then raises its mmap threshold (as any real model load makes it do), so the block tensors come
from the C heap. Blocks are plain Linear/LayerNorm stacks: the small tensors between the large
ones keep the heap from shrinking by itself, so freed originals stay with the process unless
the heap is trimmed.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from offload_core import LayerwiseStreamer  # noqa: E402

LAYERS = 512
DIM, FFN = 512, 1024  # two 1 MiB bf16 weights per block, with their biases and a norm


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.utils.skip_init(nn.Linear, DIM, FFN, dtype=torch.bfloat16)
        self.down = nn.utils.skip_init(nn.Linear, FFN, DIM, dtype=torch.bfloat16)
        self.norm = nn.LayerNorm(DIM)
        with torch.no_grad():
            for p in self.parameters():
                p.fill_(0.5)  # touched, so the pages count in RSS


def rss() -> int:
    return psutil.Process().memory_info().rss


def main() -> None:
    torch.set_num_threads(1)
    del_me = torch.empty(16 << 20, dtype=torch.uint8)
    del del_me
    start = rss()
    blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
    weights = sum(p.numel() * p.element_size() for p in blocks.parameters())
    built = rss()
    st = LayerwiseStreamer(blocks, "cpu", resident=0, prefetch=1)
    st.attach()
    packed = rss()
    print(json.dumps({"rss_start": start, "rss_built": built, "rss_packed": packed,
                      "weights": weights, "packed": st.packed_bytes}))
    st.close()


if __name__ == "__main__":
    main()
