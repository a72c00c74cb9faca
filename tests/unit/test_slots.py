"""SlotRing and Stager on CPU: the slot protocol, prepare-after-copy, staged copies and their errors."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from offload_core import HostStorage
from offload_core.device.slots import SlotRing
from offload_core.device.telemetry import Telemetry
from offload_core.host.staging import Stager
from offload_core.ordering import for_device

CPU = torch.device("cpu")


def _host(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def test_slot_protocol_refuses_steps_out_of_order():
    tel = Telemetry()
    ring = SlotRing(CPU, 2, 1024, tel)
    with pytest.raises(RuntimeError, match="slot 0 is read while empty"):
        ring.wait_ready(0)
    with pytest.raises(RuntimeError, match="slot 1 is released while empty"):
        ring.mark_free(1)
    ring.copy_in(0, _host(1000, 1), "a")
    assert ring.holds == ["a", None]
    ring.wait_ready(0)
    with pytest.raises(RuntimeError, match="overwritten while a block reads it"):
        ring.copy_in(0, _host(1000, 2), "b")
    with pytest.raises(RuntimeError, match="read while being read"):
        ring.wait_ready(0)
    ring.mark_free(0)
    ring.wait_ready(0)  # a loaded slot may be read again without a new copy
    ring.mark_free(0)
    ring.copy_in(0, _host(1000, 2), "b")
    assert ring.holds == ["b", None] and tel.copies == 2
    ring.close()


def test_prepare_sees_the_copied_bytes_before_the_slot_is_ready():
    tel = Telemetry()
    ring = SlotRing(CPU, 1, 4096, tel)
    src = _host(3000, 3)
    seen = []

    def prepare(dst: torch.Tensor) -> None:
        seen.append(dst.clone())
        assert ring.holds == [None]  # not loaded until prepare is done
        dst.add_(1)

    ring.copy_in(0, src, "x", prepare)
    assert torch.equal(seen[0], src)
    ring.wait_ready(0)
    assert torch.equal(ring.buffers[0][:3000], src + 1)
    ring.mark_free(0)

    def failing(dst: torch.Tensor) -> None:
        raise RuntimeError("prepare failed")

    with pytest.raises(RuntimeError, match="prepare failed"):
        ring.copy_in(0, src, "y", failing)
    assert ring.holds == [None]  # a failed prepare leaves nothing that could be read
    with pytest.raises(RuntimeError, match="read while empty"):
        ring.wait_ready(0)
    ring.close()


def test_stager_copies_in_pieces_without_holding_the_caller():
    bounce = HostStorage([2 * 4096], pin=False)
    stager = Stager(CPU, for_device(CPU).stream("copy"), bounce, piece_bytes=4096)
    src = _host(4096 * 3 + 123, 4)  # three full pieces through alternating halves and a tail
    dst = torch.zeros_like(src)
    gate = threading.Event()
    copied = []

    def prepare(out: torch.Tensor) -> None:
        copied.append(torch.equal(out, src))
        gate.wait()

    first = stager.submit(dst, src, prepare=prepare)
    second_src = _host(src.numel(), 5)
    second = stager.submit(dst, second_src)  # queued behind the first: same order as submitted
    assert not first.done and not second.done  # the caller was not held while the worker waits
    gate.set()
    first.wait()
    second.wait()
    assert copied == [True] and torch.equal(dst, second_src)

    def failing(out: torch.Tensor) -> None:
        raise ValueError("bad merge")

    ticket = stager.submit(dst, src, prepare=failing)
    with pytest.raises(RuntimeError, match="a staged copy failed: bad merge"):
        ticket.wait()
    after = stager.submit(dst, src)  # the worker survives a failed job
    after.wait()
    assert torch.equal(dst, src)
    with pytest.raises(ValueError, match="staged copy of 10 bytes into 11"):
        stager.submit(torch.zeros(11, dtype=torch.uint8), torch.zeros(10, dtype=torch.uint8))
    stager.close()
    bounce.release()


def test_ring_with_a_bounce_buffer_stages_every_copy():
    tel = Telemetry()
    bounce = HostStorage([2 * (16 << 20)], pin=False)
    ring = SlotRing(CPU, 2, 8192, tel, bounce=bounce)
    src = _host(5000, 6)
    gate = threading.Event()
    ring.copy_in(0, src, "a", lambda dst: gate.wait())
    ring.copy_in(1, _host(6000, 7), "b")
    assert tel.staged_copies == 2 and ring.holds == ["a", "b"]

    def release_once_the_caller_waits() -> None:
        for _ in range(3000):
            if tel.staging_waits:
                break
            time.sleep(0.01)
        gate.set()

    threading.Thread(target=release_once_the_caller_waits).start()
    ring.wait_ready(0)  # blocks on the host: the copy's prepare step is still held by the gate
    assert tel.staging_waits == 1
    assert torch.equal(ring.buffers[0][:5000], src)
    ring.mark_free(0)

    def failing(dst: torch.Tensor) -> None:
        raise RuntimeError("merge failed")

    ring.copy_in(0, src, "c", failing)
    with pytest.raises(RuntimeError, match="staged copy failed: merge failed"):
        ring.wait_ready(0)
    assert ring.holds[0] is None  # nothing to reuse: the next copy starts afresh
    ring.copy_in(0, src, "c")
    ring.wait_ready(0)
    ring.mark_free(0)
    ring.close()
    bounce.release()


def test_close_frees_the_slots_only_once_a_reader_on_any_stream_is_done(stream_model):
    """Under the stream model: a block may read its slot on a stream other than the one that
    closes the ring, so close waits for the whole device before it gives the slots back. Syncing
    the copy stream and the caller's current stream only would hand the memory to the caching
    allocator while that read may still run (issue 30, item 3)."""
    ordering = for_device(CPU)
    ring = SlotRing(CPU, 2, 4096, Telemetry())
    ring.copy_in(0, _host(3000, 1), "a")
    compute = ordering.stream("compute")
    with ordering.on(compute):
        ring.wait_ready(0)
        ring.buffers[0][:3000].sum()  # the block's read, on its own stream
        ring.mark_free(0)
    ring.close()  # from the default stream; the slots' last tensors go here
    assert not [v for v in stream_model.violations if v.startswith("free while in use")], stream_model.violations
