"""Layerwise streaming benchmark on real DiT block shapes (Wan 2.1 14B, Flux).

What one run measures, per model:
  * resident step time (every block on the device), the compute floor;
  * LayerwiseStreamer step time at several (resident, prefetch) settings, and with ``auto`` among
    them, with both left to the engine's tuner within the device memory of the largest of the other
    settings (its first passes measure, plan, apply and check; the timed ones are after them);
  * a naive synchronous block swap (``block.to(dev)``, run, ``block.to("cpu")``);
  * the pinned host->device peak (one large copy) and per-block copy bandwidth;
  * efficiency = max(compute, streamed bytes / peak) / measured, i.e. how close a
    setting gets to the physical bound (1.0 is the bound itself);
  * pinned RAM / packed bytes (the budget is <= 1.05);
  * with a compile of each block (inductor, default mode, as per-block compile nodes do; on by
    default on CUDA): the first setting's streamed step against the resident one, both compiled,
    whether their outputs are bit-identical and how many graphs the timed passes compiled;
  * with --lora-settings, those settings again with a rank --lora-rank LoRA merged into every
    block's device copy (as the node merges one: factors uploaded beside the block, merged on the
    copy stream in the merge dtype, then stochastically rounded to bf16).
Prints a table and writes JSON (device, torch version, settings) to bench/results/; --rows also
appends one JSON row per measurement as it is taken (bench/gpu_session.sh reads them back).
ComfyUI's own offloading is compared in a real workflow by bench/comfy_wan.py.
``--smoke`` runs tiny shapes on CPU in a few seconds so the script never rots.

Weights are random bf16; blocks are self-contained (SDPA attention + MLP +
modulation) with the real weight shapes, so bytes and FLOPs are realistic.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import logging
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from offload_core import HostStorage, LayerwiseStreamer  # noqa: E402
from offload_core.host.side_tensors import SideTensors  # noqa: E402
from session_rows import append_row  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GB = 1e9


# ------------------------------------------------------------------ blocks
class RMSNorm(nn.Module):
    def __init__(self, dim: int, **kw) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, **kw))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, n, d = x.shape
    return x.view(b, n, heads, d // heads).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    b, h, n, hd = x.shape
    return x.transpose(1, 2).reshape(b, n, h * hd)


class Attention(nn.Module):
    """q/k/v/o projections with RMS-normed q and k (Wan self- and cross-attention)."""

    def __init__(self, dim: int, heads: int, **kw) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, **kw) for _ in range(4))
        self.norm_q, self.norm_k = RMSNorm(dim, **kw), RMSNorm(dim, **kw)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        q = _heads(self.norm_q(self.q(x)), self.heads)
        k = _heads(self.norm_k(self.k(ctx)), self.heads)
        v = _heads(self.v(ctx), self.heads)
        return self.o(_merge(F.scaled_dot_product_attention(q, k, v)))


class WanBlock(nn.Module):
    """Wan 2.1 block: modulated self-attention, cross-attention to text, modulated FFN."""

    def __init__(self, dim: int, ffn: int, heads: int, **kw) -> None:
        super().__init__()
        self.self_attn = Attention(dim, heads, **kw)
        self.cross_attn = Attention(dim, heads, **kw)
        self.norm3 = nn.LayerNorm(dim, **kw)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn, **kw), nn.GELU("tanh"), nn.Linear(ffn, dim, **kw))
        self.modulation = nn.Parameter(torch.randn(1, 6, dim, **kw) / dim**0.5)

    def forward(self, x: torch.Tensor, e: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        sh1, sc1, g1, sh2, sc2, g2 = (self.modulation + e).chunk(6, dim=1)
        d = x.shape[-1]
        h = F.layer_norm(x, (d,)) * (1 + sc1) + sh1
        x = x + g1 * self.self_attn(h, h)
        x = x + self.cross_attn(self.norm3(x), ctx)
        return x + g2 * self.ffn(F.layer_norm(x, (d,)) * (1 + sc2) + sh2)


class FluxStream(nn.Module):
    """One stream (image or text) of a Flux double block."""

    def __init__(self, dim: int, heads: int, **kw) -> None:
        super().__init__()
        self.mod = nn.Linear(dim, 6 * dim, **kw)
        self.qkv = nn.Linear(dim, 3 * dim, **kw)
        self.norm_q, self.norm_k = RMSNorm(dim // heads, **kw), RMSNorm(dim // heads, **kw)
        self.proj = nn.Linear(dim, dim, **kw)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, **kw), nn.GELU("tanh"), nn.Linear(4 * dim, dim, **kw))


class FluxDoubleBlock(nn.Module):
    def __init__(self, dim: int, heads: int, **kw) -> None:
        super().__init__()
        self.heads = heads
        self.img, self.txt = FluxStream(dim, heads, **kw), FluxStream(dim, heads, **kw)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = img.shape[-1]
        mods, qs, ks, vs = [], [], [], []
        for s, x in ((self.txt, txt), (self.img, img)):
            m = s.mod(F.silu(vec))[:, None].chunk(6, dim=-1)
            q, k, v = (_heads(t, self.heads) for t in s.qkv(F.layer_norm(x, (d,)) * (1 + m[1]) + m[0]).chunk(3, -1))
            mods.append(m), qs.append(s.norm_q(q)), ks.append(s.norm_k(k)), vs.append(v)
        attn = _merge(F.scaled_dot_product_attention(torch.cat(qs, 2), torch.cat(ks, 2), torch.cat(vs, 2)))
        outs = []
        for s, x, m, a in ((self.txt, txt, mods[0], attn[:, : txt.shape[1]]), (self.img, img, mods[1], attn[:, txt.shape[1] :])):
            x = x + m[2] * s.proj(a)
            outs.append(x + m[5] * s.mlp(F.layer_norm(x, (d,)) * (1 + m[4]) + m[3]))
        return outs[1], outs[0]


class FluxSingleBlock(nn.Module):
    def __init__(self, dim: int, heads: int, **kw) -> None:
        super().__init__()
        self.heads, self.dim = heads, dim
        self.mod = nn.Linear(dim, 3 * dim, **kw)
        self.linear1 = nn.Linear(dim, 7 * dim, **kw)
        self.linear2 = nn.Linear(5 * dim, dim, **kw)
        self.norm_q, self.norm_k = RMSNorm(dim // heads, **kw), RMSNorm(dim // heads, **kw)

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.mod(F.silu(vec))[:, None].chunk(3, dim=-1)
        qkv, mlp = self.linear1(F.layer_norm(x, (self.dim,)) * (1 + scale) + shift).split([3 * self.dim, 4 * self.dim], -1)
        q, k, v = (_heads(t, self.heads) for t in qkv.chunk(3, -1))
        a = _merge(F.scaled_dot_product_attention(self.norm_q(q), self.norm_k(k), v))
        return x + gate * self.linear2(torch.cat([a, F.gelu(mlp, approximate="tanh")], -1))


# ------------------------------------------------------------------ models
@dataclass
class Spec:
    name: str
    kind: str  # "wan" or "flux"
    dim: int
    heads: int
    tokens: int  # image/video tokens
    ctx: int  # text tokens
    blocks: int  # Wan blocks, or Flux double blocks
    singles: int = 0  # Flux single blocks
    ffn: int = 0


def build_blocks(spec: Spec, **kw) -> list[nn.Module]:
    if spec.kind == "wan":
        return [WanBlock(spec.dim, spec.ffn, spec.heads, **kw) for _ in range(spec.blocks)]
    blocks: list[nn.Module] = [FluxDoubleBlock(spec.dim, spec.heads, **kw) for _ in range(spec.blocks)]
    return blocks + [FluxSingleBlock(spec.dim, spec.heads, **kw) for _ in range(spec.singles)]


class Stack(nn.Module):
    """The block list plus the per-step inputs; ``forward`` is one denoising pass."""

    def __init__(self, spec: Spec, device: torch.device, blocks: list[nn.Module] | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": torch.bfloat16}
        self.spec = spec
        self.blocks = nn.ModuleList(build_blocks(spec, **kw) if blocks is None else blocks)
        g = torch.Generator(device=device).manual_seed(0)
        self.x = torch.randn(1, spec.tokens, spec.dim, generator=g, **kw)
        self.txt = torch.randn(1, spec.ctx, spec.dim, generator=g, **kw)
        self.vec = torch.randn(1, 6 if spec.kind == "wan" else 1, spec.dim, generator=g, **kw) * 0.1

    @torch.no_grad()
    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """One pass over the image tokens ``x`` (default ``self.x``; another length is another
        resolution)."""
        x = self.x if x is None else x
        if self.spec.kind == "wan":
            for b in self.blocks:
                x = b(x, self.vec, self.txt)
            return x
        img, txt, vec = x, self.txt, self.vec[:, 0]
        for b in self.blocks[: self.spec.blocks]:
            img, txt = b(img, txt, vec)
        h = torch.cat([txt, img], 1)
        for b in self.blocks[self.spec.blocks :]:
            h = b(h, vec)
        return h


def specs(args: argparse.Namespace) -> list[Spec]:
    if args.smoke:
        return [spec for spec in (
            # Six blocks each: with two resident and three slots, blocks are still copied every pass.
            Spec("wan-smoke", "wan", dim=64, heads=4, tokens=64, ctx=16, blocks=6, ffn=128),
            Spec("flux-smoke", "flux", dim=64, heads=4, tokens=48, ctx=16, blocks=2, singles=4),
        ) if spec.kind in args.models]
    out = []
    if "wan" in args.models:
        # 480p, 81 frames: 21 latent frames x 30 x 52 patches; 512 text tokens
        out.append(Spec("wan2.1-14b", "wan", dim=5120, heads=40, tokens=32760, ctx=512, blocks=args.wan_blocks, ffn=13824))
    if "flux" in args.models:
        # 1024x1024: 64 x 64 patches + 512 text tokens
        out.append(Spec("flux-dev", "flux", dim=3072, heads=24, tokens=4096, ctx=512, blocks=args.flux_double, singles=args.flux_single))
    return out


# ------------------------------------------------------------------ timing
def timed(device: torch.device, fn: Callable[[], object], repeat: int) -> list[float]:
    """Seconds per call; CUDA events on GPU, so host-side queuing is not mistaken for work."""
    out = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def copy_bandwidth(device: torch.device, src: torch.Tensor, repeat: int) -> float:
    """Best GB/s of one host->device copy of ``src`` on a side stream (as the engine copies)."""
    dst = torch.empty(src.numel(), dtype=torch.uint8, device=device)
    if device.type != "cuda":
        return src.numel() / min(timed(device, lambda: dst.copy_(src), repeat)) / GB
    stream = torch.cuda.Stream(device)
    best = float("inf")
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return src.numel() / best / GB


def link_peak(device: torch.device, nbytes: int, repeat: int) -> dict:
    """Pinned (exact-size, registered) and pageable H2D bandwidth of one large copy."""
    host = HostStorage([nbytes], pin=device.type == "cuda")
    buf = host.buffer(0)
    buf.fill_(1)
    pinned = copy_bandwidth(device, buf, repeat)
    was_pinned = host.is_pinned(0)
    host.release()
    pageable = copy_bandwidth(device, torch.ones(nbytes, dtype=torch.uint8), repeat)
    return {"copy_bytes": nbytes, "pinned_h2d_GBps": pinned, "pageable_h2d_GBps": pageable, "pinned": was_pinned}


def peak_memory_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int | None:
    """Peak bytes allocated on the device since the last reset: weights, inputs and activations."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


# ------------------------------------------------------------------ a LoRA on every block
class BenchLora:
    """A random rank-``rank`` LoRA on every linear weight of every block, merged the way the node
    merges core's patches into a streamed copy: the factors of one block are uploaded beside it
    (SideTensors, no host wait), the product is taken in float32, added to the weight in the merge
    dtype (float16 on a GPU, as core's ``lora_compute_dtype``; float32 on a CPU), and the sum is
    rounded stochastically to the weight's bf16 with a seed of its own. Only the cost matters
    here, so the seed is per tensor name and the factors are small random values."""

    def __init__(self, blocks: list[nn.Module], rank: int, device: torch.device) -> None:
        self.device = device
        self.merge_dtype = torch.float16 if device.type == "cuda" else torch.float32
        self.names: list[dict[str, int]] = []
        groups: list[list[torch.Tensor]] = []
        g = torch.Generator().manual_seed(32)
        for block in blocks:
            names, factors = {}, []
            for mod_name, mod in block.named_modules():
                if isinstance(mod, nn.Linear):
                    out_f, in_f = mod.weight.shape
                    names[f"{mod_name}.weight"] = len(factors)
                    factors.append(torch.randn(rank, in_f, generator=g).mul_(in_f ** -0.5).to(torch.bfloat16))
                    factors.append(torch.randn(out_f, rank, generator=g).mul_(0.01).to(torch.bfloat16))
            self.names.append(names)
            groups.append(factors)
        self.scale = 1.0  # alpha / rank with alpha = rank
        self.side = SideTensors(groups, device)
        self.generator = torch.Generator(device=device)

    def __call__(self, block_index: int, name: str, view: torch.Tensor) -> torch.Tensor:
        index = self.names[block_index].get(name)
        if index is None:
            return view
        factors = self.side.load(block_index)
        down, up = factors[index], factors[index + 1]
        work = view.to(self.merge_dtype, copy=True)
        work += (up.float() @ down.float()).mul_(self.scale).to(self.merge_dtype)
        if view.dtype != torch.bfloat16:
            return work.to(view.dtype)
        self.generator.manual_seed(zlib.crc32(f"{block_index}.{name}".encode()))
        bits = work.float().view(torch.int32)
        bits += torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device,
                              generator=self.generator)
        return bits.bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)

    def close(self) -> None:
        self.side.close()


# ------------------------------------------------------------------ runs
AUTO_WARM_PASSES = 20  # at most: the tuner leaves one out, measures, applies, leaves one out, checks


def parse_settings(text: str, n: int) -> list[tuple[int | str, int | str]]:
    """"R:P,..." with R a block count or a percentage of the stack, or "auto"; duplicates dropped."""
    out: list[tuple[int | str, int | str]] = []
    for item in text.split(","):
        if item == "auto":
            if ("auto", "auto") not in out:
                out.append(("auto", "auto"))
            continue
        r, p = item.split(":")
        res = round(n * float(r[:-1]) / 100) if r.endswith("%") else int(r)
        setting = (min(max(res, 0), n), int(p))
        if setting not in out:
            out.append(setting)
    return out


def run_naive(stack: Stack, device: torch.device, steps: int) -> float:
    """Classic block swap: synchronous ``.to(device)`` before and ``.to("cpu")`` after each block."""
    def onload(module: nn.Module, args: tuple) -> None:
        module.to(device)

    def offload(module: nn.Module, args: tuple, output: object) -> None:
        module.to("cpu")

    blocks = [copy.deepcopy(b).to("cpu") for b in stack.blocks]  # one block at a time: no 2x VRAM
    for b in blocks:
        b.register_forward_pre_hook(onload)
        b.register_forward_hook(offload)
    cpu = Stack(stack.spec, device, blocks=blocks)
    cpu()  # warm-up
    step = statistics.median(timed(device, cpu, steps))
    del cpu
    return step


def run_streaming(stack: Stack, device: torch.device, resident: int | str, prefetch: int | str, args,
                  ref_step: float, link: float, lora_rank: int = 0, budget: int | None = None) -> dict:
    """One setting's streamed steps; "auto" leaves resident blocks and prefetch to the tuner,
    within ``budget`` bytes of device memory."""
    auto = resident == "auto"
    st = LayerwiseStreamer(stack.blocks, device, resident=resident, prefetch=prefetch, pin=True,
                           vram_budget_bytes=budget if auto else None)
    lora = BenchLora(list(stack.blocks), lora_rank, device) if lora_rank else None
    t0 = time.perf_counter()
    st.attach(transform=lora, root=stack if auto else None)
    attach_s = time.perf_counter() - t0
    stack()  # warm-up pass, also wraps the prefetch around
    for _ in range(AUTO_WARM_PASSES if auto else 0):  # auto: until the tuner holds its setting
        if st.tuning()["phase"] == "hold":
            break
        stack()
    peak_memory_reset(device)
    st.telemetry.reset()
    steps = timed(device, stack, args.steps)
    peak = peak_memory(device)
    tel = st.telemetry.snapshot(wait=True)
    step = statistics.median(steps)
    sizes = [p.nbytes for p in st._plan.packs]
    streamed = sum(sizes[i] for i in st.streamed_indices)
    bound = max(ref_step, streamed / (link * GB))
    block_bw = copy_bandwidth(device, st._plan.packs[st.streamed_indices[0]].host, 3) if st.streamed_indices else None
    host = st.host_bytes()
    tuning = st.tuning()
    result = {
        "resident": resident,
        "prefetch": prefetch,
        "auto": auto,
        "lora_rank": lora_rank,
        "blocks": len(stack.blocks),
        "streamed": len(st.streamed_indices),
        "step_s": step,
        "step_s_all": steps,
        "attach_s": attach_s,
        "streamed_bytes_per_step": streamed,
        "bound_s": bound,
        "efficiency": bound / step,
        "overhead_vs_resident": step / ref_step - 1,
        "per_block_copy_GBps": block_bw,
        "bound_bytes": st.bound_bytes(),
        "peak_vram_bytes": peak,
        "pinned_over_packed": host["pinned"] / host["packed"] if host["packed"] else None,
        "host": host,
        "telemetry": {k: v / len(steps) if k in ("bytes_copied", "copies", "compute_wait_s", "host_wait_s") else v
                      for k, v in tel.items()},
    }
    if auto:  # what the tuner chose, and why
        result.update(resident=len(tuning["setting"]["resident_blocks"]), prefetch=tuning["setting"]["prefetch"],
                      budget_bytes=budget, tuning=tuning)
    st.close()
    if lora is not None:
        lora.close()
    return result


def run_compiled(stack: Stack, device: torch.device, resident: int, prefetch: int, args) -> dict:
    """Each block compiled on its own (the setup Apply Layerwise Offload streams compiled, see
    docs/torch-compile.md), resident on the device, then streamed: the ratio of their steps,
    whether their outputs are the same bits, and the graphs compiled during the timed passes."""
    from torch._dynamo.utils import counters
    compiled = Stack(stack.spec, device, blocks=[torch.compile(b) for b in stack.blocks])
    resident_out = compiled()  # compiles
    resident_steps = timed(device, compiled, args.steps)
    st = LayerwiseStreamer(list(stack.blocks), device, resident=resident, prefetch=prefetch, pin=True)
    st.attach(compiled=True)
    try:
        streamed_out = compiled()  # warm-up: wraps the prefetch around
        graphs = counters["stats"]["unique_graphs"]
        streamed_steps = timed(device, compiled, args.steps)
        recompiled = counters["stats"]["unique_graphs"] - graphs
    finally:
        st.close()
    resident_step, streamed_step = statistics.median(resident_steps), statistics.median(streamed_steps)
    return {"resident": resident, "prefetch": prefetch, "resident_compiled_step_s": resident_step,
            "streamed_compiled_step_s": streamed_step, "streamed_over_resident": streamed_step / resident_step,
            "bit_identical": torch.equal(resident_out, streamed_out), "graphs_compiled_while_timed": recompiled}


def bench_model(spec: Spec, device: torch.device, args: argparse.Namespace, link: float) -> dict:
    """Every measurement of one model, each appended to --rows as soon as it is taken."""
    torch.manual_seed(0)
    stack = Stack(spec, device)
    block_bytes = [sum(t.numel() * t.element_size() for t in b.state_dict().values()) for b in stack.blocks]
    stack()
    peak_memory_reset(device)
    resident_step = statistics.median(timed(device, stack, args.steps))
    resident_peak = peak_memory(device)
    append_row(args.rows, {"bench": "layerwise", "row": "resident", "model": spec.name,
                           "blocks": len(stack.blocks), "weights_bytes": sum(block_bytes),
                           "step_s": resident_step, "peak_vram_bytes": resident_peak})
    runs = [(r, p, 0) for r, p in parse_settings(args.settings, len(stack.blocks))]
    if args.lora_rank:
        runs += [(r, p, args.lora_rank) for r, p in parse_settings(args.lora_settings, len(stack.blocks))]
    # auto's device memory: the most any other setting takes (resident blocks and slots)
    budget = max((LayerwiseStreamer(stack.blocks, "cpu", resident=r, prefetch=p).bound_bytes()
                  for r, p, _ in runs if r != "auto"), default=None)
    streaming = []
    for r, p, rank in runs:
        streaming.append(run_streaming(stack, device, r, p, args, resident_step, link, rank, budget))
        row = {k: v for k, v in streaming[-1].items() if k not in ("step_s_all", "host", "telemetry", "tuning")}
        append_row(args.rows, {"bench": "layerwise", "row": "streaming", "model": spec.name,
                               "link_GBps": link, "resident_step_s": resident_step, **row,
                               "compute_wait_s": streaming[-1]["telemetry"]["compute_wait_s"],
                               "transforms": streaming[-1]["telemetry"]["transforms"]})
    naive = run_naive(stack, device, max(1, args.steps // 2)) if not args.skip_naive else None
    if naive is not None:
        append_row(args.rows, {"bench": "layerwise", "row": "naive", "model": spec.name, "step_s": naive})
    compiled = None
    if args.compiled:
        compiled = run_compiled(stack, device, *parse_settings(args.settings, len(stack.blocks))[0], args)
        append_row(args.rows, {"bench": "layerwise", "row": "compiled", "model": spec.name, **compiled})
    return {
        "spec": asdict(spec),
        "blocks": len(stack.blocks),
        "block_bytes": block_bytes,
        "weights_bytes": sum(block_bytes),
        "resident_step_s": resident_step,
        "resident_peak_vram_bytes": resident_peak,
        "naive_swap_step_s": naive,
        "streaming": streaming,
        "compiled": compiled,
    }


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def print_table(result: dict) -> None:
    link = result["link"]
    print(f"device: {result['device']}  torch {result['torch']}  link peak {link['pinned_h2d_GBps']:.1f} GB/s pinned, "
          f"{link['pageable_h2d_GBps']:.1f} GB/s pageable")  # fmt: skip
    head = (f"{'model':<12} {'setting':<10} {'step s':>9} {'bound s':>9} {'eff':>6} {'+%':>7} {'blk GB/s':>9} "
            f"{'stall s':>8} {'peak GiB':>9} {'pin/pack':>8}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for name, m in result["models"].items():
        print(f"{name:<12} {'resident':<10} {m['resident_step_s']:>9.4f} {'':>9} {'':>6} {'':>7} {'':>9} {'':>8} "
              f"{_gib(m['resident_peak_vram_bytes']):>9}")  # fmt: skip
        if m["naive_swap_step_s"] is not None:
            print(f"{name:<12} {'naive .to':<10} {m['naive_swap_step_s']:>9.4f} {'':>9} {'':>6} "
                  f"{100 * (m['naive_swap_step_s'] / m['resident_step_s'] - 1):>6.1f}%")  # fmt: skip
        for s in m["streaming"]:
            bw = f"{s['per_block_copy_GBps']:.1f}" if s["per_block_copy_GBps"] else "-"
            pin = f"{s['pinned_over_packed']:.3f}" if s["pinned_over_packed"] is not None else "-"
            setting = (("auto " if s.get("auto") else "") + f"r{s['resident']} p{s['prefetch']}"
                       + (f" L{s['lora_rank']}" if s["lora_rank"] else ""))
            print(f"{name:<12} {setting:<10} {s['step_s']:>9.4f} {s['bound_s']:>9.4f} "
                  f"{s['efficiency']:>6.2f} {100 * s['overhead_vs_resident']:>6.1f}% {bw:>9} "
                  f"{s['telemetry']['compute_wait_s']:>8.4f} {_gib(s['peak_vram_bytes']):>9} {pin:>8}")  # fmt: skip
        c = m.get("compiled")
        if c:
            print(f"{name:<12} {'compiled':<10} r{c['resident']} p{c['prefetch']}: streamed "
                  f"{c['streamed_compiled_step_s']:.4f} s / resident {c['resident_compiled_step_s']:.4f} s "
                  f"= {c['streamed_over_resident']:.2f}, bit-identical {c['bit_identical']}, "
                  f"graphs compiled while timed {c['graphs_compiled_while_timed']}")  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, a few seconds")
    ap.add_argument("--models", default="wan,flux", help="comma list: wan, flux")
    ap.add_argument("--wan-blocks", type=int, default=8, help="Wan blocks to build (the full model has 40)")
    ap.add_argument("--flux-double", type=int, default=4, help="Flux double blocks (full model: 19)")
    ap.add_argument("--flux-single", type=int, default=8, help="Flux single blocks (full model: 38)")
    ap.add_argument("--settings", default="0:1,0:2,25%:1,50%:1,auto",
                    help="resident:prefetch list; resident may be N%%; auto: both left to the engine")
    ap.add_argument("--steps", type=int, default=3, help="timed passes per measurement")
    ap.add_argument("--link-bytes", type=int, default=1 << 30, help="size of the link-peak copy")
    ap.add_argument("--lora-settings", default="2:2",
                    help="resident:prefetch list measured again with a LoRA on every block")
    ap.add_argument("--lora-rank", type=int, default=0, help="rank of that LoRA; 0: no LoRA runs")
    ap.add_argument("--skip-naive", action="store_true")
    ap.add_argument("--rows", type=Path, help="append one JSON row per measurement here")
    ap.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=None,
                    help="the compiled row (each block compiled; default: on CUDA only)")
    ap.add_argument("--out", type=Path, help="JSON path (default: bench/results/layerwise-<device>-<time>.json)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.smoke:
        args.link_bytes = min(args.link_bytes, 8 << 20)
        args.steps = min(args.steps, 2)
        torch.set_num_threads(1)  # tiny shapes: thread fan-out only adds noise
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.compiled is None:
        args.compiled = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    link = link_peak(device, args.link_bytes, 3 if args.smoke else 5)
    append_row(args.rows, {"bench": "layerwise", "row": "link", "device": name, "torch": torch.__version__,
                           **link})
    result = {
        "device": name,
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "smoke": args.smoke,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "link": link,
        "models": {},
    }
    for spec in specs(args):
        result["models"][spec.name] = bench_model(spec, device, args, link["pinned_h2d_GBps"])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_table(result)
    write_result(result, "layerwise", name, args)
    return result


def write_result(result: dict, bench: str, device_name: str, args) -> Path:
    """Write a run's JSON to --out, else to bench/results/<bench>-<device>-<time>.json."""
    out = args.out
    if out is None:
        slug = "smoke" if args.smoke else device_name.lower().replace(" ", "-")
        out = RESULTS / f"{bench}-{slug}-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return out

if __name__ == "__main__":
    main()
