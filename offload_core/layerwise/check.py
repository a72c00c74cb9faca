"""The check both tuners make of a setting a plan applied: the engine's tuner (tuning.py) for its
streamer's settings, and the order tuner (residency_order.py) for the blocks another streamer keeps
first in VRAM.

Why one rule: a plan is a prediction, and a setting that runs slower than it was predicted to is
either wrong (the model of its costs was wrong: roll back to the setting before) or right in
conditions that changed (a slower link slows every setting: keep it and plan again). Which one it
is cannot be told from the step alone, so both tuners ask the same question of the costs just
measured (``check``), and name what they saw in the same words (``verdict``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from .pipeline import Costs, Setting, predict

CHECK_TOLERANCE = 0.05  # a pass up to this much slower than predicted is as predicted


class Outcome(enum.Enum):
    """What a check found: the setting is kept; it is slower than predicted but not than the one
    before (the conditions moved: plan again); or slower than both (roll back)."""

    AS_PREDICTED = "as predicted"
    SLOWER = "slower"
    ROLL_BACK = "roll back"


@dataclass(frozen=True)
class Trial:
    """A setting applied on a plan's word: the setting it replaced, and that setting's step."""

    before: Setting
    before_ms: float


def check(costs: Costs, current: Setting, predicted: float, period: float, trial: Trial | None,
          outside_ms: float | None = None) -> Outcome:
    """A step of ``period`` measured of ``current`` against its prediction, and against the
    setting before it where a plan replaced one (``trial``; None: nothing to roll back to). The
    setting before comes back wherever it is the faster one, judged as ``slower_than_before``
    says, even in a step as fast as predicted: the units' costs measured in it may show that the
    plan was made in conditions that have gone."""
    if trial is not None and trial.before != current and slower_than_before(
            costs, current, (trial.before, trial.before_ms), predicted, period, outside_ms):
        return Outcome.ROLL_BACK
    if period <= predicted * (1 + CHECK_TOLERANCE):
        return Outcome.AS_PREDICTED
    return Outcome.SLOWER


def slower_than_before(costs: Costs, current: Setting, before: tuple[Setting, float], predicted: float,
                       period: float, outside_ms: float | None = None) -> bool:
    """Whether the setting in force is slower than the one before it, its pass having been
    slower than predicted. Where the units themselves now cost more than when the plan was
    made (the model predicts the slower pass from what was just measured: a slower link, a
    busier device), both settings are judged by the model in these new conditions, since a step
    measured before them says nothing of them. Where they do not (the model was wrong about
    this setting), by the steps measured. ``outside_ms``: the time outside the units when the
    plan was made; time that grew outside the units is not the units' and may be the setting's
    own (the host's work per streamed unit), so it is judged by the steps measured."""
    if outside_ms is not None:
        costs = replace(costs, outside_ms=outside_ms)
    now = predict(costs, current).step_ms
    if now > predicted * (1 + CHECK_TOLERANCE):
        return predict(costs, before[0]).step_ms * (1 + CHECK_TOLERANCE) < now
    return period > before[1] * (1 + CHECK_TOLERANCE)


# The verdicts a panel can put in its user's language (the rest, which name figures or errors, are
# the engine's words): the words, and the key the report gives beside them.
ROLLED_BACK = "slower than predicted, and than the setting before: rolled back"
VERDICT_KEYS = {
    "as predicted": "as_predicted",
    "faster than predicted": "faster",
    "slower than predicted": "slower",
    ROLLED_BACK: "rolled_back",
    "the model's passes do not run every block: the setting stays": "partial_passes",
    "the planned setting measured no faster in this run: the setting stays": "no_faster",
    "measuring": "measuring",
}


def verdict(predicted: float, measured: float) -> str:
    """The measured step against the predicted one, in the panel's words (the panel shows both)."""
    ratio = measured / predicted if predicted > 0 else 1.0
    if ratio > 1 + CHECK_TOLERANCE:
        return "slower than predicted"
    if ratio < 1 - CHECK_TOLERANCE:
        return "faster than predicted"
    return "as predicted"
