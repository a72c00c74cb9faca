"""Which blocks another streamer should keep first in VRAM, chosen by measurement and checked.

Why: core's Dynamic VRAM streams a model itself and keeps its weights resident in the order of
their places in VRAM, lowest first, as far as the card allows. The node chooses that order; a
rule (as many blocks as fit, spread evenly) keeps blocks that compute would not have waited for
and streams the ones it waits for longest. Here the run's own figures choose: the blocks' times
(``measure.CallTimer``) and the link's rate (``device/link.py``) make the costs of a pass
(``measure.block_costs``), and the planner (planner.py) weighs every resident set it weighs for
the engine with the same pipeline model (pipeline.py), the prefetch being core's own.

Each kind of run (the shape of the latent: another resolution or batch changes what a block
costs) goes through: measure (a run with the starting order) -> plan (before the next load; the
order changes only where the model predicts a faster step by more than ``planner.TIE``, since
laying VRAM out again drops every page the model holds there) -> check (the next run is measured
and held against the prediction by the engine's own rule (check.py): slower
than the order before, judged in the conditions just measured, and the order before comes back,
the rejected one not tried again; a host or link that slowed every order down is no reason)
-> hold.
Where the user fixed the count (``fixed``), the order is theirs and never changes: the first run of
each kind is measured all the same, and the report says what auto would have kept first with the
same VRAM (the rule's order, or the measured one where it is faster by more than ``TIE``) and
what that would save or cost a step, by the same model.
Whatever the order, every block computes with the same weights.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .measure import block_costs
from .pipeline import Costs, Setting, predict
from .planner import TIE, Choices, Plan, Reason, ms_text, plan, plural
from .check import ROLLED_BACK, VERDICT_KEYS, Outcome, Trial, check, verdict

CORE_PREFETCH = 1  # core's block prefetch fetches one block ahead


@dataclass
class _Kind:
    order: tuple[int, ...]  # resident blocks in force for this kind of run
    phase: str = "measure"  # measure -> plan -> check -> hold
    costs: Costs | None = None
    plan: Plan | None = None
    predicted_ms: float | None = None
    measured_ms: float | None = None
    verdict: str | None = None
    trial: Trial | None = None  # the order a plan replaced, and its step
    rejected: list[Setting] = field(default_factory=list)
    reason: Reason | None = None
    # A count the user fixed: auto's budget and rule's order for this kind, and auto's choice.
    budget_bytes: int | None = None
    rule: tuple[int, ...] = ()
    advice: tuple[Setting, float, Reason] | None = None
    held: tuple[int, ...] = ()  # the blocks core held resident in the measured run


class OrderTuner:
    """Measure, plan, check and roll back the resident blocks of one model another streamer runs.

    ``asynchronous``: copies run beside compute, one block ahead (core's prefetch on a GPU); else
    a streamed block waits for its whole copy when it runs. ``fixed``: the user fixed the resident
    blocks; they are measured and compared with auto's choice (``advise``), never changed."""

    def __init__(self, block_bytes: Sequence[int], *, asynchronous: bool, fixed: bool = False) -> None:
        self.block_bytes = tuple(int(b) for b in block_bytes)
        self.asynchronous = asynchronous
        self.fixed = fixed
        self.runs = 0
        self.changes: list[dict[str, Any]] = []
        self.link_bytes_per_ms: float | None = None
        self.block_ms: list[float] | None = None
        self._kinds: dict[Hashable, _Kind] = {}
        self._key: Hashable | None = None

    def _setting(self, resident: Sequence[int]) -> Setting:
        return Setting(tuple(sorted(resident)), CORE_PREFETCH)

    def order(self, key: Hashable, budget_bytes: int | None, start: Sequence[int]) -> tuple[int, ...]:
        """The resident blocks for a run of ``key`` with ``budget_bytes`` of VRAM for blocks (None:
        not even streaming fits, so none is resident), ``start`` being the rule's order."""
        self._key = key
        kind = self._kinds.get(key)
        if kind is None:
            kind = self._kinds[key] = _Kind(tuple(sorted(start)))
        if kind.costs is None:
            kind.order = tuple(sorted(start))
            return kind.order
        if budget_bytes is None:  # not even streaming fits: core streams every block
            kind.order, kind.phase, kind.plan = tuple(sorted(start)), "hold", None
            kind.predicted_ms = predict(kind.costs, self._setting(kind.order)).step_ms
            kind.reason = Reason("no VRAM left for a resident block once streaming has its room: "
                                 "core streams every block in run order")
            return kind.order
        current = self._setting(kind.order)
        if predict(kind.costs, current).device_bytes > budget_bytes:
            kind.order = tuple(sorted(start))  # less VRAM than when it was chosen
            current = self._setting(kind.order)
            if kind.phase == "hold":
                kind.phase = "plan"
        if kind.phase != "plan":
            return kind.order
        result, change = _weigh(kind.costs, budget_bytes, current, kind.rejected)
        kind.plan = result
        if change is not None:
            chosen = result.chosen.setting
            kind.trial = Trial(current, kind.measured_ms or predict(kind.costs, current).step_ms)
            self.changes.append({"pass": self.runs + 1, "from": self._json(kind.order),
                                 "to": self._json(chosen.resident), "why": "planned"})
            kind.order = chosen.resident
            kind.predicted_ms = result.chosen.prediction.step_ms
            kind.phase = "check"
        else:
            kind.predicted_ms = predict(kind.costs, current).step_ms
            kind.phase = "hold"
        kind.reason = _kept_reason(kind.costs, result, current) if change is None else change
        return kind.order

    def advise(self, key: Hashable, budget_bytes: int | None, rule: Sequence[int],
               fixed: Sequence[int]) -> None:
        """A run of ``key`` with the user's ``fixed`` resident blocks; auto would have had
        ``budget_bytes`` of VRAM for blocks (None: not even streaming fits) and started from the
        ``rule``'s order. Its first run is measured (``measured`` then works out auto's choice)."""
        self._key = key
        kind = self._kinds.get(key)
        if kind is None:
            kind = self._kinds[key] = _Kind(tuple(sorted(fixed)))
        kind.order = tuple(sorted(fixed))
        if kind.costs is None:
            kind.budget_bytes, kind.rule = budget_bytes, tuple(sorted(rule))

    def wants_timing(self, key: Hashable) -> bool:
        """Whether a run of ``key`` is to be measured (to plan, or to check a new order)."""
        kind = self._kinds.get(key)
        return kind is None or kind.costs is None or kind.phase in ("measure", "check")

    def measured(self, key: Hashable, spans: Sequence[tuple[float, float]], period_ms: float,
                 link_bytes_per_ms: float, streamed: Sequence[int] = ()) -> None:
        """A run of ``key`` was timed: each block's start and end in a pass, the pass's period,
        the link's rate, and the blocks the streamer did not hold resident in it."""
        self.runs += 1
        self.block_ms = [float(end - start) for start, end in spans]
        self.link_bytes_per_ms = link_bytes_per_ms
        kind = self._kinds.setdefault(key, _Kind(()))
        kind.costs = block_costs(spans, self.block_bytes, period_ms, link_bytes_per_ms,
                                 self.asynchronous, streamed)
        kind.measured_ms = period_ms
        if self.fixed:
            # What core held resident in the run (a fixed count may be more than fits).
            kind.held = tuple(i for i in range(len(self.block_bytes)) if i not in set(streamed))
            kind.advice = self._auto_choice(kind)
            kind.phase = "hold"
        elif kind.phase == "check" and kind.predicted_ms:
            kind.verdict = verdict(kind.predicted_ms, period_ms)
            if check(kind.costs, self._setting(kind.order), kind.predicted_ms, period_ms,
                     kind.trial) is Outcome.ROLL_BACK:
                back = kind.trial.before.resident
                kind.rejected.append(self._setting(kind.order))
                self.changes.append({"pass": self.runs + 1, "from": self._json(kind.order),
                                     "to": self._json(back), "why": "slower than predicted"})
                kind.order = back
                kind.verdict = ROLLED_BACK
                kind.reason = Reason(f"rolled back: {ms_text(period_ms)} a step measured, "
                                     f"{ms_text(kind.predicted_ms)} predicted, "
                                     f"{ms_text(kind.trial.before_ms)} before")
            kind.phase = "hold"  # laying VRAM out again is not free: a slower order is not re-planned
        else:  # planned before the next load, with the newest figures
            kind.phase = "plan"
            if kind.predicted_ms:
                kind.verdict = verdict(kind.predicted_ms, period_ms)

    def _auto_choice(self, kind: _Kind) -> tuple[Setting, float, Reason]:
        """What auto would have kept first, as ``order`` decides it for the rule's order, with the
        step the model predicts for it; against the blocks held, ``report`` gives the difference."""
        start = self._setting(kind.rule)
        if kind.budget_bytes is None:
            return (start, predict(kind.costs, start).step_ms,
                    Reason("no VRAM left for a resident block once streaming has its room: core "
                           "streams every block in run order"))
        result, change = _weigh(kind.costs, kind.budget_bytes, start, ())
        if change is not None:
            return result.chosen.setting, result.chosen.prediction.step_ms, change
        return start, predict(kind.costs, start).step_ms, _kept_reason(kind.costs, result, start)

    def _json(self, resident: Sequence[int]) -> dict[str, Any]:
        return {"resident_blocks": sorted(resident), "resident_units": len(resident),
                "prefetch": None, "read_ahead": 0}

    def report(self) -> dict[str, Any] | None:
        """What the tuner chose for the kind of run last planned, and why (the layerwise report's
        ``tuning``, as the engine's tuner gives it); None before the first plan."""
        kind = self._kinds.get(self._key) if self._key is not None else None
        if kind is None:
            return None
        out: dict[str, Any] = {
            "auto": [] if self.fixed else ["resident"],
            "phase": kind.phase,
            "setting": self._json(kind.order),
            "predicted_ms": kind.predicted_ms,
            "measured_ms": kind.measured_ms,
            "verdict": kind.verdict,
            "verdict_key": VERDICT_KEYS.get(kind.verdict),
            "reason": kind.reason.text if kind.reason else None,
            "reason_template": kind.reason.template if kind.reason else None,
            "reason_sizes": list(kind.reason.sizes) if kind.reason else None,
            "budget_bytes": kind.plan.budget_bytes if kind.plan else None,
            "passes": self.runs,
            "counted": "runs",
            "changes": list(self.changes),
            "block_ms": self.block_ms,
            "link_bytes_per_ms": self.link_bytes_per_ms,
        }
        if kind.costs is not None:
            now = predict(kind.costs, self._setting(kind.order))
            out.update(bound=now.bound, device_bytes=now.device_bytes)
        if kind.advice is not None:
            auto, auto_ms, why = kind.advice
            out.update(auto_choice=self._json(auto.resident), auto_predicted_ms=auto_ms, auto_reason=why.text)
            if auto.resident != kind.held:
                # The model's step for what core held of the user's order (all of it, or as much
                # as fit), so that both sides of the difference are predictions from one run.
                out["explicit_cost_ms"] = predict(kind.costs, self._setting(kind.held)).step_ms - auto_ms
        return out


def _weigh(costs: Costs, budget_bytes: int, current: Setting,
           rejected: Sequence[Setting]) -> tuple[Plan, Reason | None]:
    """The planner's best order within the budget, and the reason to change to it: None where it is
    the order in force or saves no more than ``TIE`` of the step (laying VRAM out again is not free)."""
    result = plan(costs, Choices(prefetch=CORE_PREFETCH), budget_bytes, current, rejected)
    now = predict(costs, current).step_ms
    gain = now - result.chosen.prediction.step_ms
    if result.chosen.setting.resident != current.resident and gain > TIE * now:
        return result, _reason(result)
    return result, None


def _kept_reason(costs: Costs, result: Plan, current: Setting) -> Reason:
    """Why the order ``current`` stays, ``result`` being the planner's best."""
    chosen = result.chosen
    if chosen.setting.resident == current.resident:
        return _reason(result)
    gain = predict(costs, current).step_ms - chosen.prediction.step_ms
    if gain <= 0:
        return Reason("the order in force is as fast as any the measurements find"
                      + (": copies hidden behind compute" if chosen.prediction.bound == "compute" else ""))
    return Reason(f"the best order measured would save {ms_text(gain)} a step, under 1%: the order "
                  "in force is kept, since laying VRAM out again drops every page the model holds there")


def _reason(result: Plan) -> Reason:
    """Why these blocks come first, in the words the panel shows."""
    chosen = result.chosen
    blocks = sorted(chosen.setting.resident)
    which = ", ".join(str(b) for b in blocks)
    if chosen.prediction.bound == "compute":
        if not blocks:
            return Reason("copies hidden behind compute: no block needs to come first in VRAM; "
                          "core keeps the blocks it has room for in run order")
        return Reason(f"copies hidden behind compute with block{plural(len(blocks))} {which} first in VRAM")
    text = (f"link-bound: block{plural(len(blocks))} {which} first in VRAM, the ones compute would wait "
            f"for longest; copies take {ms_text(chosen.prediction.copy_busy_ms)} a step")
    base = result.default
    if base is not None and base.setting != chosen.setting:
        text += (f" ({ms_text(chosen.prediction.step_ms)} a step predicted, "
                 f"{ms_text(base.prediction.step_ms)} in the order before)")
    if result.more is not None:
        saved = chosen.prediction.step_ms - result.more.prediction.step_ms
        need = result.more.prediction.device_bytes - chosen.prediction.device_bytes
        return Reason(text + f"; more VRAM for blocks would save {ms_text(saved)} a step; it needs {{}} more",
                      (need,))
    return Reason(text)
