"""Measure, plan, apply, check, roll back: the streamer's settings left to ``auto``, at the passes
of each run.

Why at pass boundaries: a pass (one call of the model) is the unit the pipeline repeats, and
between two calls no block runs, so the device schedule (resident buffers, slots, hooks) can be
made again around a new setting with nothing bound to the old one. The tuner hooks the call of
the model's root module (``attach(root=...)``) for that; without a root it only reports.

Each run, per kind of pass (the shapes of the model's inputs, and whether a LoRA is merged:
another resolution, batch or LoRA changes what a unit costs, so it is measured and planned
apart):

1. measure: the run's picture of a pass (device/timeline.py, recorded while the tuner needs it)
   and the resident blocks' compute give each unit's costs (measure.py); the first pass of a run
   or after a new setting is left out (first calls, and a pipeline that has not filled yet);
2. plan: the fastest setting the pipeline model finds within the budgets (planner.py);
3. apply it at the next boundary (the streamer makes its device schedule again); a setting that
   does not fit the device (out of memory) is rolled back there and then. Where the run was told
   its length (``run_length``, ``step_done``: the sampler's steps, and the calls a step makes), a
   setting planned for speed that would not repay the change in the calls left (``change_ms``:
   its resident units put up again, its pipeline filled from empty) is left for the next run to
   start with, and checked there, re-planned rather than rolled back if slower than predicted;
4. check: the next steady passes are held against the prediction; a pass slower than predicted
   (by more than ``CHECK_TOLERANCE``) whose setting is slower than the one before is rolled back to
   it, and that setting is not tried again in these conditions; slower than before is judged in
   the conditions of the pass just measured (check.py, the rule the order tuner follows too: a slower link slows every
   setting, which no comparison with an earlier step can tell, while time that grew outside the
   units may be the new setting's own); a pass slower than predicted but not slower than before
   is kept and planned again, though never back to a setting this run measured no faster;
5. hold: recording stops (unless the panel asks for the picture), and the held setting's steps
   are watched at one timing event per call (``measure.PeriodWatch``). When they move beyond
   their spread (a link that slows, a host that gets busy), what the run learned belongs to other
   conditions: rollbacks are forgotten and the kind is measured and planned again. The next run
   starts with the held setting and checks it once more.

Steps are the mean of an even number of passes (``MEASURE_PASSES``; from disk ``DISK_STEADY``):
calls that alternate in cost with one input shape (a cond and an uncond call) are measured and
checked over the same mix.

Short runs (a distilled model's 4 steps) are the sum of their few passes, so nothing a run learns
waits for a long one: its last pass is measured at the detach like any other (a plan made from
it, or a failed check, is where the next run starts), steps measured toward a phase carry over to
the next run of that kind, a planned setting not yet checked is checked by the next run instead
of being given up, plans count per run, and after a kind's first run the first pass of a run is
measured too (the schedule was made at the attach; only a new setting needs a warm-up pass).

Inputs whose kind changes from call to call never get a schedule made again at every call (that
would cost more than any plan saves): after two changes, calls that alternate between two kinds
(a cond and an uncond batch of other sizes) become one kind, a cycle, planned for the mean step
of its members from both their costs (``Costs.cycle``) and kept for later runs; other changes
keep the run's setting. Within an attach a new setting takes no more device memory than the caller said the
model holds (``run_cap``: ComfyUI counts the engine's bytes when it loads the model).

Settings the user fixed are kept; the tuner still measures one pass of each kind and says what
``auto`` would have chosen and what that would have saved. Whatever the setting, every block
computes with the same weights, so results do not change with it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..device.residency import bound_bytes
from ..disk.cache_rule import cache_holds
from ..device.timeline import Timeline
from ..ordering import Event, for_device
from .check import CHECK_TOLERANCE, ROLLED_BACK, VERDICT_KEYS, Outcome, Trial, check, verdict
from .measure import PassMeter, PeriodWatch
from .pipeline import DISK_STEADY, Costs, Setting, predict
from .plan import StreamPlan
from .planner import (DEFAULT_PREFETCH, TIE, Candidate, Choices, Plan, Reason, change_ms, ms_text, plan,
                      prediction_work, search_work)

log = logging.getLogger(__name__)

AUTO = "auto"  # a setting left to the tuner
WARMUP_PASSES = 1  # passes left out after an attach or a new setting before one is measured
MAX_PLANS = 3  # plans per kind of pass and run: a model that keeps missing stops re-planning
MAX_SWITCHES = 2  # changes of the kind of pass a run follows; more, and its setting stays
MAX_MISSES = 4  # passes of a phase that could not be measured before the setting is held
# Passes a step is the mean of, from RAM: an even number, so that a model whose calls alternate in
# cost with one input shape (a cond call, then an uncond call) is measured and checked over the
# same mix of calls (from disk, DISK_STEADY, also even).
MEASURE_PASSES = 2


@dataclass(frozen=True)
class AutoSettings:
    """Which of a streamer's settings the user left to the tuner; the rest are the user's rules."""

    resident: bool = False
    prefetch: bool = False
    read_ahead: bool = False

    NAMES = ("resident", "prefetch", "read_ahead")

    def left(self) -> list[str]:
        """The names of the settings left to the tuner."""
        return [name for name in self.NAMES if getattr(self, name)]

    def fixed(self, from_disk: bool) -> list[str]:
        """The names of the settings the user fixed that count for a run (read-ahead only from disk)."""
        return [name for name in self.NAMES
                if not getattr(self, name) and (name != "read_ahead" or from_disk)]


EVERY_SETTING_AUTO = AutoSettings(resident=True, prefetch=True, read_ahead=True)


class ScheduleLost(RuntimeError):
    """Neither the new setting's device schedule nor the old one could be made: the run cannot
    go on (the streamer is left to detach)."""


class Rebuild(Protocol):
    """The streamer's side: make the device schedule again around ``setting`` (None: the same
    setting, only recorded or not); raises, with the old schedule back, if it cannot."""

    def __call__(self, setting: Setting | None, record: bool) -> None: ...


@dataclass
class _Kind:
    """What the tuner knows of one kind of pass."""

    costs: Costs | None = None
    plan: Plan | None = None
    held: Setting | None = None  # the setting checked and kept
    predicted_ms: float | None = None  # the prediction for the setting in force
    measured_ms: float | None = None  # the last steady pass measured
    trial: Trial | None = None  # the setting a plan replaced, with its step
    rejected: list[Setting] = field(default_factory=list)
    # The steps measured of each setting tried in this run's conditions: a plan never goes back
    # to a setting already measured no faster than the one in force (no A -> B -> A re-uploads).
    tried: dict[Setting, float] = field(default_factory=dict)
    measured_passes: tuple[int, int] | None = None  # the passes ``measured_ms`` is the mean of
    spread: float = 0.0  # how far those passes' steps lay apart, a share of their mean
    reasons: dict[Setting, Any] = field(default_factory=dict)  # why a plan chose each setting it kept
    # A cycle of kinds the run's calls alternate between: its members' keys, and the costs last
    # measured of each (a step is the mean over the cycle).
    members: tuple[tuple, ...] = ()
    member_costs: dict[tuple, Costs] = field(default_factory=dict)
    advice: Plan | None = None  # with a setting fixed: what auto would choose
    verdict: str = "measuring"
    plans: int = 0  # this run's
    # Steps measured toward a phase a run ended in (``Tuner.stop``), with the setting they were
    # measured under: the next run of this kind goes on from them instead of starting over.
    periods: list[float] = field(default_factory=list)
    periods_of: Setting | None = None
    runs: int = 0  # runs that measured this kind: after the first, a run's first pass is warm


def default_setting(p: StreamPlan, auto: AutoSettings, budget_bytes: int | None, disk_cap: int | None,
                    disk_read_ahead: int) -> tuple[Setting, Choices]:
    """The setting a run has without a plan (the user's rules; for resident blocks left to auto,
    the most the budget holds; for prefetch left to auto, the engine's default or less, as the
    budget and the disk cache allow), applied to ``p``, and what the planner may change."""
    fixed = None if auto.prefetch else p.rules.prefetch
    rules = p.rules
    if auto.resident:
        rules = replace(rules, resident=None, vram_budget_bytes=budget_bytes, resident_units=None)
    if auto.read_ahead:
        rules = replace(rules, read_ahead=None)
    for prefetch in ([fixed] if fixed else range(DEFAULT_PREFETCH, 0, -1)):
        try:
            p.restore(replace(rules, prefetch=prefetch))
        except ValueError:
            if prefetch == 1 or fixed:
                raise
            continue
        if fixed or prefetch == 1 or disk_cap is None or cache_holds(
                disk_cap, [p.packs[i].nbytes for i in p.streamed_indices], p.nslots):
            break
    read_ahead = (p.rules.read_ahead or disk_read_ahead) if disk_cap else 0
    default = Setting(tuple(p.resident_indices), prefetch, read_ahead)
    return default, Choices(resident=None if auto.resident else default.resident,
                            prefetch=None if auto.prefetch else prefetch,
                            read_ahead=None if auto.read_ahead or not disk_cap else read_ahead)


# The CPU a plan may take (planner.py ``prediction_work``, microseconds): a search that fits this
# is made on the sampling thread; a larger one (many units, from disk) runs on the tuner's planner
# thread, and stops at the larger budget, or at a tenth of the step it plans for where that is
# more (a model of many units streamed from disk, whose steps take seconds): a plan never costs
# the run more than a tenth of one of its steps, spread over the steps it runs beside.
SYNC_PLAN_US = 5_000
PLAN_US = 50_000
PLAN_SHARE = 0.1


def _plans(costs: Costs, choices: Choices, budget: int | None, current: Setting, rejected: tuple[Setting, ...],
           held: bool, advice_budget: int | None, auto_start: Setting | None,
           work_us: float) -> tuple[Plan, Plan | None]:
    """The plan, and with ``advice_budget`` what auto would choose within it: the plan a run with
    every setting left to auto makes, from the setting that run starts with (``auto_start``), so
    the advice is never a setting auto itself would not apply. Both share ``work_us``. ``held``:
    the setting in force was checked and held (as fast as another, it stays)."""
    planned = plan(costs, choices, budget, current, rejected, work_us=work_us, keep_default=held)
    if advice_budget is None:
        return planned, None
    left = max(0.0, work_us - planned.weighed * prediction_work(costs))
    return planned, plan(costs, Choices(), advice_budget, auto_start, work_us=left)


def _short_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error)


class CallKinds:
    """Which kind of pass each call of the model is: by its inputs (``Tuner._boundary``'s key),
    or, once calls alternate between two kinds (a cond and an uncond call of other shapes), the
    cycle of both, for this streamer's later runs too."""

    def __init__(self) -> None:
        self._cycles: dict[tuple, tuple] = {}  # a kind's key -> the key of the cycle it alternates in
        self._recent: list[tuple] = []  # the kinds of this run's last calls, as their inputs say
        self.current: tuple | None = None  # the kind of the call under way, as its inputs say

    def new_run(self) -> None:
        self._recent, self.current = [], None

    def starts(self, key: tuple) -> tuple[tuple | None, tuple]:
        """A call of kind ``key`` starts: (the kind of the call that ended, as its inputs said; the
        kind the tuner counts this call as)."""
        ended, self.current = self.current, key
        return ended, self._cycles.get(key, key)

    def seen(self) -> None:
        """The call under way counts toward the run's recent calls (not while a setting holds)."""
        self._recent = [*self._recent[-3:], self.current]

    def alternating(self) -> bool:
        """Whether the run's last four calls alternate between two kinds."""
        r = self._recent
        return len(r) == 4 and r[0] == r[2] != r[1] == r[3]

    def cycle(self) -> tuple[tuple, tuple[tuple, ...]]:
        """The cycle of the last two calls' kinds, from now on: (its key, its members' keys)."""
        members = tuple(sorted(self._recent[-2:], key=repr))
        key = ("cycle", members)
        if members[0] not in self._cycles:
            log.info("[tiered offload] layerwise auto settings: the model's calls alternate between two kinds "
                     "of input; the setting is planned for both")
        for member in members:
            self._cycles[member] = key
        return key, members


class RunSteps:
    """Where a run is among its sampler's steps, for how many calls of the model it has left: the
    steps it was given, the steps done, and the calls counted in each (a step may call the model
    more than once: a second-order sampler, skip-layer guidance's extra call)."""

    def __init__(self) -> None:
        self.begin(None)

    def begin(self, steps: int | None) -> None:
        """A run of ``steps`` steps starts (None: its length is not known)."""
        self._steps = steps if steps is not None and steps > 0 else None
        self._done = 0
        self._calls = 0  # calls of the step under way
        self._per_step = 0  # the most calls a finished step of this run made

    def call(self) -> None:
        self._calls += 1

    def step_done(self) -> None:
        self._per_step = max(self._per_step, self._calls)
        self._calls = 0
        self._done += 1

    def figures(self) -> dict[str, int | None]:
        """The run's steps as told, the steps done, and the most calls a step made."""
        return {"steps": self._steps, "done": self._done, "calls_per_step": self._per_step or None}

    def calls_left(self) -> int | None:
        """The calls this run has left, the one starting now included (None: not known)."""
        if self._steps is None:
            return None
        per_step = max(self._per_step, self._calls, 1)
        return max(1, (self._steps - self._done) * per_step - max(0, self._calls - 1))


def _repays(costs: Costs, current: Setting, step_ms: float, chosen: Candidate, calls: int) -> bool:
    """Whether changing to ``chosen`` now is worth it with ``calls`` calls left: always for a change
    that is not for speed (as fast, less memory: the planner's tie), else where it saves more than
    it costs (``change_ms``). The saving per call: the setting in force's step, measured
    (``step_ms``) or predicted, whichever is longer (a step measured below its prediction is noise
    the plan did not see), less the step predicted of ``chosen``."""
    now = predict(costs, current).step_ms
    if now <= chosen.prediction.step_ms * (1 + TIE):
        return True
    return (max(step_ms, now) - chosen.prediction.step_ms) * calls > change_ms(costs, chosen.setting)


class Tuner:
    """The settings of one streamer (``plan``) that ``auto`` leaves to it, applied through
    ``rebuild``."""

    def __init__(self, plan_: StreamPlan, device: torch.device, auto: AutoSettings, rebuild: Rebuild,
                 describe: Callable[[], list[dict]], disk_rate: Callable[[], float | None]) -> None:
        self._plan = plan_
        self._ordering = for_device(device)
        self._auto = auto
        self.choices = Choices()
        self._rebuild = rebuild
        self._describe = describe
        self._meter = PassMeter(plan_, device, describe, disk_rate)
        self._kinds: dict[tuple, _Kind] = {}
        self._kind: tuple | None = None
        self._last_kind: dict[bool, tuple] = {}  # with a LoRA or without: the kind of pass last seen
        self._calls = CallKinds()
        self._hook: RemovableHandle | None = None
        self._phase = "off"
        self._skip = 0
        self._final = False  # the run's last pass (``stop``): a new setting waits for the next run
        self._pending: tuple[_Kind, float, Future] | None = None  # a plan on the planner's thread
        self._planner: ThreadPoolExecutor | None = None  # that thread, made at the first large plan
        self._periods: list[float] = []  # the steps measured in this phase so far
        self._misses = 0  # passes of this phase that could not be measured
        self._recording = False
        self._watch = PeriodWatch(self._ordering, CHECK_TOLERANCE)
        self._watching = False  # a held setting whose steps are watched for conditions that move
        self._wanted_picture = False
        self._transform = False
        self._timeline: Callable[[], Timeline | None] = lambda: None
        self.budget_bytes: int | None = None
        self.run_cap: int | None = None  # device bytes this attach's later settings may take
        self.disk_cap: int | None = None
        self.default: Setting | None = None
        self.auto_start: Setting | None = None  # with a setting fixed: where a run left to auto starts
        self.advice_budget: int | None = None  # with a setting fixed: the budget auto would have had
        self.events: list[dict] = []  # this run's plan changes
        self.passes = 0
        self._switches = 0  # changes of the kind of pass in this run
        self._run_steps = RunSteps()
        self._last_steps: dict[str, int | None] | None = None  # the run's, kept past its end for the report

    # ------------------------------------------------------------------ the streamer's calls
    def current(self) -> Setting:
        """The setting the plan holds now."""
        p = self._plan
        return Setting(tuple(p.resident_indices), p.rules.prefetch, p.rules.read_ahead or 0)

    def attach_setting(self, budget_bytes: int | None, transform: bool, disk_cap: int | None,
                       disk_read_ahead: int) -> Setting:
        """Before an attach: the run's budgets, the setting it would have without a plan (the user's
        rules; for resident blocks left to auto, the most the budget holds) and what the planner
        may change; returns the setting to start with (the last kind of pass's held one, if it fits)."""
        self.budget_bytes, self._transform, self.disk_cap = budget_bytes, transform, disk_cap
        self.run_cap = None
        self.events = []
        self.passes = 0
        self._switches = 0
        self._calls.new_run()
        for kind in self._kinds.values():
            # Plans count per run (runs that end before their check still plan), and a rollback
            # speaks of the conditions of its run, not of every later one.
            kind.plans, kind.rejected, kind.tried = 0, [], {}
        self.auto_start = None
        if self._fixed():  # the advice is auto's own plan, which starts where a run left to auto does
            rules = self._plan.rules
            try:
                self.auto_start, _ = default_setting(self._plan, EVERY_SETTING_AUTO, self.advice_budget, disk_cap,
                                                     disk_read_ahead)
            except ValueError:  # auto would not fit where the fixed setting does: no start to weigh from
                pass
            finally:
                self._plan.restore(rules)
        self.default, self.choices = default_setting(self._plan, self._auto, budget_bytes, disk_cap, disk_read_ahead)
        # The kind of pass this run most likely makes: the last one with a LoRA, or without.
        last = self._last_kind.get(transform)
        kind = self._kinds.get(last) if last is not None else None
        if kind is not None and kind.held is not None and self._fits(kind.held):
            return kind.held
        return self.default

    def run_length(self, steps: int | None) -> None:
        """The sampler's steps in the run about to start (None: not known)."""
        self._run_steps.begin(steps)

    def step_done(self) -> None:
        """The sampler finished one of the run's steps."""
        self._run_steps.step_done()

    def start(self, root: nn.Module | None, timeline: Callable[[], Timeline | None], wanted: bool,
              compiled: bool) -> bool:
        """After an attach: hook ``root``'s calls (not under torch.compile, which keeps its hooks
        in compiled graphs). Returns whether the attach should record its passes from the start."""
        self._timeline = timeline
        self._wanted_picture = wanted
        self._meter.forget()
        if root is None or compiled:
            self._phase = "off"
            return wanted
        self._hook = root.register_forward_pre_hook(self._boundary, with_kwargs=True, prepend=True)
        self._phase = "new"
        self._recording = True
        self._meter.on()
        return True

    def stop(self) -> None:
        """At detach: the run's last pass is measured like the others (a short run is the sum of
        its few passes), what the phase gathered is kept for the next run of its kind, then the
        hook and the resident blocks' timing go (the report keeps the last phase)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
            if self._kind is not None:
                if self._phase in ("measure", "check", "planning"):
                    self._last_pass()
                self._kinds[self._kind].runs += 1
        self._meter.off()
        self._recording = False
        self._last_steps = self._run_steps.figures()
        self._run_steps.begin(None)

    def _thread(self) -> ThreadPoolExecutor:
        """The planner's thread, made at the first plan too large for the sampling thread."""
        if self._planner is None:
            self._planner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiered-offload-planner")
        return self._planner

    def close(self) -> None:
        """The streamer closes: a plan still being made is dropped, and the planner's thread ends."""
        self._pending = None
        if self._planner is not None:
            self._planner.shutdown(wait=False, cancel_futures=True)
            self._planner = None

    def rebuilt(self) -> None:
        """The schedule was made again: the resident blocks' timing follows the new residents."""
        if self._recording:
            self._meter.off()
            self._meter.on()

    # ------------------------------------------------------------------ a boundary
    def _boundary(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The model's call starts: the pass before it has ended."""
        if torch.compiler.is_compiling():
            return
        ended, kind_key = self._calls.starts((self._transform, _signature(args, kwargs)))
        self._run_steps.call()
        if self._phase == "hold" and kind_key == self._kind:
            self.passes += 1
            self._meter.forget()  # holding: one timing event and one check of the inputs per call
            if self._watching:
                moved = self._watch.call()
                if moved is not None:
                    self._conditions_moved(self._kinds[kind_key], *moved)
            return
        self._calls.seen()
        timeline = self._timeline()
        previous, mark, complete = self._meter.pass_starts(timeline)
        self.passes += 1
        try:
            self._step(kind_key, previous, mark, timeline, complete, ended)
        except ScheduleLost:
            raise
        except Exception:  # the plan is advice: a failure stops planning, never the run
            log.exception("[tiered offload] layerwise auto settings: planning failed; the run keeps its settings")
            self.stop()
            self._phase = "off"

    def _step(self, key: tuple, previous: Event | None, mark: Event, timeline: Timeline | None,
              complete: bool, ended: tuple | None) -> None:
        """One boundary: ``key`` the kind of the call starting, ``ended`` the kind (as its inputs
        said) of the pass that just ended."""
        kind = self._kinds.setdefault(key, _Kind())
        if key != self._kind or self._phase == "new":
            switches, self._switches = self._switches, self._switches + (self._phase != "new")
            if switches >= MAX_SWITCHES and self.choices.free and self._calls.alternating():
                key, members = self._calls.cycle()
                kind = self._kinds.setdefault(key, _Kind(members=members))
                self._kind = self._last_kind[self._transform] = key
                self._begin_kind(kind)
                return
            self._kind = self._last_kind[self._transform] = key
            if switches >= MAX_SWITCHES:
                # Inputs that change from call to call (a cond and an uncond batch of other
                # sizes): a setting made again at every call would cost more than any plan saves.
                if self._phase != "hold":
                    log.info("[tiered offload] layerwise auto settings: the model's inputs change from call to call; "
                             "the setting stays for the rest of the run")
                self._enter("hold")
                return
            self._begin_kind(kind)
            return
        if self._phase == "hold":
            return
        if self._phase == "planning":
            self._take_plan()
            return
        if self._skip > 0:
            self._skip -= 1
            return
        known = kind.member_costs.get(ended) if kind.members else kind.costs
        measured = self._meter.measure(previous, mark, timeline, complete, self.disk_cap, known)
        if measured is None:  # the pass was not complete (a block skipped, a retry): the next one
            if ended in kind.members and len(kind.members) > 1:
                # One kind of the cycle leaves blocks out (skip-layer guidance's extra call): its
                # passes are never whole, so the plan is made on the members that run every block.
                kind.members = tuple(m for m in kind.members if m != ended)
                log.info("[tiered offload] layerwise auto settings: one kind of the model's calls leaves blocks out; "
                         "the setting is planned on the calls that run every block")
                return
            self._misses += 1
            if self._misses > MAX_MISSES:  # passes that skip blocks (a block cache): nothing to plan on
                kind.verdict = "the model's passes do not run every block: the setting stays"
                self._enter("hold")
            return
        costs, period = measured
        if kind.members:  # a pass of one member of the cycle: the plan weighs them all
            if ended not in kind.members:
                return
            kind.member_costs[ended] = costs
            costs = replace(costs, cycle=tuple(kind.member_costs[k] for k in kind.members
                                               if k != ended and k in kind.member_costs))
        self._periods.append(period)
        # From disk the cache's state repeats only every few passes: their mean counts. A run's
        # last pass ends what it has (a run of one call has no pair of calls to measure).
        if len(self._periods) < (DISK_STEADY if self.disk_cap else 1 if self._final else MEASURE_PASSES):
            return
        if kind.members and len(kind.member_costs) < len(kind.members):
            self._periods = self._periods[1:]  # a member not measured yet: the window slides on
            return
        count = len(self._periods)
        period = sum(self._periods) / count
        kind.spread = (max(self._periods) - min(self._periods)) / period if period > 0 else 0.0
        self._periods = []
        kind.measured_ms = period
        kind.measured_passes = (self.passes - count, self.passes - 1)
        kind.tried[self.current()] = period
        if self._phase == "check":
            self._check(kind, costs, period)
        else:
            kind.costs = costs
            self._plan_kind(kind, period)

    def _enter(self, phase: str, watch: bool = False) -> None:
        """Go to ``phase``; a hold with ``watch`` keeps timing the steps, for conditions that move."""
        self._phase = phase
        self._pending = None
        self._skip = WARMUP_PASSES
        self._periods = []
        self._misses = 0
        self._watching = watch and phase == "hold" and bool(self.choices.free)
        self._watch.restart(WARMUP_PASSES)
        self._record(phase != "hold")

    # ------------------------------------------------------------------ measure, plan, check
    def _plan_kind(self, kind: _Kind, period: float) -> None:
        """Plan from ``kind.costs``: on the sampling thread where it is quick (``search_work``), else
        on the planner's thread while the passes go on, its plan taken at a later boundary."""
        current = self.current()
        kind.plans += 1
        advice = None
        if self._fixed():  # what auto would choose, in the device memory auto would have
            advice = next((b for b in (self.advice_budget, self.budget_bytes) if b is not None),
                          predict(kind.costs, current).device_bytes)
        job = (kind.costs, self.choices, self._budget(), current, tuple(kind.rejected), kind.held == current,
               advice, self.auto_start)
        work = search_work(kind.costs, self.choices) + (search_work(kind.costs, Choices()) if advice else 0)
        if work <= SYNC_PLAN_US:
            self._planned(kind, period, *_plans(*job, SYNC_PLAN_US))
            return
        job = (*job, max(PLAN_US, PLAN_SHARE * period * 1000))
        if self._final:  # the run's last pass: its plan is the next run's start, made on the thread
            self._planned(kind, period, *self._thread().submit(_plans, *job).result())
            return
        self._pending = (kind, period, self._thread().submit(_plans, *job))
        self._phase = "planning"

    def _take_plan(self) -> None:
        """A boundary while the planner's thread plans: its plan, once it is ready."""
        kind, period, future = self._pending
        if future.done():
            self._pending = None
            self._planned(kind, period, *future.result())

    # ------------------------------------------------------------------ applying
    def _apply(self, kind: _Kind, setting: Setting, why: str) -> bool:
        """Make ``setting`` the streamer's; False (the setting before kept) when the device is short
        of memory for it. On the run's last pass, the next run's start (``kind.held``) instead."""
        before = self.current()
        if self._final:
            self._for_next_run(kind, setting, why, next_run="run_ended")
            return True
        try:
            self._rebuild(setting, record=True)
        except BaseException as e:
            if not _short_of_memory(e):
                raise
            kind.rejected.append(setting)
            kind.verdict = f"short of memory for the planned setting: rolled back ({e})"
            self.events.append({"pass": self.passes, "from": before, "to": before, "why": kind.verdict})
            log.warning("[tiered offload] layerwise auto settings: %s", kind.verdict)
            return False
        self.rebuilt()
        self._recording = True
        self.events.append({"pass": self.passes, "from": before, "to": setting, "why": why})
        log.info("[tiered offload] layerwise auto settings: pass %d: %d resident units, prefetch %d%s (%s)",
                 self.passes,
                 len(setting.resident), setting.prefetch,
                 f", read-ahead {setting.read_ahead}" if setting.read_ahead else "", why)
        return True

    def _for_next_run(self, kind: _Kind, setting: Setting, why: str, **cause: Any) -> None:
        """``setting`` is where the next run of ``kind`` starts, not applied in this one; the change
        is recorded with its ``cause`` (``next_run``: why it waits; ``calls_left``)."""
        kind.held = setting
        self.events.append({"pass": self.passes, "from": self.current(), "to": setting, "why": why, **cause})

    def _budget(self) -> int | None:
        """Device bytes a new setting may take now: the run's budget, and within an attach no more
        than the caller said it would hold (``run_cap``)."""
        caps = [c for c in (self.budget_bytes, self.run_cap) if c is not None]
        return min(caps) if caps else None

    def _fixed(self) -> list[str]:
        """The settings the user fixed that count for this run (read-ahead only from disk)."""
        return self._auto.fixed(from_disk=bool(self.disk_cap))

    def _fits(self, setting: Setting) -> bool:
        budget = self._budget()
        if budget is None:
            return True
        p = self._plan
        sizes = [q.nbytes for q in p.packs]
        return bound_bytes(sizes, setting.resident, p.shared.nbytes, setting.prefetch) <= budget

    # ------------------------------------------------------------------ recording
    def _record(self, on: bool) -> None:
        if self._final:  # the device schedule is going: nothing to record into
            return
        on = on or self._wanted_picture
        if on == self._recording:
            if on:
                self._meter.on()
            return
        self._rebuild(None, record=on)
        self._recording = on
        if on:
            self._meter.on()
        else:
            self._meter.off()

    # ------------------------------------------------------------------ phases
    def _begin_kind(self, kind: _Kind) -> None:
        """A run's first pass, or a kind of pass other than the last: start from what is known
        (the setting held, and the steps an earlier run measured toward its phase)."""
        current = self.current()
        if kind.held is not None and self._fits(kind.held) and self.choices.free:
            if kind.held != current and not self._apply(kind, kind.held, "the setting held for these inputs"):
                self._enter("hold")
                return
            kind.predicted_ms = predict(kind.costs, kind.held).step_ms if kind.costs else kind.predicted_ms
            self._enter("check")
        else:
            self._enter("measure")
        if kind.runs and self.current() == current:
            self._skip = 0  # the schedule was made at the attach: the first pass is no colder than the rest
        if kind.periods and kind.periods_of == self.current():
            self._periods = kind.periods
        kind.periods, kind.periods_of = [], None

    def _conditions_moved(self, kind: _Kind, base_ms: float, now_ms: float) -> None:
        """A held setting's steps moved beyond their spread (a link that slows, a host that gets
        busy): what was tried and rolled back in the old conditions says nothing of the new ones,
        so the kind is measured and planned again."""
        kind.rejected, kind.tried, kind.plans, kind.trial = [], {}, 0, None
        kind.verdict = f"the step moved from {ms_text(base_ms)} to {ms_text(now_ms)}: measuring again"
        log.info("[tiered offload] layerwise auto settings: pass %d: %s", self.passes, kind.verdict)
        self._enter("measure")

    def _planned(self, kind: _Kind, period: float, planned: Plan, advice: Plan | None) -> None:
        """A plan made: applied and checked, or the setting in force held (a plan for it, one the
        run already measured no faster, or too many plans)."""
        current = self.current()
        kind.plan = planned
        if advice is not None:
            kind.advice = self._steady_advice(kind, advice)
        chosen = kind.plan.chosen
        tried = kind.tried.get(chosen.setting)
        no_faster = tried is not None and chosen.setting != current and tried >= period * (1 - CHECK_TOLERANCE)
        if chosen.setting == current:
            kind.reasons[current] = planned.reason
        if chosen.setting == current or not self.choices.free or kind.plans > MAX_PLANS or no_faster:
            kind.held = current
            kind.predicted_ms = predict(kind.costs, current).step_ms
            kind.verdict = ("the planned setting measured no faster in this run: the setting stays" if no_faster
                            else verdict(kind.predicted_ms, period))
            self._enter("hold", watch=True)
            return
        left = self._run_steps.calls_left()
        if left is not None and not self._final and not _repays(kind.costs, current, period, chosen, left):
            # The change costs more than it saves in the calls this run has left (a 4-step run
            # planned at its last call): the next run starts with it, and checks it. A step of
            # another run is no yardstick for a rollback (its conditions may differ): if slower
            # than predicted there, it is planned again from what that run measures.
            kind.trial = None
            self._for_next_run(kind, chosen.setting, kind.plan.reason.text, next_run="too_few_calls",
                               calls_left=left)
            kind.reasons[chosen.setting] = planned.reason
            kind.predicted_ms = predict(kind.costs, current).step_ms
            kind.verdict = verdict(kind.predicted_ms, period)
            log.info("[tiered offload] layerwise auto settings: pass %d: the planned setting waits for the "
                     "next run (%d calls left in this run would not repay the change)", self.passes, left)
            self._enter("hold", watch=True)
            return
        kind.trial = Trial(current, period)
        if not self._apply(kind, chosen.setting, kind.plan.reason.text):
            kind.held = current
            kind.predicted_ms = predict(kind.costs, current).step_ms
            self._enter("hold", watch=True)
            return
        kind.reasons[chosen.setting] = planned.reason
        kind.predicted_ms = chosen.prediction.step_ms
        self._enter("check")

    def _check(self, kind: _Kind, costs: Costs, period: float) -> None:
        """A steady pass of a planned setting against its prediction: held, rolled back to the setting
        before it, or planned again (the module docstring's step 4)."""
        predicted = kind.predicted_ms or period
        current = self.current()
        planned_outside = kind.costs.outside_ms if kind.costs is not None else None
        outcome = check(costs, current, predicted, period, kind.trial, planned_outside)
        if outcome is Outcome.AS_PREDICTED:
            # Checked and kept: a later check of it (the next run's) plans again if it is slower
            # than predicted, but does not go back to what it replaced on one step's word.
            kind.held, kind.costs, kind.trial = current, costs, None
            kind.verdict = verdict(predicted, period)
            self._enter("hold", watch=True)
            return
        if outcome is Outcome.ROLL_BACK:
            before = kind.trial.before
            kind.rejected.append(current)
            kind.held = before
            kind.verdict = ROLLED_BACK
            self._apply(kind, before, "rolled back: slower than predicted")
            # The setting is back for this reason, whatever plan (if any) first chose it.
            kind.reasons[before] = Reason(f"rolled back: {ms_text(period)} a step measured, "
                                          f"{ms_text(predicted)} predicted, {ms_text(kind.trial.before_ms)} before")
            kind.predicted_ms, kind.trial = predict(costs, before).step_ms, None
            self._enter("hold", watch=True)
            return
        kind.costs = costs  # slower than predicted, but no slower than before: measured again
        self._plan_kind(kind, period)

    def _last_pass(self) -> None:
        """``Tuner.stop``: the pass that ended the run, as a boundary would see it, with no new setting
        applied now (the device schedule is going): a plan made from it, or a check that fails, is the
        setting the next run starts with; a check that cannot end yet leaves the planned setting to be
        checked then; steps measured toward the phase are kept for the next run of the kind."""
        timeline = self._timeline()
        previous, mark, complete = self._meter.pass_starts(timeline)
        kind = self._kinds[self._kind]
        self._final = True
        try:
            if self._phase == "planning":  # a plan still being made is left to the next run's passes
                if self._pending[2].done():
                    self._take_plan()
            elif complete:
                self._step(self._kind, previous, mark, timeline, complete, self._calls.current)
        except Exception:  # the plan is advice: never the detach's failure
            log.exception("[tiered offload] layerwise auto settings: the run's last pass could not be planned on")
        finally:
            self._final = False
        if self._phase in ("measure", "check"):
            kind.periods, kind.periods_of = list(self._periods), self.current()
            if self._phase == "check" and kind.held is None:
                kind.held = self.current()  # planned, not checked yet: the next run checks it

    def _steady_advice(self, kind: _Kind, advice: Plan) -> Plan:
        """What auto would choose, kept from run to run: a new choice replaces the last one only
        where it is predicted faster by more than the run's spread (noise in the measurements
        alone does not move it)."""
        old = kind.advice
        if old is None or old.chosen.setting == advice.chosen.setting or kind.costs is None:
            return advice
        old_ms = predict(kind.costs, old.chosen.setting).step_ms
        if old_ms <= advice.chosen.prediction.step_ms * (1 + max(CHECK_TOLERANCE, kind.spread)):
            return old
        return advice

    def _advice(self, kind: _Kind, costs: Costs, current: Setting) -> dict[str, Any]:
        """With a setting fixed, what auto would choose instead, where that is worth saying: a step
        faster beyond the run's spread (at least what a check counts as noise), or the same step
        within it in less VRAM. Never a slower setting, nor the one in force."""
        auto = kind.advice.chosen.setting
        if auto == current:
            return {}
        now, then = predict(costs, current), predict(costs, auto)
        cost = now.step_ms - then.step_ms
        noise = max(CHECK_TOLERANCE, kind.spread) * max(kind.measured_ms or 0.0, then.step_ms)
        out: dict[str, Any] = {"auto_choice": _setting_json(auto, self._plan), "auto_predicted_ms": then.step_ms,
                               "auto_reason": kind.advice.reason.text}
        if cost > noise:
            return {**out, "explicit_cost_ms": cost}
        if abs(cost) <= noise and then.device_bytes < now.device_bytes:
            return {**out, "explicit_within_noise": True}
        return {}

    def _report(self, kind: _Kind | None) -> dict[str, Any] | None:
        """``Tuner.report`` for ``kind``, the kind of pass last seen."""
        if kind is None:
            return None
        costs = kind.costs
        current = self.current()
        # Why the setting in force is in force: the plan that chose it, or the rollback that brought
        # it back (none for the start setting; a later plan whose choice was not applied leaves it).
        in_force = kind.reasons.get(current)
        out: dict[str, Any] = {
            "auto": self._auto.left(),
            "phase": self._phase,
            "setting": _setting_json(current, self._plan),
            "predicted_ms": kind.predicted_ms,
            "measured_ms": kind.measured_ms,
            "measured_passes": list(kind.measured_passes) if kind.measured_passes else None,
            "verdict": kind.verdict,
            "verdict_key": VERDICT_KEYS.get(kind.verdict),
            "reason": in_force.text if in_force is not None else None,
            # the same words with {} for each size, and the sizes in bytes: the panel's own units
            "reason_template": in_force.template if in_force is not None else None,
            "reason_sizes": list(in_force.sizes) if in_force is not None else None,
            "budget_bytes": self.budget_bytes,
            "passes": self.passes,
            # the sampler's steps the run was told of (None: not told), the steps done, the most
            # calls of the model a step made: what a change within the run is weighed against
            "sampler_steps": self._run_steps.figures() if self._hook is not None else self._last_steps,
            # a change the next run starts with says why (``next_run``): the run ended first, or it
            # had too few calls left (``calls_left``) to repay the change
            "changes": [{"pass": e["pass"], "from": _setting_json(e["from"], self._plan),
                         "to": _setting_json(e["to"], self._plan), "why": e["why"],
                         **{k: e[k] for k in ("next_run", "calls_left") if k in e}} for e in self.events],
        }
        if costs is not None:
            now = predict(costs, current)
            out.update(bound=now.bound, device_bytes=now.device_bytes, hit_rate=now.hit_rate)
        if kind.plan is not None:  # what the last plan's search weighed, and its CPU
            out["plan_search"] = {"weighed": kind.plan.weighed, "considered": kind.plan.considered,
                                  "cpu_ms": kind.plan.cpu_ms}
        if kind.advice is not None and self._fixed() and costs is not None:
            out.update(self._advice(kind, costs, current))
        return out

    # ------------------------------------------------------------------ the panel
    def report(self) -> dict[str, Any] | None:
        """What the tuner chose and why, for the panel (None before anything was measured)."""
        return self._report(self._kinds.get(self._kind) if self._kind is not None else None)

def _setting_json(setting: Setting, p: StreamPlan) -> dict:
    blocks = sorted({p.units[u].block for u in setting.resident})
    return {"resident_blocks": blocks, "resident_units": len(setting.resident),
            "prefetch": setting.prefetch, "read_ahead": setting.read_ahead}


def _signature(args: tuple, kwargs: dict) -> tuple:
    """What sets a pass's cost among a call's inputs: the shapes and dtypes of its tensors."""
    out = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            out.append((tuple(value.shape), str(value.dtype)))
        elif isinstance(value, (list, tuple)):
            out.extend((tuple(v.shape), str(v.dtype)) for v in value if isinstance(v, torch.Tensor))
    return tuple(out)
