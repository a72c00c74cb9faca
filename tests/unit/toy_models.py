"""Small DiT-like models that exercise every kind of tensor the engine must carry.

Each block mixes fp32 and bf16 parameters, an fp8 (e4m3) buffer and an fp8
(e5m2) parameter cast up in forward, int64 and bool buffers, a transposed
(dense, non-contiguous) parameter, an expanded (non-dense) buffer, a weight tied
inside the block, and optionally one parameter shared by every block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ToyBlock(nn.Module):
    def __init__(self, dim: int, heads: int, shared: nn.Parameter | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim, dtype=torch.bfloat16)
        self.mlp_in = nn.Linear(dim, 2 * dim, dtype=torch.bfloat16)
        self.mlp_out = nn.Linear(2 * dim, dim)
        self.modulation = nn.Parameter(torch.randn(1, 3, dim) * 0.1)
        self.w8 = nn.Parameter(torch.randn(dim, dim).mul(0.2).to(torch.float8_e5m2), requires_grad=False)
        self.wt = nn.Parameter(torch.randn(dim, dim).mul(0.1).t())
        self.tied_a = nn.Linear(dim, dim, bias=False)
        self.tied_b = nn.Linear(dim, dim, bias=False)
        self.tied_b.weight = self.tied_a.weight
        self.register_buffer("gate8", (torch.rand(dim) + 0.5).to(torch.float8_e4m3fn))
        self.register_buffer("perm", torch.randperm(dim))
        self.register_buffer("mask", torch.rand(dim) > 0.2)
        self.register_buffer("bias_exp", torch.randn(1, dim).expand(4, dim), persistent=False)
        if shared is not None:
            self.shared_scale = shared
        self.fail = False

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("injected failure")
        b, n, d = x.shape
        shift, scale, gate = (self.modulation + cond.view(b, 3, d)).chunk(3, dim=1)
        h = F.layer_norm(x, (d,)) * (1 + scale) + shift
        if hasattr(self, "shared_scale"):
            h = h * self.shared_scale
        q, k, v = self.qkv(h).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + gate * self.proj(a.bfloat16()).float()
        h = self.mlp_out(F.gelu(self.mlp_in(F.layer_norm(x, (d,)).bfloat16()).float()))
        h = h * self.gate8.float() + F.linear(h, self.w8.float()) + h @ self.wt
        h = h + self.tied_b(self.tied_a(h)) * 0.1
        h = torch.where(self.mask, h, h[..., self.perm]) + self.bias_exp[0]
        return x + h


class KwargsBlock(nn.Module):
    """A block that is only ever called with keyword arguments."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, *, x: torch.Tensor, scale: float) -> torch.Tensor:
        return x + scale * self.lin(x)


class ToyDiT(nn.Module):
    def __init__(self, depth: int = 6, dim: int = 32, heads: int = 4, shared: bool = True, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(8, dim)
        self.cond = nn.Linear(4, 3 * dim)
        common = nn.Parameter(torch.rand(dim) + 0.5) if shared else None  # lives only in the blocks
        self.blocks = nn.ModuleList([ToyBlock(dim, heads, common) for _ in range(depth)])
        self.head = nn.Linear(dim, 8)

    def forward(self, x: torch.Tensor, t: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
        h = self.embed(x)
        c = self.cond(t)
        for i in range(len(self.blocks)) if order is None else order:
            h = self.blocks[i](h, cond=c)
        return self.head(h)


def inputs(batch: int = 2, tokens: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, tokens, 8, generator=g), torch.randn(batch, 4, generator=g)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor's values, so NaN or -0.0 cannot hide a difference."""
    t = t.detach() if t.layout == torch.strided else t.detach().to_dense()
    return t.reshape(-1).contiguous().view(torch.uint8).cpu()


def snapshot(model: nn.Module) -> dict[str, tuple]:
    """Every parameter and buffer by name: object, value bytes, dtype, device, shape, strides."""
    out = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        stride = t.stride() if t.layout == torch.strided else None
        out[name] = (t, bits(t).clone(), t.dtype, t.device, t.shape, stride)
    return out


def assert_restored(model: nn.Module, before: dict[str, tuple], keys_before: list[str]) -> None:
    after = snapshot(model)
    assert list(after) == list(before)
    for name, (obj, raw, dtype, device, shape, stride) in before.items():
        t = after[name][0]
        assert t is obj, f"{name}: a different tensor object was put back"
        assert t.dtype == dtype and t.device == device and t.shape == shape, name
        if stride is not None:
            assert t.stride() == stride, f"{name}: strides changed {stride} -> {t.stride()}"
        assert torch.equal(bits(t), raw), f"{name}: values changed"
    assert list(model.state_dict().keys()) == keys_before
