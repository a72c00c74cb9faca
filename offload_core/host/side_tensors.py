"""Tensors a transform reads beside each block (a LoRA's factors), brought to the device with the block.

Why: a merge of a streamed block runs on the copy stream right after the block's copy. If it
read its factors from pageable host memory, each non-blocking upload would hold the host until
the copy stream reached it, and the copy stream first waits for the slot's last reader: the
host would sit idle with no compute queued, and copy, merge and compute would run one after
another. Here each block's side tensors are packed once per attach into one host buffer
(pinned where the budget allows), and ``load(group)`` uploads them with one asynchronous copy
on the current stream (the stream the merge runs on) into a device buffer sized for the
largest group. The device holds one group at a time; on the GPU the upload needs no host wait.

A group is uploaded again only when another group was loaded since, and every load must come
from work ordered on one stream (the engine's copy stream, or the attach's stream before it
exists), which is how the engine calls transforms.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ..alignment import align_up
from ..ordering import for_device
from .pinned import HostStorage
from .plain_writes import plain_writes

log = logging.getLogger(__name__)

ALIGN = 256


class SideTensors:
    """``groups[g]`` is the list of tensors group ``g`` needs; ``load(g)`` returns device views of
    them, in the same order, with the same dtypes, shapes and values (contiguous)."""

    def __init__(self, groups: Sequence[Sequence[torch.Tensor]], device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._layout: list[list[tuple[int, int, torch.dtype, torch.Size]]] = []
        sizes = []
        for tensors in groups:
            offset, layout = 0, []
            for t in tensors:
                nbytes = t.numel() * t.element_size()
                layout.append((offset, nbytes, t.dtype, t.shape))
                offset = align_up(offset + nbytes, ALIGN)
            self._layout.append(layout)
            sizes.append(offset)
        self._sizes = sizes
        self._ordering = for_device(self.device)
        # page-locking only speeds up asynchronous copies (to a GPU)
        self._host = HostStorage(sizes, pin=self._ordering.asynchronous, label="side tensors")
        with plain_writes():
            for g, tensors in enumerate(groups):
                buf = self._host.buffer(g)
                for (offset, nbytes, dtype, shape), t in zip(self._layout[g], tensors):
                    buf[offset:offset + nbytes].view(dtype).view(shape).copy_(t)
        self._host.note_reader(self.device)
        self._device_buf: torch.Tensor | None = None  # allocated at the first load
        self._views: list[list[torch.Tensor]] = []
        self._holds: int | None = None
        self._closed = False
        self.uploads = 0
        pageable = [g for g, size in enumerate(sizes) if size and not self._host.is_pinned(g)]
        if self._ordering.asynchronous and pageable:
            log.warning("[tiered offload] %d of %d groups of side tensors are in pageable RAM (over the "
                        "pinned-RAM cap): "
                        "their uploads hold up the thread that issues them", len(pageable), len(sizes))

    @property
    def device_bytes(self) -> int:
        """Device memory the side tensors take from their first load: the largest group."""
        return max(self._sizes, default=0)

    def load(self, group: int) -> list[torch.Tensor]:
        """Device views of ``group``'s tensors, uploaded on the current stream unless they are
        what the device buffer holds already."""
        if self._closed:
            raise RuntimeError("these side tensors are closed")
        if self._device_buf is None:
            self._device_buf = self._ordering.buffer(self.device_bytes, "side tensors")
            self._views = [[self._device_buf[o:o + n].view(dtype).view(shape) for o, n, dtype, shape in layout]
                           for layout in self._layout]
        if self._holds != group:
            size = self._sizes[group]
            if size:
                self._ordering.copy(self._device_buf[:size], self._host.buffer(group))
            self._holds = group
            self.uploads += 1
        return self._views[group]

    def close(self) -> None:
        """Free both buffers once every upload queued so far has run."""
        if self._closed:
            return
        self._closed = True
        if self._device_buf is not None:  # queued on any stream
            self._ordering.synchronize()
        self._device_buf = None
        self._views = []
        self._host.release()
