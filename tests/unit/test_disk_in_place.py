"""Disk streaming from the model's own file, on the CPU with real torch modules and real files:
units whose loaded tensors are the file's bytes are read in place (nothing written), checked
against the loaded tensors at their first read; the rest go to the spill file; a file that
changes under a run fails it, naming the file; between runs the tensors hold no bytes, and come
back from the file, checked, when the model runs without the engine."""

from __future__ import annotations

import os
import re
import shutil
import time

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from offload_core.disk.file_headers import gguf_tensors, safetensors_tensors
from offload_core.disk.in_place import ModelFileChanged, ModelFileMap, plan_read
from offload_core.disk.sources import read_back_module
from offload_core.disk.tier import DiskOptions
from offload_core.host.released import released
from offload_core.layerwise.streamer import LayerwiseStreamer

PAGE = 4096


class PlainBlock(nn.Module):
    """A block as a plain model file holds it: contiguous fp32 and bf16 tensors."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))).bfloat16()).float()


class PlainModel(nn.Module):
    def __init__(self, depth: int = 6, dim: int = 64, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(8, dim)
        self.blocks = nn.ModuleList([PlainBlock(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _save(model: PlainModel, path) -> None:
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))


def _file_map(model: PlainModel, path) -> ModelFileMap:
    """Where each block tensor is in the file, by (block, path inside it), from the header."""
    found = safetensors_tensors(str(path))
    tensors = {}
    for i, block in enumerate(model.blocks):
        for name in block.state_dict():
            offset, nbytes, _ = found[f"blocks.{i}.{name}"]
            tensors[(i, name)] = (offset, nbytes, None)
    return ModelFileMap(str(path), tensors)


def _streamer(model, tmp_path, path, granularity="block", resident=0, entries=3, prefetch=1, spill=None):
    probe = LayerwiseStreamer(model.blocks, "cpu", resident=resident, prefetch=prefetch, granularity=granularity)
    unit = max(p.nbytes for p in probe._plan.packs) + 4 * PAGE  # the file's spans: a page or two more
    del probe
    disk = DiskOptions(cap_bytes=entries * unit, workers=2, spill_dir=str(spill or tmp_path / "spill"),
                       model_file=_file_map(model, path) if path is not None else None)
    return LayerwiseStreamer(model.blocks, "cpu", resident=resident, prefetch=prefetch, granularity=granularity,
                             disk=disk)


def _packs(st: LayerwiseStreamer) -> int:
    """The streamer's packs that hold tensors (the shared one may be empty)."""
    return sum(bool(p.entries) for p in st._plan.all_packs())


def _x() -> torch.Tensor:
    return torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(7))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


@pytest.fixture
def model_file(tmp_path):
    model = PlainModel()
    path = tmp_path / "model.safetensors"
    _save(model, path)
    return model, path


def test_plan_read_merges_close_tensors_into_aligned_runs():
    plan = plan_read([(10_000, 100, 0), (10_100, 50, 256), (900_000, 10, 512)])
    assert [(r.start, r.length) for r in plan.runs] == [(8192, 4096), (897024, 4096)]
    assert plan.pieces[0].src == 10_000 - 8192 and plan.pieces[1].src == 10_100 - 8192
    assert plan.pieces[2].src == 4096 + 900_000 - 897024 and plan.buffer_bytes == 8192


@pytest.mark.parametrize("device", ["cpu", "model"])
@pytest.mark.parametrize("granularity,resident", [("block", 0), ("block", 2), ("phase", 0)])
def test_units_are_read_in_place_bit_identical_and_nothing_is_written(model_file, tmp_path, granularity,
                                                                      resident, device):
    model, path = model_file
    x = _x()
    with torch.no_grad():
        ref = model(x)
    st = _streamer(model, tmp_path, path, granularity, resident)
    for run in range(2):
        st.attach()
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(_bits(model(x)), _bits(ref))
        st.check_files()
        disk = st.disk_figures()
        assert disk["spill_units"] == 0 and disk["spill_bytes"] == 0 and disk["spill_written_bytes"] == 0, disk
        assert disk["file_units"] == _packs(st) and disk["checking_units"] == 0, disk
        assert disk["model_files"] == [str(path)]
        assert set(st.disk_figures()) >= {"file_bytes", "opened_o_direct"}
        assert st.figures()["disk_reads"] > 0 and st.figures()["disk_read_errors"] == 0
        st.detach(keep_pack=True)
        # Between runs the block tensors hold no bytes, and say where theirs are.
        weight = model.blocks[-1].up.weight
        assert weight.numel() == 0 and released(weight) is not None, run
    assert not (tmp_path / "spill").exists()  # no spill file was ever opened
    # Run without the engine: the tensors are read back from the file, and give the same bits.
    assert st.read_back() == _packs(st)
    with torch.no_grad():
        assert torch.equal(_bits(model(x)), _bits(ref))
    st.attach()  # the copies read back are let go again
    with torch.no_grad():
        assert torch.equal(_bits(model(x)), _bits(ref))
    st.close()
    assert model.blocks[0].up.weight.numel() == 0


def test_a_unit_whose_bytes_differ_from_the_file_is_spilled_at_its_first_read(tmp_path):
    model = PlainModel()
    other = PlainModel(seed=1)
    mixed = PlainModel()
    mixed.blocks[2].load_state_dict(other.blocks[2].state_dict())  # the file's block 2 is not the model's
    path = tmp_path / "model.safetensors"
    _save(mixed, path)
    x = _x()
    with torch.no_grad():
        ref = model(x)
    st = _streamer(model, tmp_path, path)
    st.attach()
    before = st.disk_figures()  # read-ahead may have checked (or spilled) a few units already
    assert before["checking_units"] > 0 and before["file_units"] + before["spill_units"] == _packs(st), before
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(_bits(model(x)), _bits(ref))
    disk = st.disk_figures()
    assert disk["spill_units"] == 1 and disk["file_units"] == _packs(st) - 1, disk
    assert "bytes that differ from the model file's" in disk["spill_reasons"]
    assert 0 < disk["spill_written_bytes"] <= st._plan.packs[2].nbytes + PAGE, disk
    st.detach(keep_pack=True)
    assert model.blocks[2].up.weight.numel() > 0 and model.blocks[1].up.weight.numel() == 0
    st.attach()
    with torch.no_grad():
        assert torch.equal(_bits(model(x)), _bits(ref))
    st.close()


def test_tensors_the_file_cannot_serve_go_to_the_spill_file(tmp_path):
    """A transposed (non-contiguous) weight, and a block the file lacks: those units are spilled
    at placement, the rest read in place."""
    model = PlainModel()
    with torch.no_grad():
        model.blocks[1].up.weight = nn.Parameter(model.blocks[1].up.weight.detach().t().contiguous().t())
    path = tmp_path / "model.safetensors"
    _save(model, path)
    fmap = _file_map(model, path)
    fmap = ModelFileMap(fmap.path, {k: v for k, v in fmap.tensors.items() if k[0] != 4})
    x = _x()
    with torch.no_grad():
        ref = model(x)
    probe = LayerwiseStreamer(model.blocks, "cpu", resident=0, prefetch=1)
    unit = max(p.nbytes for p in probe._plan.packs) + 4 * PAGE
    del probe
    st = LayerwiseStreamer(model.blocks, "cpu", resident=0, prefetch=1,
                           disk=DiskOptions(cap_bytes=3 * unit, spill_dir=str(tmp_path / "spill"), model_file=fmap))
    st.attach()
    disk = st.disk_figures()
    assert disk["spill_units"] == 2 and disk["spill_bytes"] > 0, disk
    assert set(disk["spill_reasons"]) == {"tensors loaded in another dtype or layout than the file's",
                                          "tensors the model file does not hold"}, disk
    with torch.no_grad():
        assert torch.equal(_bits(model(x)), _bits(ref))
    st.close()


def test_folders_with_spaces_other_scripts_and_past_260_characters(tmp_path):
    """Users' folders (Windows' above all): spaces, letters of other scripts, and a path longer
    than the 260 characters Windows once allowed. The model file is read in place from there and
    the spill file written there, with the same bits."""
    folder = tmp_path / "Program Files (x86)" / "ComfyUI modèles 模型" / " ".join(["deep"] * 45)
    folder.mkdir(parents=True)
    model = PlainModel()
    with torch.no_grad():  # one unit the file cannot serve, so the spill file is used too
        model.blocks[1].up.weight = nn.Parameter(model.blocks[1].up.weight.detach().t().contiguous().t())
    path = folder / "модель v1 (fp16).safetensors"
    _save(model, path)
    spill = folder / "spill ü 溢出"
    assert len(str(spill)) > 260
    x = _x()
    with torch.no_grad():
        ref = model(x)
    st = _streamer(model, tmp_path, path, spill=spill)
    st.attach()
    with torch.no_grad():
        assert torch.equal(_bits(model(x)), _bits(ref))
    st.check_files()
    disk = st.disk_figures()
    assert disk["spill_units"] == 1 and disk["file_units"] == _packs(st) - 1, disk
    assert disk["model_files"] == [str(path)]
    st.close()


def _change(path, op: str, tmp_path) -> None:
    if op == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    elif op == "overwrite":  # the same size, other bytes, in place
        other = tmp_path / "other.safetensors"
        _save(PlainModel(seed=3), other)
        shutil.copyfile(other, path)
    elif op == "replace":
        other = tmp_path / "new.safetensors"
        _save(PlainModel(seed=3), other)
        os.replace(other, path)
    elif op == "delete":
        path.unlink()


@pytest.mark.parametrize("op", ["truncate", "overwrite"])
def test_a_file_changed_between_passes_fails_the_next_pass_naming_the_file(model_file, tmp_path, op):
    model, path = model_file
    x = _x()
    st = _streamer(model, tmp_path, path)
    st.attach()
    with torch.no_grad():
        model(x)
    _change(path, op, tmp_path)
    # A read that finds the file short fails its copy (RuntimeError from the copy worker, the
    # read's error its cause); otherwise the check after the read raises.
    with torch.no_grad(), pytest.raises((ModelFileChanged, RuntimeError), match=re.escape(str(path))):
        for _ in range(2):
            model(x)
    with pytest.raises(ModelFileChanged, match="Load the model again"):
        st.check_files()
    with pytest.raises(ModelFileChanged, match="Load the model again"):
        st.detach(keep_pack=True)  # everything is given back first
    assert not st._attached
    # The bytes the model was loaded with are gone: reading them back is refused, never wrong.
    with pytest.raises(ModelFileChanged, match=re.escape(str(path))):
        read_back_module(model)
    st.close()
    assert _open_descriptors(path) == 0  # a file that failed is closed at once


def _open_descriptors(path) -> int:
    """How many of this process's descriptors are open on the file ``path`` named (renamed over
    or deleted since: its old inode, which /proc shows as the name and " (deleted)")."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        count += target in (str(path), f"{path} (deleted)")
    return count


@pytest.mark.parametrize("op", ["replace", "delete"])
def test_a_file_renamed_over_or_deleted_is_read_on_until_the_model_goes(model_file, tmp_path, op, caplog):
    """A re-download renamed over the model's file, or a delete, leaves the open inode with exactly
    the loaded bytes: the model runs on bit for bit, with the engine, with a later engine, and read
    back for a run without one (as core's copy in RAM would); one log line says the file is read
    on. The inode is let go once nothing can read from it: read back into RAM, or the model gone,
    so its disk space comes back. A new load reads the new file."""
    import gc

    model, path = model_file
    x = _x()
    with torch.no_grad():
        reference = model(x)
    st = _streamer(model, tmp_path, path)
    st.attach()
    with torch.no_grad():
        model(x)  # every unit checked and released
    _change(path, op, tmp_path)
    with caplog.at_level("INFO", logger="offload_core.disk.in_place"), torch.no_grad():
        outs = [model(x) for _ in range(2)]
        st.detach(keep_pack=True)  # checks the file: no error
        st.attach()
        outs.append(model(x))
        st.detach(keep_pack=True)
    st.close()
    said = [r.getMessage() for r in caplog.records if "reads on from the file it was loaded from" in r.getMessage()]
    assert len(said) == 1 and str(path) in said[0], said
    assert all(torch.equal(_bits(o), _bits(reference)) for o in outs)
    # The engine is gone, the blocks' notes still read from the open file: a later engine does.
    assert _open_descriptors(path) >= 1
    again = _streamer(model, tmp_path, None)
    again.attach()
    with torch.no_grad():
        assert torch.equal(_bits(model(x)), _bits(reference))
    again.detach()
    again.close()
    assert _open_descriptors(path) >= 1
    assert read_back_module(model) > 0
    with torch.no_grad():
        assert torch.equal(_bits(model(x)), _bits(reference))
    gc.collect()
    assert _open_descriptors(path) == 0  # back in RAM: the old inode is let go
    if op == "replace":  # a new load reads the new file
        new = PlainModel(seed=3)
        from safetensors.torch import load_file
        new.load_state_dict(load_file(str(path)))
        with torch.no_grad():
            want = new(x)
        fresh = _streamer(new, tmp_path, path)
        fresh.attach()
        with torch.no_grad():
            got = [new(x) for _ in range(2)]
        figures = fresh.disk_figures()
        fresh.detach()
        fresh.close()
        assert figures["file_units"] == len(new.blocks), figures
        assert all(torch.equal(_bits(g), _bits(want)) for g in got)
        assert not torch.equal(_bits(want), _bits(reference))


def test_the_open_file_is_let_go_with_the_model(tmp_path):
    """A deleted model file whose model is dropped (unloaded) while its blocks are released: the
    last reference to the open inode goes with the model, and its space with it, at once, not at
    the garbage collector's next pass (a server whose models come and go, evicted and loaded
    again, would hold each one's file until then). A second engine built over the released
    blocks (a settings change) reads their layout from their notes, and leaves nothing behind."""
    import gc

    model, path = PlainModel(), tmp_path / "model.safetensors"
    _save(model, path)
    gc.disable()
    try:
        for granularity in ("block", "phase"):
            st = _streamer(model, tmp_path, path, granularity)
            st.attach()
            with torch.no_grad():
                model(_x())
            st.detach()
            st.close()
        path.unlink()
        assert _open_descriptors(path) >= 1  # the released blocks may still be read
        del model, st
        assert _open_descriptors(path) == 0
    finally:
        gc.enable()


def test_a_file_overwritten_in_place_during_a_pass_fails_that_pass(model_file, tmp_path):
    """The file is overwritten (same size, other bytes) while a pass is half done: the units
    read after it are the other model's, and the run fails before any result is used, naming
    the file."""
    model, path = model_file
    x = _x()
    st = _streamer(model, tmp_path, path)
    st.attach()
    with torch.no_grad():
        model(x)  # every unit checked and released: later reads trust the file's identity
    done = []

    def overwrite(module, args, output):
        if not done:
            done.append(True)
            _change(path, "overwrite", tmp_path)

    handle = model.blocks[2].register_forward_hook(overwrite)
    try:
        with torch.no_grad(), pytest.raises((ModelFileChanged, RuntimeError), match="changed in place"):
            model(x)
            model(x)
            st.check_files()
    finally:
        handle.remove()
    st.close()


def test_a_new_engine_takes_over_released_tensors_without_reading_them(model_file, tmp_path):
    """A settings change builds a new engine over tensors the old one released: their layout
    comes from what they are, they stay in the file, and results stay the same."""
    model, path = model_file
    x = _x()
    with torch.no_grad():
        ref = model(x)
    first = _streamer(model, tmp_path, path, "block")
    first.attach()
    with torch.no_grad():
        model(x)
    first.close()
    assert model.blocks[0].up.weight.numel() == 0
    second = _streamer(model, tmp_path, path, "phase", resident=1, entries=4, prefetch=2)
    fresh = LayerwiseStreamer(PlainModel().blocks, "cpu", granularity="phase")
    assert len(second.units) == len(fresh.units) > len(model.blocks), "the phases of empty blocks were not found"
    second.attach()
    disk = second.disk_figures()
    assert disk["file_units"] == _packs(second) and disk["checking_units"] == 0, disk
    with torch.no_grad():
        assert torch.equal(_bits(model(x)), _bits(ref))
    second.close()
    # An engine that keeps the blocks in RAM reads them back from the file to pack them.
    ram = LayerwiseStreamer(model.blocks, "cpu", resident=0, prefetch=1)
    ram.attach()
    with torch.no_grad():
        assert torch.equal(_bits(model(x)), _bits(ref))
    ram.close()
    assert model.blocks[0].up.weight.numel() > 0


def test_read_back_without_an_engine_gives_the_files_bytes(model_file, tmp_path):
    model, path = model_file
    x = _x()
    with torch.no_grad():
        ref = model(x)
    st = _streamer(model, tmp_path, path)
    st.attach()
    with torch.no_grad():
        model(x)
    st.close()
    assert read_back_module(model) == sum(len(list(b.parameters())) for b in model.blocks)
    with torch.no_grad():
        assert torch.equal(_bits(model(x)), _bits(ref))
    assert read_back_module(model) == 0


def test_file_headers_give_each_tensors_bytes(tmp_path, model_file):
    """safetensors and GGUF headers, read with pread: every tensor's offset and size, checked
    against the bytes the formats' own readers return."""
    model, path = model_file
    header = safetensors_tensors(str(path))
    data = path.read_bytes()
    for key, value in model.state_dict().items():
        offset, nbytes, dtype = header[key]
        assert data[offset : offset + nbytes] == _bits(value).numpy().tobytes(), key
    gguf = pytest.importorskip("gguf")
    import quantized_models  # tests/fixtures: the tiny Wan as GGUF, Q8_0 and float tensors

    gguf_path = tmp_path / "tiny.gguf"
    quantized_models.write_tiny_wan21_gguf(gguf_path, "Q8_0", seed=0)
    found = gguf_tensors(str(gguf_path))
    reader = gguf.GGUFReader(str(gguf_path))
    assert len(found) == len(reader.tensors) > 0
    for tensor in reader.tensors:
        offset, nbytes, kind = found[tensor.name]
        assert (offset, nbytes, kind) == (tensor.data_offset, tensor.n_bytes, tensor.tensor_type.name), tensor.name


def test_bytes_written_while_a_unit_is_read_never_reach_compute(model_file, tmp_path, monkeypatch):
    """The file is overwritten in place while the last unit's read is in flight (a slow read: the
    write lands after the pass's other checks ran, before the read gets its bytes, so it gets the
    other model's): the descriptor's identity, checked right after every read, fails that read,
    so the very pass that read it raises, naming the file, and no output computed from those
    bytes is returned."""
    import offload_core.files.raw_io as raw_io_module

    model, path = model_file
    x = _x()
    tensors = _file_map(model, path).tensors
    last = min(where[0] for (block, _), where in tensors.items() if block == len(model.blocks) - 1)
    # Two units copied ahead: the next pass's first unit, whose acquire checks the file, is
    # queued while the last one is still being read.
    st = _streamer(model, tmp_path, path, prefetch=2, entries=4)
    st.attach()
    with torch.no_grad():
        model(x)  # every unit checked and released: later reads trust the file's identity
    real = raw_io_module.read_into
    armed = []

    def read_during_a_write(fd, views, offset, **kwargs):
        # The pass's last unit: its read ends after the pass's other checks have run.
        if armed and not armed[-1] and offset <= last < offset + sum(len(v) for v in views):
            armed[-1] = True
            time.sleep(0.3)
            _change(path, "overwrite", tmp_path)
        return real(fd, views, offset, **kwargs)

    monkeypatch.setattr(raw_io_module, "read_into", read_during_a_write)
    armed.append(False)
    outputs = []
    try:
        with torch.no_grad(), pytest.raises((ModelFileChanged, RuntimeError), match=re.escape(str(path))):
            outputs.append(model(x))
    finally:
        st.close()
    assert armed == [True] and outputs == []


def test_a_model_file_on_a_network_file_system_is_copied_not_read_in_place(model_file, tmp_path, monkeypatch,
                                                                             caplog):
    """Where the file's version cannot prove its bytes unchanged (an NFS mount, here as the mount
    table would say), every unit goes to the spill file, with the reason in the figures and one
    log line naming the file and why; the output is core's, bit for bit."""
    from offload_core.files import file_identity

    model, path = model_file
    x = _x()
    with torch.no_grad():
        reference = model(x)
    monkeypatch.setattr(file_identity, "file_system", lambda dev: "nfs4")
    st = _streamer(model, tmp_path, path)
    with caplog.at_level("INFO", logger="offload_core.disk.sources"):
        st.attach()
        with torch.no_grad():
            outs = [model(x) for _ in range(2)]
    figures = st.disk_figures()
    st.detach()
    st.close()
    assert all(torch.equal(_bits(o), _bits(reference)) for o in outs)
    assert figures["file_units"] == 0 and figures["spill_units"] == len(model.blocks), figures
    assert figures["spill_reasons"] == {"a model file whose changes cannot be seen where it lies": len(model.blocks)}
    said = [r.getMessage() for r in caplog.records if "not read in place" in r.getMessage()]
    assert len(said) == 1 and str(path) in said[0] and "nfs4" in said[0], said
