"""A disk read that stalls (a busy or sleeping disk, a network share): the engine waits, counts the
wait, never deadlocks, lets an interrupted run end once the read returns, and gives the same bits.

The stall is the one made-up part: the disk sources' ``read_unit`` waits on an event the test sets
before it reads (no unprivileged way makes a real read slow on demand: no cgroup I/O throttle, no
FUSE here). Everything around it is the engine's own: its reader threads, the host cache's
leases, the copy worker, the sampling thread's wait for its slot, detach and close.
"""
from __future__ import annotations

import os
import threading

import torch
from toy_models import ToyDiT, inputs

from offload_core.disk.host_cache import DiskTelemetry, HostCache
from offload_core.disk.sources import DiskSources
from offload_core.disk.tier import DiskOptions
from offload_core.host.packing import PackedBlock
from offload_core.host.tensor_refs import tensor_refs
from offload_core.layerwise.streamer import LayerwiseStreamer

PAGE = 4096
JOIN_S = 120  # a deadlock guard, not a timing: every wait here ends as soon as the read is let go


class Stall:
    """Makes every read of ``sources`` wait, while armed, until ``release``."""

    def __init__(self, sources: DiskSources) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.stalled = 0
        real = sources.read_unit

        def read_unit(i, dst):
            if not self.gate.is_set():
                self.stalled += 1
                self.entered.set()
                self.gate.wait()
            return real(i, dst)

        sources.read_unit = read_unit

    def arm(self) -> None:
        self.entered.clear()
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()


def _disk_threads() -> int:
    return len([t for t in threading.enumerate() if t.name.startswith("offload-disk")])


def _fds() -> int:
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0


def _streamer(model: ToyDiT, tmp_path, entries: int = 3) -> LayerwiseStreamer:
    probe = LayerwiseStreamer(model.blocks, "cpu", resident=0, prefetch=1, granularity="block")
    unit = -(-max(probe._plan.packs[i].nbytes for i in probe.streamed_indices) // PAGE) * PAGE
    return LayerwiseStreamer(model.blocks, "cpu", resident=0, prefetch=1, granularity="block",
                             disk=DiskOptions(cap_bytes=entries * unit, workers=2, spill_dir=str(tmp_path)))


def _started(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_a_stalled_read_is_waited_for_counted_and_gives_the_same_bits(tmp_path):
    model = ToyDiT(depth=6)
    x, t = inputs()
    with torch.no_grad():
        ref = model(x, t)
    threads = _disk_threads()
    st = _streamer(model, tmp_path)
    st.attach()
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
    stall = Stall(st._store.disk.sources)
    st.reset_figures()
    stall.arm()
    got = []
    with torch.no_grad():
        sampling = _started(lambda: got.append(model(x, t)))
        assert stall.entered.wait(JOIN_S), "no read reached the disk"
        sampling.join(0.2)
        assert sampling.is_alive() and not got  # the pass cannot end without the stalled unit
        stall.release()
        sampling.join(JOIN_S)
    assert not sampling.is_alive(), "the pass never ended after the read was let go"
    assert torch.equal(got[0], ref)
    figures = st.figures()
    assert figures["disk_wait_s"] > 0 and figures["disk_read_errors"] == 0, figures
    assert figures["order_misses"] == 0 and figures["sync_fallbacks"] == 0, figures
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
    st.close()
    assert _disk_threads() == threads


def test_an_interrupt_during_a_stalled_read_ends_the_run_once_the_read_returns(tmp_path):
    """ComfyUI raises its interrupt in the sampler between steps, so a run interrupted while it
    waits for a read ends when that read returns and the step is done; the node's session then
    detaches the engine, which must stop its threads and give the model back whole."""
    model = ToyDiT(depth=6)
    x, t = inputs()
    with torch.no_grad():
        ref = model(x, t)
    threads, fds = _disk_threads(), _fds()
    st = _streamer(model, tmp_path)
    st.attach()
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)
    stall = Stall(st._store.disk.sources)
    interrupted = threading.Event()

    def between_steps(module, args):  # what ComfyUI's sampler callback does once interrupted
        if interrupted.is_set():
            raise InterruptedError("interrupted")

    hook = model.register_forward_pre_hook(between_steps)
    outcome = {}

    def sample():
        try:
            with torch.no_grad():
                for _ in range(10_000):
                    model(x, t)
        except InterruptedError as e:
            outcome["error"] = e
        finally:
            st.detach(keep_pack=False)  # the session's teardown, whatever ended the run
            outcome["detached"] = True

    stall.arm()
    sampling = _started(sample)
    try:
        assert stall.entered.wait(JOIN_S), "no read reached the disk"
        interrupted.set()
        sampling.join(0.2)
        assert sampling.is_alive() and "detached" not in outcome  # nothing is torn down under the read
    finally:
        stall.release()
        sampling.join(JOIN_S)
        hook.remove()
    assert not sampling.is_alive(), "the interrupted run never ended"
    assert isinstance(outcome.get("error"), InterruptedError) and outcome["detached"], outcome
    assert _disk_threads() == threads
    if fds:
        assert _fds() <= fds + 1  # the one map of the spill file the module's tensors hold
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)  # the model is whole, without the engine
    st.attach()
    with torch.no_grad():
        assert torch.equal(model(x, t), ref)  # and streamed again
    st.close()
    assert _disk_threads() == threads


def test_closing_the_cache_during_a_stalled_read_waits_for_it_and_leaves_no_thread(tmp_path):
    """Close must not free the entry a reader is filling: it waits for the read under way (never
    longer), drops the reads not started, and ends its threads."""
    threads = _disk_threads()
    modules = [torch.nn.Linear(64, 64) for _ in range(6)]
    sources = DiskSources(str(tmp_path / "spill"), None)
    packs = [PackedBlock(tensor_refs(m, i), index=i) for i, m in enumerate(modules)]
    sources.plan(packs)
    sources.place(None, len(packs))
    sizes = {i: sources.buffer_bytes(i) for i in range(len(packs))}
    stall = Stall(sources)
    cache = HostCache(sources, sizes, list(range(len(packs))), entry_bytes=max(sizes.values()), count=3,
                      workers=2, depth=1, pin=False, ram_budget_bytes=None, device=torch.device("cpu"),
                      telemetry=DiskTelemetry())
    stall.arm()
    lease = cache.acquire(0)  # unit 0 and a read-ahead of unit 1, both stalled
    assert stall.entered.wait(JOIN_S)
    closing = _started(cache.close)
    closing.join(0.2)
    assert closing.is_alive()  # waits for the reads under way
    stall.release()
    closing.join(JOIN_S)
    assert not closing.is_alive(), "close never returned after the read was let go"
    assert _disk_threads() == threads
    lease.release()
    sources.close()
    x = torch.randn(2, 64)
    assert torch.equal(modules[0](x), modules[0](x))  # the modules hold their maps of the spill file
