"""PackedBlock: layout, faithful round trips, zero-copy, refusals, transforms on device copies."""

from __future__ import annotations

import pytest
import torch
from toy_models import ToyBlock, assert_restored, bits, snapshot
from torch import nn

from offload_core import PackedBlock, check_packable, tensor_refs
from offload_core.host.layout import ALIGN, PHASE, empty_at_phase


def _block() -> ToyBlock:
    torch.manual_seed(0)
    return ToyBlock(32, 4, shared=nn.Parameter(torch.rand(32)))


def _packed(module: nn.Module) -> tuple[PackedBlock, torch.Tensor]:
    pb = PackedBlock(tensor_refs(module, 0), index=0)
    host = torch.empty(pb.nbytes, dtype=torch.uint8)
    pb.pack(host)
    return pb, host


def _off_phase_linear(phase: int) -> nn.Linear:
    """A Linear whose weight sits ``phase`` bytes past a PHASE boundary, as a weight read from a
    safetensors memory map often does."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 16)
    w = empty_at_phase(lin.weight.numel() * 4, phase).view(torch.float32).view(16, 64)
    w.copy_(lin.weight.detach())
    lin.weight = nn.Parameter(w, requires_grad=False)
    return lin


@pytest.mark.parametrize("phase", [4, 8, 60])
def test_address_phase_is_kept_in_the_pack_where_asked_and_always_in_fresh_copies(phase):
    """A CPU kernel's summation order can follow its operand's address modulo 16; a pack for a
    module that computes from it keeps each tensor's address phase, and so does ``restore``."""
    lin = _off_phase_linear(phase)
    x = torch.randn(1, 64)
    reference = lin(x)
    assert lin.weight.data_ptr() % PHASE == phase
    pb = PackedBlock(tensor_refs(lin, 0), index=0, keep_address_phase=True)
    pb.pack(empty_at_phase(pb.nbytes, 0))
    assert lin.weight.data_ptr() % PHASE == phase
    assert torch.equal(lin(x), reference)
    pb.restore(keep_host=False)
    assert lin.weight.data_ptr() % PHASE == phase
    assert torch.equal(lin(x), reference)

    aligned = PackedBlock(tensor_refs(lin, 0), index=0)  # device-slot packs stay aligned
    assert all(e.offset % ALIGN == 0 for e in aligned.entries)
    with pytest.raises(ValueError, match="boundary"):
        PackedBlock(tensor_refs(lin, 0), index=0, keep_address_phase=True).pack(empty_at_phase(pb.nbytes, 4))


def test_a_tensor_off_its_own_element_size_packs_and_restores():
    """A file may leave an int64 buffer 4 bytes off an 8-byte boundary; its phase is kept as far
    as a typed view allows."""
    raw = bytearray(256)
    ids = torch.frombuffer(raw, dtype=torch.int64, count=8, offset=4)
    ids.copy_(torch.arange(8))
    m = nn.Module()
    m.register_buffer("ids", ids)
    assert m.ids.data_ptr() % 8 == 4
    pb = PackedBlock(tensor_refs(m, 0), index=0, keep_address_phase=True)
    pb.pack(empty_at_phase(pb.nbytes, 0))
    assert m.ids.data_ptr() % 8 == 0 and torch.equal(m.ids, torch.arange(8))
    pb.restore(keep_host=False)
    assert torch.equal(m.ids, torch.arange(8))


def test_layout_is_aligned_grouped_and_dedups_tied_weights():
    blk = _block()
    pb = PackedBlock(tensor_refs(blk, 0), index=0)
    assert pb.nbytes % ALIGN == 0
    assert all(e.offset % ALIGN == 0 for e in pb.entries)
    dtypes = [e.dtype for e in pb.entries]
    groups = [d for i, d in enumerate(dtypes) if i == 0 or dtypes[i - 1] != d]
    assert len(groups) == len(set(dtypes)), f"dtypes not grouped: {dtypes}"
    assert {torch.float32, torch.bfloat16, torch.float8_e5m2, torch.float8_e4m3fn, torch.int64, torch.bool} <= set(
        dtypes
    )
    # the tied weight is packed once and bound under both names
    assert pb.num_bindings == len(pb.entries) + 1
    labels = {e.label for e in pb.entries}
    assert ("block 0: tied_a.weight" in labels) != ("block 0: tied_b.weight" in labels)
    ends = sorted((e.offset, e.offset + e.nbytes) for e in pb.entries)
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # no overlaps


def test_views_round_trip_bitwise_over_host_and_slot():
    blk = _block()
    with torch.no_grad():  # bit patterns that value comparisons would hide
        blk.qkv.bias[0] = float("nan")
        blk.qkv.bias[1] = -0.0
    before, keys = snapshot(blk), list(blk.state_dict())
    pb, host = _packed(blk)
    slot = torch.zeros(pb.nbytes + 4096, dtype=torch.uint8)  # a larger "device slot"
    slot[: pb.nbytes].copy_(host)
    for buf in (host, slot):
        views = pb.views(buf)
        pb.bind(views)
        for name, (_, raw, dtype, _, shape, stride) in before.items():
            t = dict([*blk.named_parameters(remove_duplicate=False), *blk.named_buffers(remove_duplicate=False)])[
                name
            ]
            assert torch.equal(bits(t), raw) and t.dtype == dtype and t.shape == shape, name
    assert blk.wt.stride() == (1, 32)  # a transposed weight keeps its strides
    pb.restore(keep_host=False)
    assert_restored(blk, before, keys)


def test_pack_is_zero_copy_for_dense_tensors_and_keeps_non_dense_originals():
    blk = _block()
    before, keys = snapshot(blk), list(blk.state_dict())
    original_qkv = blk.qkv.weight.data_ptr()
    pb, host = _packed(blk)
    lo, hi = host.data_ptr(), host.data_ptr() + host.numel()
    assert lo <= blk.qkv.weight.data_ptr() < hi and blk.qkv.weight.data_ptr() != original_qkv
    (exp,) = [e for e in pb.entries if e.label.endswith("bias_exp")]
    assert not exp.dense and exp.original is not None  # an expanded buffer cannot be re-created from bytes
    assert blk.bias_exp.stride() == (0, 1)
    pb.restore(keep_host=True)  # CPU tensors alias the pack
    assert lo <= blk.qkv.weight.data_ptr() < hi
    assert_restored(blk, before, keys)
    pb.restore(keep_host=False)  # the pack may now be freed: fresh memory
    assert not lo <= blk.qkv.weight.data_ptr() < hi
    del host
    assert_restored(blk, before, keys)


def test_release_drops_tensors_and_bind_brings_them_back():
    blk = _block()
    pb, host = _packed(blk)
    pb.release()
    assert blk.qkv._parameters["weight"] is None and blk._buffers["perm"] is None
    assert blk.tied_a._parameters["weight"] is None and blk.tied_b._parameters["weight"] is None
    pb.bind(pb.views(host))
    assert blk.tied_a.weight is blk.tied_b.weight


def test_views_reject_small_or_wrong_buffers():
    pb = PackedBlock(tensor_refs(_block(), 0), index=0)
    with pytest.raises(ValueError, match=f">= {pb.nbytes} bytes"):
        pb.views(torch.empty(pb.nbytes - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        pb.views(torch.empty(pb.nbytes, dtype=torch.float32))


class _Dispatching(torch.Tensor):
    """Intercepts dispatch, so its bytes may not be its values, and names no inner tensors."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        with torch._C._DisableTorchDispatch():
            return func(*args, **(kwargs or {}))


class _WithTensorAttr(torch.Tensor):
    """Keeps a tensor beside its storage: the engine would not move it with the data."""


def _with_tensor_attr() -> torch.Tensor:
    t = torch.randn(4).as_subclass(_WithTensorAttr)
    t.scale = torch.ones(())
    return t


@pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions")
@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: torch.randn(4).as_subclass(_Dispatching), TypeError, "subclass .*_Dispatching"),
        (lambda: _with_tensor_attr(), TypeError, "_WithTensorAttr keeps a tensor in its attribute 'scale'"),
        (lambda: nn.parameter.UninitializedParameter(), TypeError, "subclass .*UninitializedParameter"),
        (lambda: torch.randn(4, 4).to_sparse(), TypeError, "not strided"),
        (lambda: torch.empty(4, device="meta"), ValueError, "meta tensor"),
        (lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8), TypeError, "quantized"),
        (lambda: torch.randn(4, dtype=torch.complex64).conj(), ValueError, "conj/neg"),
    ],
)
def test_unpackable_tensors_are_refused_by_name(make, exc, match):
    with pytest.raises(exc, match=match):
        check_packable(make(), "blk.weird")
    m = nn.Module()
    m.register_buffer("weird", make())
    with pytest.raises(exc, match="weird"):
        PackedBlock(tensor_refs(m, 3), index=3)


def test_transform_rewrites_a_copy_and_never_the_pack():
    blk = _block()
    pb, host = _packed(blk)
    master = host.clone()
    names = [e.label for e in pb.entries]
    calls = []

    def double(block, name, view):
        calls.append((block, name))
        return view * 2 if name == "qkv.weight" else view

    for _ in range(2):  # every fresh copy gets the same result: nothing compounds
        slot = host.clone()  # what a device slot holds after its copy
        assert pb.apply_transform(slot, double) == 1
        w = pb.views(slot)[names.index("block 0: qkv.weight")]
        assert torch.equal(w, blk.qkv.weight * 2)
        others = [i for i, n in enumerate(names) if n != "block 0: qkv.weight"]
        assert all(torch.equal(bits(pb.views(slot)[i]), bits(pb.views(host)[i])) for i in others)
    assert torch.equal(host, master)  # the pack keeps the untransformed values
    assert {n for _, n in calls} == {e.owner[1] for e in pb.entries} and {b for b, _ in calls} == {0}


@pytest.mark.parametrize(
    "transform,exc,match",
    [
        (lambda b, n, v: v[:1] if n == "qkv.weight" else v, ValueError, "shape and dtype.*qkv.weight"),
        (lambda b, n, v: v.double() if v.is_floating_point() else v, ValueError, "shape and dtype"),
        (lambda b, n, v: v.mul_(1) if n == "mlp_out.bias" else v, ValueError, "in place"),
        (lambda b, n, v: v.tolist(), TypeError, "plain torch.Tensor"),
    ],
)
def test_transform_output_is_checked(transform, exc, match):
    blk = _block()
    pb, host = _packed(blk)
    with pytest.raises(exc, match=match):
        pb.apply_transform(host.clone(), transform)
