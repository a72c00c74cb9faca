"""The planner's search bounds itself (planner.py ``plan``): candidates are predicted in the order
of a lower bound of their step, none whose bound is beyond the tie of the fastest found, and none
once the CPU it may take is spent. Held to: the bound leaves out nothing the choice could be (the
same choice as every candidate predicted, on link-, compute-, disk-bound and uneven costs); a
capped search stops where its cap says, on a clock of its own (no figure here depends on the
machine), keeps the start setting among what it weighed and is never predicted slower than it.
What a plan really took is in its report (``cpu_ms``), never asserted: no test here is timed."""
from __future__ import annotations

import itertools

import pytest

from offload_core.layerwise import planner, tuning
from offload_core.layerwise.pipeline import Costs, DiskCosts, Setting, predict
from offload_core.layerwise.planner import TIE, Choices, candidates, plan

KiB = 1 << 10


def costs(kind: str, units: int = 12) -> Costs:
    blocks = tuple(range(units))
    size = 64 * KiB
    if kind == "link":
        return Costs((1.0,) * units, (2.0,) * units, (size,) * units, blocks, 0, 0.6, True)
    if kind == "compute":
        return Costs((1.5,) * units, (0.5,) * units, (size,) * units, blocks, 0, 0.6, True)
    if kind == "uneven":
        sizes = (3 * size,) * 3 + (size,) * (units - 3)
        return Costs((2.5,) * 3 + (0.9,) * (units - 3), (2.0,) * 3 + (0.7,) * (units - 3), sizes, blocks, 0, 0.6, True)
    if kind == "disk":
        return Costs((1.0,) * units, (0.5,) * units, (size,) * units, blocks, 0, 0.6, True,
                     DiskCosts(size / 3.0, 5 * (size + 4096)))
    if kind == "host":
        return Costs((1.0,) * units, (0.4,) * units, (size,) * units, blocks, 0, 0.6, False)
    raise ValueError(kind)


def exhaustive(c: Costs, budget: int | None, default: Setting) -> Setting:
    """The planner's choice with every candidate predicted (the same tie rules)."""
    pool = [planner.Candidate(s, predict(c, s)) for s in itertools.chain([default], candidates(c, Choices()))]
    within = [x for x in pool if budget is None or x.prediction.device_bytes <= budget]
    base = next((x for x in within if x.setting == default), None)
    return planner._pick(c, within, base).setting


@pytest.mark.parametrize("kind", ["link", "compute", "uneven", "disk", "host"])
def test_the_bound_leaves_out_nothing_the_choice_could_be(kind):
    c = costs(kind)
    budget = 6 * 64 * KiB + 64
    default = Setting((), 2, 2 if c.disk else 0)
    chosen = plan(c, Choices(), budget, default)
    assert chosen.chosen.setting == exhaustive(c, budget, default), chosen
    assert chosen.weighed <= chosen.considered + 1


@pytest.mark.parametrize("units", [57, 171])
def test_a_capped_search_stops_at_its_cap_and_keeps_the_start(units, monkeypatch):
    """A disk run of 57 or 171 units (19 or 57 blocks in three phases): a 50 ms budget weighs as
    many predictions as ``prediction_work`` says fit, the start setting among them, and chooses
    none predicted slower than the start; what that took is reported."""
    c = costs("disk", units)
    c = Costs(c.compute_ms, c.copy_ms, c.unit_bytes, tuple(u // 3 for u in range(units)), 0, 0.6, True,
              DiskCosts(64 * KiB / 3.0, 12 * (64 * KiB + 4096)))
    made = []
    monkeypatch.setattr(planner, "predict", lambda c, s: made.append(s) or predict(c, s))
    default = Setting((), 2, 2)
    result = plan(c, Choices(), None, default, work_us=tuning.PLAN_US)
    assert len(made) == result.weighed <= tuning.PLAN_US // planner.prediction_work(c), result
    assert made[0] == default and result.default.setting == default
    assert result.chosen.prediction.step_ms <= result.default.prediction.step_ms
    assert result.weighed < result.considered and result.cpu_ms > 0  # it stopped: there was more


@pytest.mark.parametrize("kind", ["compute", "disk"])
def test_among_settings_as_fast_a_held_one_stays_and_else_the_cheapest_to_attach(kind):
    """Where copies hide behind compute, keeping blocks resident buys no step: a setting with 4
    resident is as fast as one with none. A run starting from it moves to the one that puts up
    fewest resident units at each attach (their copy, from disk their read too); a run whose
    tuner checked and held it keeps it (``keep_default``): the measurements cannot tell the two
    apart, and a new setting costs a new device schedule."""
    c = costs(kind)
    if kind == "disk":  # a disk fast enough to hide behind compute as well
        c = Costs(c.compute_ms, c.copy_ms, c.unit_bytes, c.unit_blocks, 0, 0.6, True,
                  DiskCosts(64 * KiB / 0.5, 13 * (64 * KiB + 4096)))
    held = Setting((0, 3, 6, 9), 2, 2 if c.disk else 0)
    moved = plan(c, Choices(), None, held).chosen
    kept = plan(c, Choices(), None, held, keep_default=True).chosen
    assert kept.setting == held, kept
    assert moved.prediction.step_ms <= kept.prediction.step_ms * (1 + TIE), (moved, kept)
    assert planner.attach_ms(c, moved.setting) < planner.attach_ms(c, held), moved
