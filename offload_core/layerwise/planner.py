"""The planner: which setting a run should stream with, chosen by the pipeline model, and why.

Why plan at all: how many blocks to keep resident, how far to copy ahead and how far to read
ahead from disk depend on the model, the card, the link, the disk and the run itself (the
resolution and batch set each block's compute). A fixed rule (keep as many blocks as fit) spends
VRAM that buys nothing when copies already hide behind compute, and a deeper read-ahead than the
disk needs takes the cache entries that would have been hits. Here every candidate within the
budgets is run through one model of the pipeline (pipeline.py) on what a pass was measured to
cost, and the fastest is chosen; among those within ``TIE`` of it, and never slower than the
setting the run would have had without a plan, the one whose resident units cost least to put up
at each run's attach (as fast a step, so the faster run), then reads least from disk, then takes
least VRAM.

The candidates: resident blocks chosen two ways for every count (spread evenly through the
stack, which gives each copy the most compute to hide behind; or the largest blocks first, which
also shrinks the slots, since a slot holds the largest streamed unit), every phase of a chosen
block resident; ``prefetch`` 1 to ``PLANNED_PREFETCH``; from disk, read-ahead 1 to what the cache
leaves room for. A setting the user fixed is not a choice: the planner keeps it and says what
``auto`` would have done, and what that would have saved.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from ..device.residency import bound_bytes, spread_evenly
from ..units import size_text
from .pipeline import DISK_PASSES, PASSES, Costs, Prediction, Setting, cache_shape, most_read_ahead, predict

PLANNED_PREFETCH = 4  # the most copies ahead the planner tries (a node input may fix more); more has never paid on a link with one copy stream
PLANNED_READ_AHEAD = 4  # the most units read ahead from disk the planner tries
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
    (``default``), and what more VRAM would buy (``more``: the fastest setting over budget);
    ``weighed`` of ``considered`` candidates were predicted, in ``cpu_ms`` of CPU (``plan``'s
    search)."""

    chosen: Candidate
    default: Candidate | None
    more: Candidate | None
    budget_bytes: int | None
    reason: Reason
    weighed: int = 0
    considered: int = 0
    cpu_ms: float = 0.0


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
    prefetches = range(1, PLANNED_PREFETCH + 1) if choices.prefetch is None else [choices.prefetch]
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
            depths = (range(1, min(most, PLANNED_READ_AHEAD) + 1) if choices.read_ahead is None
                      else [min(choices.read_ahead, most)])
            for depth in depths:
                yield Setting(resident, prefetch, depth)


def plan(costs: Costs, choices: Choices, budget_bytes: int | None, default: Setting | None,
         rejected: Sequence[Setting] = (), work_us: float | None = None, keep_default: bool = False) -> Plan:
    """The setting to stream with: the fastest predicted within ``budget_bytes`` of device memory
    (None: no limit), ties broken towards the cheapest attach (the resident units put up once a
    run), then fewer disk reads, then less VRAM; never predicted slower
    than ``default`` (the setting the run has without a plan) where that fits. ``rejected``: settings
    that were tried and rolled back; ``keep_default``: ``default`` was checked and held, so among
    the settings as fast it stays (within the tie, the measurements cannot tell them apart, and a
    new setting costs a new device schedule).

    A search that bounds itself: candidates are predicted in the order of a lower bound of their
    step (``_Bounds``: it costs no simulation), and one whose bound is slower than the fastest
    found by more than the tie is never predicted, nor any after it; within the budget that
    leaves out nothing the choice could be. ``work_us`` caps the CPU the predictions may take
    (the sampling thread's share, or the planner's), counted as ``prediction_work`` says one
    prediction costs, so that a plan is the same on any machine and however busy it is: the
    search stops before a prediction that would pass it and chooses among what it predicted (the
    start setting always among them). ``Plan.weighed`` says how many it predicted, of how many it
    could have, and ``Plan.cpu_ms`` what they took."""
    search = _Search(costs, budget_bytes, work_us)
    base = None
    if default is not None:
        base = Candidate(default, predict(costs, default))
        search.spent()
        search.seen += 1
        if budget_bytes is None or base.prediction.device_bytes <= budget_bytes:
            search.within.append(base)
        else:
            base = None
    for counts in _count_search(costs, choices, budget_bytes, search.within):
        search.weigh([s for s in candidates(costs, choices, counts) if s not in rejected and s != default])
    within, over = search.within, search.over
    if not within:
        raise ValueError("no setting fits the budget")
    chosen = _pick(costs, within, base, keep_default)
    fastest_over = min(over, key=lambda c: c.prediction.step_ms, default=None)
    more = None
    if fastest_over is not None and fastest_over.prediction.step_ms < chosen.prediction.step_ms * (1 - TIE):
        more = _pick(costs, [c for c in over if c.prediction.step_ms <= fastest_over.prediction.step_ms * (1 + TIE)],
                     None)
    result = Plan(chosen, base, more, budget_bytes, Reason(""), search.weighed, search.seen, search.cpu_ms())
    return replace(result, reason=reason(costs, result))


class _Search:
    """The candidates a plan weighs, predicted in the order of their lower bound until none left
    can be within the tie of the fastest, or the CPU it may take is spent (``plan``)."""

    def __init__(self, costs: Costs, budget_bytes: int | None, work_us: float | None) -> None:
        self._costs = costs
        self._budget = budget_bytes
        self._work_us = work_us
        self._each_us = prediction_work(costs)
        self._started = time.thread_time()
        self.within: list[Candidate] = []
        self.over: list[Candidate] = []
        self.weighed = 0  # predictions made
        self.seen = 0  # candidates considered
        self.stopped = False

    def spent(self) -> None:
        self.weighed += 1

    def cpu_ms(self) -> float:
        return (time.thread_time() - self._started) * 1000

    def _affords_one(self) -> bool:
        return self._work_us is None or (self.weighed + 1) * self._each_us <= self._work_us

    def weigh(self, settings: Sequence[Setting]) -> None:
        self.seen += len(settings)
        if self.stopped:
            return
        bounds = _Bounds(self._costs)
        ordered = sorted(((bounds.step(s), bounds.device(s), k, s) for k, s in enumerate(settings)),
                         key=lambda x: x[:3])
        for lower, device, _, setting in ordered:
            fits = self._budget is None or device <= self._budget
            best = min((c.prediction.step_ms for c in self.within), default=None)
            if fits and best is not None and lower > best * (1 + TIE):
                break  # neither this one nor any after it can be within the tie
            if not fits and (not self.over or lower > min(c.prediction.step_ms for c in self.over) * (1 + TIE)):
                continue  # over the budget: weighed only for what more VRAM would buy
            if not self._affords_one():
                self.stopped = True
                return
            candidate = Candidate(setting, predict(self._costs, setting))
            self.spent()
            (self.within if fits else self.over).append(candidate)


# What one prediction costs, in microseconds of CPU on the machine the figures were measured on (a
# 2-core AMD EPYC, busy): per unit and simulated pass, from RAM and from disk (the disk model runs
# the cache's rule and three processes on one clock), and per prediction. A budget in these
# units makes a plan the same wherever it runs; ``Plan.cpu_ms`` says what it really took.
RAM_UNIT_PASS_US = 0.3
DISK_UNIT_PASS_US = 14.0
PREDICTION_US = 10.0


def prediction_work(costs: Costs) -> float:
    """About the CPU one prediction of ``costs`` takes, in microseconds (a cycle: each member's)."""
    passes = DISK_PASSES * DISK_UNIT_PASS_US if costs.disk is not None else PASSES * RAM_UNIT_PASS_US
    return (1 + len(costs.cycle)) * (PREDICTION_US + costs.units * passes)


def search_work(costs: Costs, choices: Choices) -> float:
    """At most what a plan of ``costs`` costs with no cap: every candidate predicted."""
    counts = 1 if choices.resident is not None else 2 * (len(set(costs.unit_blocks)) + 1)
    prefetches = PLANNED_PREFETCH if choices.prefetch is None else 1
    depths = PLANNED_READ_AHEAD if costs.disk is not None and choices.read_ahead is None else 1
    return counts * prefetches * depths * prediction_work(costs)


class _Bounds:
    """What a setting's step cannot be below, and its device memory, without a simulation: the
    pass's compute; on a device whose copies run beside compute, the copies of what it streams
    on the one copy stream; from disk, the reads of what the cache cannot keep between passes at
    the disk's rate (on the plain host, copies and reads add to compute)."""

    def __init__(self, costs: Costs) -> None:
        self._costs = costs
        self._compute = sum(costs.compute_ms) + costs.outside_ms
        self._per_resident: dict[tuple[int, ...], tuple[float, list[int]]] = {}

    def _streamed(self, resident: tuple[int, ...]) -> tuple[float, list[int]]:
        found = self._per_resident.get(resident)
        if found is None:
            res = set(resident)
            streamed = [u for u in range(self._costs.units) if u not in res]
            found = self._per_resident[resident] = (sum(self._costs.copy_ms[u] for u in streamed), streamed)
        return found

    def step(self, setting: Setting) -> float:
        c = self._costs
        if c.cycle:  # a cycle's step is the mean over its members: its least is compute's
            return min(self._compute, *(sum(m.compute_ms) + m.outside_ms for m in c.cycle))
        copies, streamed = self._streamed(setting.resident)
        if not streamed:
            return self._compute
        reads = 0.0
        if c.disk is not None:
            _, entries, _ = cache_shape(c, streamed, min(setting.prefetch + 1, len(streamed)))
            misses = max(0, len(streamed) - max(0, entries - 1))
            reads = misses * min(c.unit_bytes[u] for u in streamed) / c.disk.bytes_per_ms
        if not c.asynchronous:
            return self._compute + copies
        return max(self._compute, copies, reads)

    def device(self, setting: Setting) -> int:
        c = self._costs
        return bound_bytes(c.unit_bytes, setting.resident, c.shared_bytes, setting.prefetch)


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


def _pick(costs: Costs, pool: list[Candidate], base: Candidate | None, keep_base: bool = False) -> Candidate:
    """The fastest of ``pool``; among those as fast, ``base`` where it is to be kept, else the one
    whose resident units cost least to put up at each run's attach (steps as fast, that is the
    faster run), then reads least from disk, then takes least VRAM, then is ``base`` itself (a new
    setting costs a new device schedule), then copies and reads least ahead."""
    best = min(c.prediction.step_ms for c in pool)
    limit = best * (1 + TIE)
    if base is not None:
        limit = min(limit, base.prediction.step_ms)
    tied = [c for c in pool if c.prediction.step_ms <= limit] or [min(pool, key=lambda c: c.prediction.step_ms)]
    same = base.setting if base is not None else None
    if keep_base and base is not None and base in tied:
        return base
    return min(tied, key=lambda c: (round(attach_ms(costs, c.setting), 6), c.prediction.read_bytes,
                                    c.prediction.device_bytes, c.setting != same, c.setting.prefetch,
                                    c.setting.read_ahead, c.prediction.step_ms))


def attach_ms(costs: Costs, setting: Setting) -> float:
    """What putting up ``setting``'s resident units costs once a run, before its first call: each
    one's copy, and from disk its read (the resident ones are read from disk at every attach)."""
    read = (lambda u: costs.unit_bytes[u] / costs.disk.bytes_per_ms) if costs.disk is not None else (lambda u: 0.0)
    return sum(costs.copy_ms[u] + read(u) for u in setting.resident)


def change_ms(costs: Costs, setting: Setting) -> float:
    """What making ``setting`` the device schedule between two passes of a run costs: its resident
    units put up again (``attach_ms``: the schedule is made anew) and its pipeline filled from empty
    (the first streamed unit's copy, which the pass before no longer hides)."""
    resident = set(setting.resident)
    first = next((u for u in range(costs.units) if u not in resident), None)
    return attach_ms(costs, setting) + (costs.copy_ms[first] if first is not None else 0.0)


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
