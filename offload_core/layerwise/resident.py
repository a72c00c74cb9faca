"""One attach's resident units on the device: their buffers, their upload, compute's wait for it.

Resident units (and the shared tensors of the pack) are copied once per attach into device buffers
of their own, and their modules are bound to views of those buffers for the whole attach. A
transform (a LoRA merge) rewrites those device copies right after their upload, never the host
pack.

The compute stream is whatever stream is current when a block runs: it waits for the upload (an
event recorded here), once per stream, so the upload need not be on the stream attach ran on.
That wait is the resident blocks' only hook, and it stays traceable by torch.compile (it does
nothing in a graph), so a model with every block resident keeps one whole graph.
"""

from __future__ import annotations

import torch

from ..device.telemetry import Telemetry
from ..disk.tier import DiskTier
from ..host.packing import PackedBlock, Transform
from ..ordering import Event, Ordering
from .plan import StreamPlan


class ResidentUnits:
    """The device buffers of ``plan``'s resident units and shared tensors on ``device``.

    ``upload`` allocates, copies (from ``disk`` when the packs live there), transforms and binds;
    ``release`` gives the buffers back with their count, also after an upload that failed part-way.
    """

    def __init__(self, plan: StreamPlan, device: torch.device, ordering: Ordering, telemetry: Telemetry,
                 transform: Transform | None, disk: DiskTier | None) -> None:
        self._cuda = device.type == "cuda"
        self._ordering = ordering
        self._current_stream = ordering.current_stream  # the compute stream, asked for per block
        self._telemetry = telemetry
        self._transform = transform
        self._disk = disk
        packs = plan.packs
        self._units: list[tuple[int, PackedBlock]] = (
            [(i, packs[i]) for i in plan.resident_indices] + [(len(packs), plan.shared)])
        self._shared_index = len(packs)
        self._bufs: list[torch.Tensor] = []
        self._ready: Event | None = None  # the upload is done
        self._waited: set[int] = set()  # compute streams that already wait for it

    @property
    def uploaded(self) -> bool:
        """Whether any resident bytes went to the device (without them, compute waits for nothing)."""
        return bool(self._bufs)

    def upload(self) -> None:
        """Copy each resident unit into a device buffer of its own, transform it, bind it there, and
        record the event compute waits for."""
        tel, disk, ordering, transform = self._telemetry, self._disk, self._ordering, self._transform
        timeline = tel.timeline
        for index, p in self._units:
            if not p.entries:
                continue
            label = f"resident unit {index}" if index < self._shared_index else "shared tensors"
            buf = ordering.buffer(p.nbytes, label)
            self._bufs.append(buf)
            tel.add_device_alloc(p.nbytes)
            if disk is not None:
                disk.upload(index, p.nbytes, buf)
            elif timeline is not None:  # the link's rate, for the planner
                start = timeline.mark()
                ordering.copy(buf, p.host)
                timeline.uploaded(start, timeline.mark(), p.nbytes)
            else:
                ordering.copy(buf, p.host)
            if transform is not None:  # queued behind the copy on the same stream
                tel.transforms += p.apply_transform(buf, transform)
            p.bind(p.views(buf, transformed=transform is not None))
            tel.add_materialized(p.nbytes)
        if self._bufs:
            self._ready = ordering.event()
            self._ready.record(ordering.current_stream())

    def enter(self, i: int) -> None:
        """The resident blocks' hook: compute waits for the upload, outside graphs only.

        torch.cuda.graph synchronizes the device before capture starts, so the upload is complete
        there, and a wait on an event from outside a capture would break it. Dynamo cannot trace
        the wait; a compiled region runs on the stream attach used."""
        if torch.compiler.is_compiling() or (self._cuda and torch.cuda.is_current_stream_capturing()):
            return
        self.wait()

    def wait(self) -> None:
        """Make the current (compute) stream wait for the upload, once per stream."""
        ready = self._ready
        if ready is None:
            return
        stream = self._current_stream()
        if stream.cuda_stream not in self._waited:
            stream.wait_event(ready)
            self._waited.add(stream.cuda_stream)

    def release(self) -> None:
        """Give the buffers back, with their count, and drop the transform and the upload's event."""
        self._transform = None
        self._ready = None
        self._telemetry.add_device_alloc(-sum(b.numel() for b in self._bufs))
        self._bufs = []
