"""Models on the timed stream model (timed_streams.py) for the planner's tests: blocks with given
bytes and compute times, and a run of the real engine over them, timed on the virtual clock.

A block holds one fp32 weight of its size and spends its compute time on the clock, per 4 values
of its input (a larger input costs more, as a larger latent does); the model around the blocks
spends the time outside them, half before and half after. The output is a sum
over every block's weight, so a block that read the wrong bytes changes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from timed_streams import TimedStreamModel
from torch import nn

from offload_core.disk.tier import DiskOptions
from offload_core.layerwise.pipeline import Setting
from offload_core.layerwise.streamer import LayerwiseStreamer

KiB = 1 << 10


class TimedBlock(nn.Module):
    def __init__(self, clock: TimedStreamModel, nbytes: int, compute_ms: float, seed: int) -> None:
        super().__init__()
        self.clock, self.compute_ms = clock, compute_ms
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(nbytes // 4, generator=g), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.spend(self.compute_ms * x.numel() / 4)
        return x * 0.5 + self.weight[: x.numel()].view_as(x)


class TimedStack(nn.Module):
    def __init__(self, clock: TimedStreamModel, blocks: list[TimedBlock], outside_ms: float) -> None:
        super().__init__()
        self.clock, self.outside_ms = clock, outside_ms
        self.blocks = nn.ModuleList(blocks)
        self.skip: frozenset[int] = frozenset()  # blocks a call leaves out (skip-layer guidance)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.spend(self.outside_ms / 2)
        for index, block in enumerate(self.blocks):
            if index not in self.skip:
                x = block(x)
        self.clock.spend(self.outside_ms / 2)
        return x


@dataclass(frozen=True)
class Shape:
    """Blocks (bytes, compute ms), the time outside them, the link (bytes per ms), the device
    budget and, for a disk shape, the disk's rate (bytes per ms) and the RAM cache."""

    name: str
    sizes: tuple[int, ...]
    compute_ms: tuple[float, ...]
    outside_ms: float
    link: float
    budget: int | None
    disk_rate: float | None = None
    cache_bytes: int = 0
    read_sleep: float = 0.0

    def clock(self) -> TimedStreamModel:
        return TimedStreamModel(self.link, self.disk_rate, read_sleep=self.read_sleep)

    def build(self, clock: TimedStreamModel) -> TimedStack:
        blocks = [TimedBlock(clock, n, ms, seed=k) for k, (n, ms) in enumerate(zip(self.sizes, self.compute_ms))]
        return TimedStack(clock, blocks, self.outside_ms)

    def disk(self, read_ahead: int | str | None) -> DiskOptions | None:
        if self.disk_rate is None:
            return None
        return DiskOptions(cap_bytes=self.cache_bytes, workers=2, read_ahead=read_ahead)


@dataclass
class Run:
    periods: list[float]  # virtual ms per pass
    output: torch.Tensor
    tuning: dict | None = None
    figures: dict = field(default_factory=dict)
    total: float = 0.0  # virtual ms of the whole run: the attach, every call, the tuning in it
    totals: list[float] = field(default_factory=list)  # of each run, with ``runs``

    def steady(self, last: int = 2) -> float:
        """The mean period of the last ``last`` passes."""
        return sum(self.periods[-last:]) / last


def run(shape: Shape, clock: TimedStreamModel, stack: TimedStack, passes: int, *,
        setting: Setting | None = None, auto: bool = False, spill_dir: str | None = None,
        on_pass=None, on_run=None, advise: bool = False, inputs=None, host_ms_per_streamed_unit: float = 0.0,
        budget: bool = False, runs: int = 1, calls_per_step: int | None = None) -> Run:
    """``passes`` calls of ``stack`` under ``clock``: with a fixed ``setting``, or with every
    setting left to auto (the tuner hooked to the stack's calls). ``on_pass(k)`` runs before
    call ``k``, ``on_run()`` before each run's attach; ``advise``: a fixed setting's calls are hooked too, for what auto would choose;
    ``inputs(k)``: call ``k``'s input (default 4 zeros); ``host_ms_per_streamed_unit``: a cost of
    every call that grows with the units streamed, which the pipeline model does not know of (the
    host's work per hooked block); ``budget``: a fixed setting's run has the shape's VRAM budget
    too (what auto would choose is weighed within it); ``runs``: so many runs of ``passes`` calls
    on the one engine (prompts on a loaded model), the figures of the last, ``totals`` of each;
    ``calls_per_step``: the run is told its length in steps of so many calls, and each step's end,
    as the node tells it a sampler's (None: not told)."""
    disk = shape.disk("auto" if auto else None)
    if disk is not None and spill_dir is not None:
        disk = DiskOptions(cap_bytes=disk.cap_bytes, workers=disk.workers, read_ahead=disk.read_ahead,
                           spill_dir=spill_dir)
    blocks = list(stack.blocks)
    if auto:
        streamer = LayerwiseStreamer(blocks, "cpu", resident="auto", prefetch="auto",
                                     vram_budget_bytes=shape.budget, disk=disk)
    else:
        streamer = LayerwiseStreamer(blocks, "cpu", resident=0, prefetch=setting.prefetch, disk=disk)
        if budget:
            streamer.advise_within(shape.budget)
        streamer.use(setting)
    x = torch.zeros(4)
    totals = []
    try:
        for _ in range(runs):
            if on_run is not None:
                on_run()
            periods, ends = [], [clock.device_time()]
            if calls_per_step is not None:
                streamer.run_length(passes // calls_per_step)
            streamer.attach(root=stack if auto or advise else None)
            try:
                with torch.no_grad():
                    for k in range(passes):
                        if on_pass is not None:
                            on_pass(k)
                        clock.spend(host_ms_per_streamed_unit * len(streamer._plan.streamed_indices))
                        out = stack(x if inputs is None else inputs(k))
                        ends.append(clock.device_time())
                        if calls_per_step is not None and (k + 1) % calls_per_step == 0:
                            streamer.step_done()
                periods = [b - a for a, b in zip(ends[1:], ends[2:])]
                tuning = streamer.tuning()
                figures = streamer.figures(wait=True)
            finally:
                streamer.detach(keep_pack=runs > 1)
            totals.append(ends[-1] - ends[0])
    finally:
        streamer.close()
    return Run(periods, out, tuning, figures, totals[-1], totals)
