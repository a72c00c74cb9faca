"""The planner: which setting a run should stream with, chosen by the pipeline model, and why.

Why plan at all: how many blocks to keep resident, how far to copy ahead and how far to read
ahead from disk depend on the model, the card, the link, the disk and the run itself (the
resolution and batch set each block's compute). A fixed rule (keep as many blocks as fit) spends
VRAM that buys nothing when copies already hide behind compute, and a deeper read-ahead than the
disk needs takes the cache entries that would have been hits. Here every candidate within the
budgets is run through one model of the pipeline (pipeline.py) on what a pass was measured to
cost, and the fastest is chosen; among those within ``TIE`` of it, and never slower than the
setting the run would have had without a plan, the one that reads least from disk and then takes
least VRAM.

The candidates: resident blocks chosen two ways for every count (spread evenly through the
stack, which gives each copy the most compute to hide behind; or the largest blocks first, which
also shrinks the slots, since a slot holds the largest streamed unit), every phase of a chosen
block resident; ``prefetch`` 1 to ``MAX_PREFETCH``; from disk, read-ahead 1 to what the cache
leaves room for. A setting the user fixed is not a choice: the planner keeps it and says what
``auto`` would have done, and what that would have saved.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..device.residency import spread_evenly
from ..units import size_text
from .pipeline import Costs, Prediction, Setting, most_read_ahead, predict

MAX_PREFETCH = 4  # copies ahead the planner tries; more has never paid on a link with one copy stream
MAX_READ_AHEAD = 4  # units read ahead from disk the planner tries
TIE = 0.01  # predictions this close to the fastest count as as fast
COARSE_COUNTS = 8  # from disk, resident counts are first weighed on a grid of this many steps
DEFAULT_PREFETCH = 2  # the node's manual default, and the planner's start before any measurement


@dataclass(frozen=True)
class Choices:
    """What the planner may choose (None) and what the user fixed (a value): the resident units,
    the prefetch, the disk read-ahead."""

    resident: tuple[int, ...] | None = None
    prefetch: int | None = None
    read_ahead: int | None = None

    @property
    def free(self) -> tuple[str, ...]:
        """The settings left to the planner."""
        return tuple(k for k in ("resident", "prefetch", "read_ahead") if getattr(self, k) is None)


@dataclass(frozen=True)
class Candidate:
    setting: Setting
    prediction: Prediction


@dataclass(frozen=True)
class Reason:
    """Why a setting was chosen: words with ``{}`` where each of ``sizes`` (bytes) goes, so that
    the panel shows the sizes in the units its user chose; ``text`` writes them as the logs do."""

    template: str
    sizes: tuple[int, ...] = ()

    @property
    def text(self) -> str:
        return self.template.format(*(size_text(n) for n in self.sizes))


@dataclass(frozen=True)
class Plan:
    """The chosen setting, its prediction, the setting the run would have had without a plan
    (``default``), and what more VRAM would buy (``more``: the fastest setting over budget)."""

    chosen: Candidate
    default: Candidate | None
    more: Candidate | None
    budget_bytes: int | None
    reason: Reason


def block_units(costs: Costs) -> list[list[int]]:
    """Each block's units, in run order."""
    out: list[list[int]] = [[] for _ in range(max(costs.unit_blocks, default=-1) + 1)]
    for u, b in enumerate(costs.unit_blocks):
        out[b].append(u)
    return out


def resident_sets(costs: Costs, count: int) -> list[tuple[int, ...]]:
    """The resident units of ``count`` blocks, picked evenly and largest first (one set if both
    pick the same)."""
    blocks = block_units(costs)
    n = len(blocks)
    sizes = [sum(costs.unit_bytes[u] for u in units) for units in blocks]
    picks = [spread_evenly(n, count), _largest_first(sizes, count)]
    out: list[tuple[int, ...]] = []
    for picked in picks:
        units = tuple(sorted(u for b in picked for u in blocks[b]))
        if units not in out:
            out.append(units)
    return out


def _largest_first(sizes: Sequence[int], count: int) -> list[int]:
    """``count`` blocks, the largest first; among blocks of one size, spread evenly."""
    picked: list[int] = []
    for size in sorted(set(sizes), reverse=True):
        group = [b for b, s in enumerate(sizes) if s == size]
        take = min(count - len(picked), len(group))
        picked += [group[k] for k in spread_evenly(len(group), take)]
        if len(picked) == count:
            break
    return sorted(picked)


def candidates(costs: Costs, choices: Choices, counts: Sequence[int] | None = None) -> Iterator[Setting]:
    """Every setting the planner weighs (with resident block ``counts``, default all), fixed
    settings kept."""
    nblocks = len(block_units(costs))
    if counts is None:
        counts = range(nblocks + 1)
    if choices.resident is not None:
        sets = [tuple(sorted(choices.resident))]
    else:
        sets = [s for count in counts for s in resident_sets(costs, count)]
    prefetches = range(1, MAX_PREFETCH + 1) if choices.prefetch is None else [choices.prefetch]
    for resident in sets:
        res = set(resident)
        streamed = [u for u in range(costs.units) if u not in res]
        for prefetch in prefetches:
            if costs.disk is None or not streamed:
                yield Setting(resident, prefetch, 0)
                continue
            most = most_read_ahead(costs, streamed, min(prefetch + 1, len(streamed)))
            if not most:
                continue  # the cache cannot hold what this setting streams at once
            depths = (range(1, min(most, MAX_READ_AHEAD) + 1) if choices.read_ahead is None
                      else [min(choices.read_ahead, most)])
            for depth in depths:
                yield Setting(resident, prefetch, depth)


def plan(costs: Costs, choices: Choices, budget_bytes: int | None, default: Setting | None,
         rejected: Sequence[Setting] = ()) -> Plan:
    """The setting to stream with: the fastest predicted within ``budget_bytes`` of device memory
    (None: no limit), ties broken towards fewer disk reads, then less VRAM; never predicted slower
    than ``default`` (the setting the run has without a plan) where that fits. ``rejected``: settings
    that were tried and rolled back."""
    within: list[Candidate] = []
    over: list[Candidate] = []
    for counts in _count_search(costs, choices, budget_bytes, within):
        for setting in candidates(costs, choices, counts):
            if setting in rejected:
                continue
            candidate = Candidate(setting, predict(costs, setting))
            fits = budget_bytes is None or candidate.prediction.device_bytes <= budget_bytes
            (within if fits else over).append(candidate)
    base = None
    if default is not None:
        base = Candidate(default, predict(costs, default))
        if budget_bytes is not None and base.prediction.device_bytes > budget_bytes:
            base = None
    if not within:
        if base is None:
            raise ValueError("no setting fits the budget")
        within = [base]
    chosen = _pick(within, base)
    fastest_over = min(over, key=lambda c: c.prediction.step_ms, default=None)
    more = None
    if fastest_over is not None and fastest_over.prediction.step_ms < chosen.prediction.step_ms * (1 - TIE):
        more = _pick([c for c in over if c.prediction.step_ms <= fastest_over.prediction.step_ms * (1 + TIE)], None)
    result = Plan(chosen, base, more, budget_bytes, Reason(""))
    return Plan(chosen, base, more, budget_bytes, reason(costs, result))


def _count_search(costs: Costs, choices: Choices, budget_bytes: int | None,
                  within: list[Candidate]) -> Iterator[list[int]]:
    """The resident counts to weigh, in rounds: every count where a prediction is cheap (from
    RAM, or few blocks); from disk with many blocks a coarse grid, then every count around the
    fastest of it (``within`` holds the candidates weighed so far)."""
    nblocks = len(block_units(costs))
    if choices.resident is not None or costs.disk is None or nblocks <= COARSE_COUNTS:
        yield list(range(nblocks + 1))
        return
    step = nblocks / COARSE_COUNTS
    grid = sorted({round(k * step) for k in range(COARSE_COUNTS + 1)})
    yield grid
    if not within:
        return
    best = min(within, key=lambda c: c.prediction.step_ms)
    count = len({costs.unit_blocks[u] for u in best.setting.resident})
    k = grid.index(count) if count in grid else 0
    low, high = grid[max(0, k - 1)], grid[min(len(grid) - 1, k + 1)]
    yield [c for c in range(low, high + 1) if c not in grid]


def _pick(pool: list[Candidate], base: Candidate | None) -> Candidate:
    """The fastest of ``pool``; among those as fast, the one that reads least from disk, then
    takes least VRAM, then is ``base`` itself (a new setting costs a new device schedule), then
    copies and reads least ahead."""
    best = min(c.prediction.step_ms for c in pool)
    limit = best * (1 + TIE)
    if base is not None:
        limit = min(limit, base.prediction.step_ms)
    tied = [c for c in pool if c.prediction.step_ms <= limit] or [min(pool, key=lambda c: c.prediction.step_ms)]
    same = base.setting if base is not None else None
    return min(tied, key=lambda c: (c.prediction.read_bytes, c.prediction.device_bytes, c.setting != same,
                                    c.setting.prefetch, c.setting.read_ahead, c.prediction.step_ms))


def reason(costs: Costs, result: Plan) -> Reason:
    """Why the chosen setting, in the words the panel shows."""
    chosen = result.chosen.prediction
    setting = result.chosen.setting
    blocks = len({costs.unit_blocks[u] for u in setting.resident})
    free = None if result.budget_bytes is None else max(0, result.budget_bytes - chosen.device_bytes)
    free_text, free_sizes = (", {} of VRAM left free", (free,)) if free is not None else ("", ())
    if not costs.asynchronous:  # a CPU: every copy runs on the sampling thread, between blocks
        if len(setting.resident) == costs.units:
            return Reason("every block resident: nothing is copied while it samples")
        return Reason(f"copies run between blocks ({ms_text(chosen.stall_ms)} a step) with {blocks} resident "
                      f"block{plural(blocks)}")
    if chosen.bound == "compute":
        if not blocks:
            return Reason(f"copies hidden behind compute: no resident block needed{free_text}", free_sizes)
        return Reason(f"copies hidden behind compute with {blocks} resident block{plural(blocks)}{free_text}",
                      free_sizes)
    if chosen.bound == "disk":
        text = (f"disk-bound: reading {setting.read_ahead} unit{plural(setting.read_ahead)} ahead keeps "
                f"{chosen.hits:.3g} of {chosen.requests} streamed units cached from step to step")
        if result.more is None:
            return Reason(text)
        more = _more_reason(costs, result)
        return Reason(text + more.template, more.sizes)
    if result.more is not None:
        more = _more_reason(costs, result)
        return Reason("link-bound: " + more.template.lstrip("; "), more.sizes)
    return Reason(f"link-bound: every block that fits is resident ({blocks}); copies take "
                  f"{ms_text(chosen.copy_busy_ms)} a step")


def _more_reason(costs: Costs, result: Plan) -> Reason:
    chosen, more = result.chosen, result.more
    extra = (len({costs.unit_blocks[u] for u in more.setting.resident})
             - len({costs.unit_blocks[u] for u in chosen.setting.resident}))
    saved = chosen.prediction.step_ms - more.prediction.step_ms
    need = more.prediction.device_bytes - chosen.prediction.device_bytes
    free = max(0, (result.budget_bytes or 0) - chosen.prediction.device_bytes)
    what = f"{extra} more resident block{plural(extra)}" if extra > 0 else "more VRAM"
    needs = "it needs" if extra <= 1 else "they need"
    return Reason(f"; {what} would save {ms_text(saved)} a step; {needs} {{}}, {{}} free", (need, free))


def ms_text(ms: float) -> str:
    """Milliseconds as people read them: whole above 100, else with one or two decimals."""
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms" if ms >= 10 else f"{ms:.2f} ms"


def plural(n: int) -> str:
    """The 's' of a count's noun in the reasons' words."""
    return "" if n == 1 else "s"
