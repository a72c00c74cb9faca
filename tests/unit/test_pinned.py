"""HostStorage: exact sizes, page-aligned chunks, budget refusal, pageable fallback, release, pin accounting."""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from offload_core import HostStorage, available_ram_bytes, pin_cap, pinned_bytes, set_pin_accounting
from offload_core.host import pinned
from offload_core.host.pinned import ALIGN, PAGE, PIN_SHARE, PIN_SHARE_WINDOWS, _malloc_trim, pin_share
from offload_core.ordering import for_device


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
    for i, b in enumerate(bufs):
        base = chunks[hs._where[i][0]].data
        if b.numel():
            # is_pinned() asks CUDA about the storage's base, which must be the registered start
            assert b.untyped_storage().data_ptr() == base.data_ptr() == base.untyped_storage().data_ptr()
    assert all(c.data.data_ptr() % PAGE == 0 for c in chunks if c.nbytes)
    assert hs.total_bytes == hs.allocated_bytes <= sum(sizes) + len(chunks) * ALIGN
    assert hs.pageable_bytes == hs.allocated_bytes and hs.pinned_bytes == 0


def test_chunks_are_allocated_lazily():
    hs = HostStorage([4096, 4096], pin=False, chunk_bytes=4096)
    assert hs.allocated_bytes == 0
    hs.buffer(1)
    assert hs.allocated_bytes == 4096
    hs.release()
    assert hs.allocated_bytes == 0


def test_without_a_gpu_nothing_is_pinned_and_no_log_line_says_otherwise(caplog):
    """Without CUDA there is no copy to a GPU for pinning to speed up: the storage is pageable,
    and no line at INFO talks of pinning or of slower copies (a CPU user would be puzzled)."""
    base = pinned_bytes()
    with caplog.at_level(logging.INFO, logger="offload_core.host.pinned"):
        hs = HostStorage([1 << 16], pin=True)
        hs.buffer(0).fill_(7)
    if not torch.cuda.is_available():
        assert not caplog.records, caplog.text
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


def test_views_kept_after_release_stay_valid():
    """A chunk's mapping lives as long as any view of it: a view held elsewhere never dangles."""
    hs = HostStorage([PAGE * 3 + 5], pin=False)
    view = hs.buffer(0)[PAGE:]
    view.fill_(9)
    hs.release()
    assert hs.allocated_bytes == 0
    assert int(view.sum()) == 9 * view.numel()


def test_pin_accounting_hook_caps_and_hears_totals():
    reports: list[int] = []
    own = int(pin_share()[0] * psutil.virtual_memory().total)
    try:
        set_pin_accounting(lambda: 5 << 30, reports.append)
        assert reports == [pinned_bytes()]  # told the current total at once
        assert pin_cap() == min(own, 5 << 30) and pin_cap(1 << 30) == 1 << 30
        set_pin_accounting(lambda: None, reports.append)  # the application sets no limit
        assert pin_cap() == own
        set_pin_accounting(lambda: -7, reports.append)  # over its cap already: no room at all
        assert pin_cap() == 0
    finally:
        set_pin_accounting(None, None)
    assert pin_cap() == own


PROBE = Path(__file__).with_name("pack_rss_probe.py")


@pytest.mark.skipif(_malloc_trim() is None, reason="needs glibc's malloc_trim")
def test_rss_after_packing_is_the_pack_not_pack_plus_freed_originals(tmp_path):
    """Pack a ~1 GiB block stack on CPU in a fresh process and read RSS around it."""
    proc = subprocess.run([sys.executable, str(PROBE)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    fig = json.loads(proc.stdout.strip().splitlines()[-1])
    mib = {k: v / 2**20 for k, v in fig.items()}
    print(f"RSS before building {mib['rss_start']:.0f} MiB, built {mib['rss_built']:.0f} MiB, "
          f"packed {mib['rss_packed']:.0f} MiB; pack {mib['packed']:.0f} MiB of {mib['weights']:.0f} MiB weights")
    assert fig["packed"] >= fig["weights"] > 900 << 20
    assert fig["rss_built"] - fig["rss_start"] >= 0.9 * fig["weights"]  # the originals were really in RAM
    # The pack replaces the originals: RSS grows by a small fraction, not by another copy.
    assert fig["rss_packed"] - fig["rss_built"] < 0.1 * fig["packed"], mib


class _FailingRuntime:
    """CUDA's runtime as torch exposes it, refusing every host registration (a CPU machine cannot
    make a real one fail)."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        return 712  # cudaErrorHostMemoryAlreadyRegistered

    def cudaHostUnregister(self, ptr: int) -> int:
        raise AssertionError("nothing was registered")


def test_a_failed_registration_clears_the_cuda_error_the_host_application_way(monkeypatch, caplog):
    """A failed cudaHostRegister leaves an error that torch's next kernel launch would raise: it is
    cleared through the host application's function (ComfyUI's discard_cuda_async_error) where
    one is set, and the chunk stays pageable."""
    from offload_core.host.pinned import set_cuda_error_discard

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _FailingRuntime())
    discarded: list[bool] = []
    set_cuda_error_discard(lambda: discarded.append(True))
    base = pinned_bytes()
    try:
        with caplog.at_level(logging.WARNING, logger="offload_core.host.pinned"):
            hs = HostStorage([1 << 16, 1 << 16], pin=True, chunk_bytes=1 << 16)
            hs.buffer(0), hs.buffer(1)
        assert discarded == [True]  # once: after a refusal the rest stays pageable without trying
        assert not hs.is_pinned(0) and not hs.is_pinned(1) and pinned_bytes() == base
        assert "cudaHostRegister failed" in caplog.text
        hs.release()
    finally:
        set_cuda_error_discard(None)


def test_a_collected_storage_waits_for_its_readers_before_unpinning(stream_model):
    """Under the stream model: a storage dropped without release() is unpinned by its finalizer,
    which waits for the devices that read it as release() does; a copy out of it may still be
    queued on a side stream (issue 30, item 4)."""
    ordering = for_device(torch.device("cpu"))
    storage = HostStorage([1 << 16], pin=True, label="a collected storage")
    storage.note_reader(torch.device("cpu"))
    src = storage.buffer(0)
    assert storage.is_pinned(0)
    dst = ordering.buffer(1 << 16, "its copy")
    stream = ordering.stream("copy")
    with ordering.on(stream):
        ordering.copy(dst, src)  # may run after the storage is gone
    del src
    del storage
    gc.collect()
    assert not [v for v in stream_model.violations if "unpinned" in v], stream_model.violations


@pytest.mark.parametrize("release,platform,share", [
    ("6.1.0-18-amd64", "linux", PIN_SHARE),
    ("5.15.167.4-microsoft-standard-WSL2", "linux", PIN_SHARE_WINDOWS),
    ("6.1.0-18-amd64", "win32", PIN_SHARE_WINDOWS),
])
def test_the_pin_cap_is_windows_share_on_windows_and_under_wsl(tmp_path, monkeypatch, release, platform, share):
    """Under WSL pinned memory is also Windows' "shared GPU memory", in a VM with a share of the
    machine's RAM: the cap is Windows' share there, with its reason; Linux keeps its own."""
    os_release = tmp_path / "osrelease"
    os_release.write_text(release + "\n")
    monkeypatch.setattr(pinned, "OS_RELEASE", str(os_release))
    monkeypatch.setattr(sys, "platform", platform)
    got, where = pin_share()
    monkeypatch.undo()
    assert got == share and ("Windows" in where) == (share == PIN_SHARE_WINDOWS), (got, where)
    assert ("WSL" in where) == ("WSL" in release and platform == "linux"), where


def test_host_memory_maps_where_mmap_has_no_posix_flags(monkeypatch):
    """Windows' mmap has no MAP_PRIVATE or MAP_ANONYMOUS: host memory there is a plain anonymous
    map, zeroed, writable, and the engine's buffers over it work as on Linux."""
    import mmap
    monkeypatch.setattr(pinned.os, "name", "nt")
    monkeypatch.delattr(mmap, "MAP_PRIVATE")
    monkeypatch.delattr(mmap, "MAP_ANONYMOUS")
    hs = HostStorage([PAGE * 2, PAGE], pin=False)
    try:
        buffers = [hs.buffer(0), hs.buffer(1)]
        assert [b.numel() for b in buffers] == [PAGE * 2, PAGE]
        assert all(int(b.sum()) == 0 for b in buffers)
        buffers[0].fill_(7)
        assert int(buffers[0].sum()) == 7 * PAGE * 2 and int(buffers[1].sum()) == 0
    finally:
        hs.release()


def test_an_unpin_inside_the_pin_report_neither_deadlocks_nor_leaves_a_stale_total():
    """The garbage collector may run the finalizer of a storage nobody released (an unpin) inside
    the accounting's own section, on the same thread: here, inside the application's report hook.
    It must count without waiting for itself, and the application's last word is the real total."""
    import threading
    told = []

    def report(total):
        told.append(total)
        if len(told) == 2:  # a finalizer's unpin, nested in the report of a pin
            pinned._count_pinned(-4096)

    before = pinned_bytes()
    worker = threading.Thread(target=lambda: (set_pin_accounting(None, report), pinned._count_pinned(8192)),
                              daemon=True)
    try:
        worker.start()
        worker.join(timeout=10)
        assert not worker.is_alive(), "the pinned-memory count deadlocked on itself"
        assert pinned_bytes() == before + 4096
        assert told[-1] == pinned_bytes(), told
    finally:
        if not worker.is_alive():  # a deadlocked worker holds the lock: leave it be
            pinned._count_pinned(-4096)
            set_pin_accounting(None, None)
