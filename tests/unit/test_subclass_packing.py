"""Tensor subclasses in the engine: wrapper subclasses (``__tensor_flatten__``, like ComfyUI's
QuantizedTensor) and storage subclasses (like ComfyUI-GGUF's GGMLTensor).

The classes here are real torch subclasses written the way those are (a wrapper over int8 data
and a float32 scale, dequantized at dispatch; a storage tensor with a logical ``shape`` and
Python attributes). The real ones run through a real server in tests/test_quantized_models.py.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from offload_core import LayerwiseStreamer, ModuleSwap, PackedBlock, check_packable, tensor_refs


class Int8Tensor(torch.Tensor):
    """int8 values times a float32 scale; every op but the generic ones runs on the dequantized values."""

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, orig_dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=orig_dtype, device=qdata.device)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, orig_dtype: torch.dtype):
        self._qdata, self._scale, self._orig_dtype = qdata, scale, orig_dtype

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Int8Tensor:
        scale = (w.abs().amax() / 127).float()
        return cls((w / scale).round().clamp(-127, 127).to(torch.int8), scale, w.dtype)

    def dequantize(self) -> torch.Tensor:
        return self._qdata.to(self._orig_dtype) * self._scale.to(self._orig_dtype)

    def __tensor_flatten__(self):
        return ["_qdata", "_scale"], {"orig_dtype": self._orig_dtype}

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return Int8Tensor(inner["_qdata"], inner["_scale"], ctx["orig_dtype"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.detach.default:  # the scale is cloned, as 0.3.75's QuantizedTensor does
            qt = args[0]
            return type(qt)(qt._qdata.detach(), qt._scale.clone(), qt._orig_dtype)
        if func in (torch.ops.aten.clone.default, torch.ops.aten._to_copy.default):
            qt = args[0]
            moved = {k: v for k, v in kwargs.items() if k != "dtype"}
            return type(qt)(func(qt._qdata, **moved), func(qt._scale, **moved), qt._orig_dtype)

        def plain(x):
            return x.dequantize() if isinstance(x, Int8Tensor) else x

        return func(*[plain(a) for a in args], **{k: plain(v) for k, v in kwargs.items()})


class StrayScale(Int8Tensor):
    """Given a second scale its flatten does not name, which would not be packed."""


class RawBytes(torch.Tensor):
    """Raw bytes in its own storage, a logical shape and attributes, like GGUF's GGMLTensor."""

    def __new__(cls, data, *, logical, tag, patches=()):
        return super().__new__(cls, data)

    def __init__(self, data, *, logical, tag, patches=()):
        super().__init__()
        self.logical, self.tag, self.patches = logical, tag, list(patches)

    @property
    def shape(self):
        return self.logical

    def detach(self, *args, **kwargs):  # as GGMLTensor: a Parameter of it is the object itself
        return self


class QuantLinear(nn.Module):
    def __init__(self, dim: int, cls=Int8Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(cls.quantize(torch.randn(dim, dim) / dim ** 0.5), requires_grad=False)
        self.bias = nn.Parameter(torch.randn(dim) * 0.01, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.linear(x, self.weight.dequantize().to(x.dtype), self.bias)


class RawLinear(nn.Module):
    """Stores a float32 weight as raw bytes in a RawBytes parameter with its logical shape."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        w = torch.randn(dim, dim) / dim ** 0.5
        raw = RawBytes(w.reshape(-1).view(torch.uint8), logical=w.shape, tag="F32")
        self.weight = nn.Parameter(raw, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.data.view(torch.float32).reshape(self.weight.logical)
        return x + torch.nn.functional.linear(x, w)


def _blocks(depth=4, dim=32, kind=QuantLinear) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList([kind(dim) for _ in range(depth)])


def _run(blocks, x):
    for b in blocks:
        x = b(x)
    return x


def _inner_bytes(blocks) -> int:
    total = 0
    for b in blocks:
        w = b.weight
        total += w._qdata.numel() + w._scale.numel() * 4 + b.bias.numel() * 4
    return total


@pytest.mark.parametrize("resident,prefetch", [(0, 1), (1, 1), (2, 2), (4, 1)])
def test_wrapper_parameters_stream_bit_identically_and_keep_their_objects(resident, prefetch):
    blocks = _blocks()
    x = torch.randn(3, 32)
    ref = _run(blocks, x)
    objects = [b.weight for b in blocks]
    st = LayerwiseStreamer(blocks, "cpu", resident=resident, prefetch=prefetch)
    # Packed at the inner tensors' size: int8 data, a float32 scale, the bias; not 4 bytes a weight.
    assert st.host_bytes()["tensors"] == _inner_bytes(blocks)
    for keep in (True, False):
        st.attach()
        for _ in range(2):
            assert torch.equal(_run(blocks, x), ref)
        st.detach(keep_pack=keep)
        assert [b.weight for b in blocks] == objects
        assert all(type(w) is Int8Tensor and isinstance(w, nn.Parameter) for w in objects)
        assert torch.equal(_run(blocks, x), ref)
    st.close()


def test_kept_pack_is_reused_after_a_no_op_move():
    """A no-op ``.to()`` swaps in a rebuilt wrapper (Module._apply) over the same data: the kept
    pack still holds the module's values and is reused, not packed again."""
    blocks = _blocks()
    x = torch.randn(3, 32)
    ref = _run(blocks, x)
    st = LayerwiseStreamer(blocks, "cpu", resident=1, prefetch=1)
    st.attach()
    st.detach(keep_pack=True)
    blocks.to("cpu")
    st.telemetry.reset()
    st.attach()
    assert st.telemetry.blocks_packed == 0
    assert torch.equal(_run(blocks, x), ref)
    st.close()


def _doubled(t: Int8Tensor) -> Int8Tensor:
    return Int8Tensor.quantize(t.dequantize() * 2)


@pytest.mark.parametrize("kind", [QuantLinear, RawLinear])
def test_kept_pack_survives_a_re_wrap_of_its_memory(kind):
    """An owner that puts new Parameter objects over the same memory (core's set_attr_param, 0.33's
    quantized _apply) leaves the pack's values in place: it is reused and our objects come back."""
    blocks = _blocks(kind=kind)
    x = torch.randn(3, 32)
    ref = _run(blocks, x)
    objects = [b.weight for b in blocks]
    st = LayerwiseStreamer(blocks, "cpu", resident=1, prefetch=1)
    st.attach()
    st.detach(keep_pack=True)
    for b in blocks:
        w = b.weight
        b.weight = nn.Parameter(type(w).__tensor_unflatten__({"_qdata": w._qdata, "_scale": w._scale}, {
            "orig_dtype": w._orig_dtype}, w.size(), w.stride()) if kind is QuantLinear else w.data,
            requires_grad=False)
    assert all(b.weight is not o for b, o in zip(blocks, objects))
    st.telemetry.reset()
    st.attach()
    assert st.telemetry.blocks_packed == 0
    assert torch.equal(_run(blocks, x), ref)
    st.detach(keep_pack=True)
    assert [b.weight for b in blocks] == objects
    # Other values are a re-assignment: packed again, and kept.
    w = objects[0]
    other = nn.Parameter(Int8Tensor(-w._qdata, w._scale.clone(), torch.float32) if kind is QuantLinear
                         else RawBytes(w.data.view(torch.float32).neg().view(torch.uint8), logical=w.logical,
                                       tag=w.tag), requires_grad=False)
    blocks[0].weight = other
    want = _run(blocks, x)
    assert not torch.equal(want, ref)
    st.attach()
    assert st.telemetry.blocks_packed > 0
    assert torch.equal(_run(blocks, x), want)
    st.detach(keep_pack=True)
    assert blocks[0].weight is other
    st.close()


def test_transform_writes_a_new_wrapper_into_device_copies_only():
    blocks = _blocks()
    x = torch.randn(3, 32)
    ref = _run(blocks, x)
    expect = _blocks()
    for b in expect:
        b.weight = nn.Parameter(_doubled(b.weight), requires_grad=False)
    want = _run(expect, x)
    assert not torch.equal(want, ref)
    st = LayerwiseStreamer(blocks, "cpu", resident=1, prefetch=1)
    for _ in range(2):  # every attach merges into fresh copies: nothing compounds
        st.attach(transform=lambda block, name, t: _doubled(t) if name == "weight" else t)
        assert torch.equal(_run(blocks, x), want)
        assert st.telemetry.transforms >= len(blocks)
        st.detach(keep_pack=True)
        assert torch.equal(_run(blocks, x), ref)  # the pack kept the base weights
    st.close()


def test_a_transforms_new_context_reaches_every_device_copy():
    """The wrapper a transform returns may carry other metadata (0.3.75's requantized weight has
    the merge dtype as its orig_dtype): resident and streamed copies are rebuilt with it."""
    blocks = _blocks()
    seen = []

    def as_float64(block, name, t):
        return Int8Tensor(t._qdata.clone(), t._scale.clone(), torch.float64) if name == "weight" else t

    st = LayerwiseStreamer(blocks, "cpu", resident=1, prefetch=1)
    st.attach(transform=as_float64)
    hooks = [b.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype)) for b in blocks]
    _run(blocks, torch.randn(3, 32))
    assert seen == [torch.float64] * len(blocks)
    st.detach(keep_pack=True)
    seen.clear()
    st.attach()  # no transform now: the copies are base copies again
    _run(blocks, torch.randn(3, 32))
    assert seen == [torch.float32] * len(blocks)
    for h in hooks:
        h.remove()
    st.close()


def test_transform_output_of_another_layout_is_refused_by_name():
    blocks = _blocks(depth=2)

    def widen(block, name, t):
        return t.dequantize() if name == "weight" else t

    st = LayerwiseStreamer(blocks, "cpu", resident=2, prefetch=1)
    with pytest.raises(TypeError, match="must return a Int8Tensor for 'block 0: weight'"):
        st.attach(transform=widen)
    assert not st.attached
    st.close()


def test_a_wrapper_with_a_tensor_its_flatten_does_not_name_is_refused():
    m = QuantLinear(8, cls=StrayScale)
    m.weight._shadow = m.weight._scale.clone()
    with pytest.raises(TypeError, match="StrayScale holds tensors its __tensor_flatten__ does not name"):
        check_packable(m.weight, "blk.weight")
    with pytest.raises(TypeError, match="StrayScale"):
        PackedBlock(tensor_refs(m, 0), index=0)


def test_storage_subclass_keeps_class_attributes_and_logical_shape():
    blocks = _blocks(kind=RawLinear)
    blocks[1].weight.patches = [("lora", torch.ones(2))]  # attributes may hold tensors in lists
    x = torch.randn(3, 32)
    ref = _run(blocks, x)
    objects = [b.weight for b in blocks]
    st = LayerwiseStreamer(blocks, "cpu", resident=1, prefetch=1)
    assert st.host_bytes()["tensors"] == sum(w.numel() for w in objects)  # raw bytes, not the logical shape
    st.attach()
    assert torch.equal(_run(blocks, x), ref)
    st.detach(keep_pack=True)
    st.telemetry.reset()
    st.attach()
    assert st.telemetry.blocks_packed == 0, "a logical shape must not look like a re-assigned tensor"
    st.detach(keep_pack=False)
    for b, obj in zip(blocks, objects):
        assert b.weight is obj and type(obj) is RawBytes and obj.tag == "F32" and obj.shape == (32, 32)
    assert blocks[1].weight.patches[0][0] == "lora"
    assert torch.equal(_run(blocks, x), ref)
    st.close()


def test_module_swap_parks_moved_wrappers_and_leaves_computed_ones_alone():
    model = nn.Sequential(*_blocks(depth=3, dim=96))  # int8 data larger than a scale-sized copy
    x = torch.randn(3, 96)
    ref = model(x)
    sw = ModuleSwap(model)
    assert sw.nbytes >= _inner_bytes(model)
    ours = [b.weight for b in model]
    master_ptr = ours[0]._qdata.data_ptr()
    # An owner moves a weight by swapping a rebuilt copy into our object (Module._apply does).
    moved = Int8Tensor(ours[0]._qdata.clone(), ours[0]._scale.clone(), torch.float32)
    torch.utils.swap_tensors(ours[0], nn.Parameter(moved, requires_grad=False))
    assert ours[0]._qdata.data_ptr() != master_ptr
    # Another puts a new object over the master's own memory; a third a computed weight.
    model[1].weight = nn.Parameter(Int8Tensor(ours[1]._qdata, ours[1]._scale, torch.float32), requires_grad=False)
    computed = nn.Parameter(Int8Tensor.quantize(ours[2].dequantize() * 3), requires_grad=False)
    model[2].weight = computed
    assert sw.park() == 1
    assert model[0].weight is ours[0] and ours[0]._qdata.data_ptr() == master_ptr
    assert model[1].weight is ours[1]
    assert model[2].weight is computed
    model[2].weight = ours[2]  # the owner puts its base weight back
    sw.close()
    assert [b.weight for b in model] == ours
    assert torch.equal(model(x), ref)


def test_wrappers_moved_outside_inference_mode_are_rewrapped_in_place():
    """ComfyUI loads under inference mode and its prompt worker unloads (`.to()`) outside it: a
    wrapper parameter then becomes a normal tensor that inference-mode code cannot detach (core's
    LoRA loader reads state_dict()). Rewrapping mends it: same object, same inner memory, an
    inference tensor again."""
    from offload_core import wrappers_to_inference

    with torch.inference_mode():
        block = QuantLinear(8)
    before = block.state_dict()
    block.to("cpu")  # as core's unload: outside inference mode, to where it already is
    weight, qdata = block.weight, block.weight._qdata
    assert not weight.is_inference()  # 0.3.75's QuantizedTensor then fails a detach in inference
    # mode (tests/test_quantized_models.py shows it through a server); this class does not

    assert wrappers_to_inference(block) == 1
    assert block.weight is weight and weight.is_inference() and weight._qdata is qdata
    assert weight._is_param  # what nn.Parameter set on the wrapper survives
    with torch.inference_mode():
        after = block.state_dict()
    assert torch.equal(after["weight"].dequantize(), before["weight"].dequantize())
    assert wrappers_to_inference(block) == 0
