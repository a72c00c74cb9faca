"""ComfyUI loads and samples models under torch.inference_mode(): the engine must work there.

Parameters created inside inference mode are inference tensors; views of them, or in-place
work on them, outside inference mode raise "Inference tensors do not track version counter".
"""
import torch
import torch.nn as nn

from offload_core.layerwise.streamer import LayerwiseStreamer


class ModulatedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.modulation = nn.Parameter(torch.randn(1, 4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        e = self.modulation.to(dtype=x.dtype, device=x.device).unsqueeze(0) + x
        return self.lin(e)


def _run(blocks, x):
    for b in blocks:
        x = b(x)
    return x


def test_streaming_blocks_built_and_run_in_inference_mode():
    with torch.inference_mode():
        blocks = [ModulatedBlock() for _ in range(3)]
        x = torch.randn(2, 4)
        ref = _run(blocks, x)
        streamer = LayerwiseStreamer(blocks, torch.device("cpu"), resident=0, prefetch=1)
        for _ in range(2):
            streamer.attach()
            assert torch.equal(_run(blocks, x), ref)
            assert torch.equal(_run(blocks, x), ref)
            streamer.detach(keep_pack=True)
        assert torch.equal(_run(blocks, x), ref)
        streamer.close()
        assert torch.equal(_run(blocks, x), ref)
