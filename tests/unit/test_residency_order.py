"""The order the node gives core's Dynamic VRAM (residency_order.py), measured and checked, on the
timed simulation of a device (timed_streams.py).

Core streams such a model itself, one block ahead of compute, keeping the blocks first in its
order resident as far as VRAM allows. The simulation runs that streaming with the engine at
prefetch 1 and a fixed resident set (the same pipeline: each streamed block's copy one ahead on
one copy stream), and the tuner sees only what it sees under core: each block's time between
marks around it (``CallTimer``: a streamed block's wait for its copy is in it), the period of a
call, and the link's rate. Held to:
- every resident set within the budget, run one by one (all of them: the exhaustive search): the
  tuner's order gives a step within 3% of the best, and never slower than the rule's order (as
  many blocks as the budget holds, spread evenly); measured where every block was resident, its
  prediction is within 5% of the step the next run measures;
- where copies hide behind compute, or the measured order would save under 1%, the order stays
  (laying VRAM out again is not free);
- a new order whose run is slower than the order before would have been in its conditions is
  rolled back, and not tried again; one that a busy host slowed down with everything else stays.
"""

from __future__ import annotations

import pytest

from itertools import combinations

import torch
from sim_shapes import KiB, Shape, run
from stream_model import installed

from offload_core.device.residency import bound_bytes, plan_residency
from offload_core.layerwise.measure import CallTimer
from offload_core.layerwise.pipeline import Setting
from offload_core.layerwise.planner import DEFAULT_PREFETCH
from offload_core.layerwise.residency_order import CORE_PREFETCH, OrderTuner


L = 64 * KiB
PASSES = 8
STEADY = 4
KEY = (1, 16, 8, 8)

# Two heavy blocks (a double block's size and compute) among light ones; a copy takes longer than
# a light block computes. The rule keeps none (3 slots of a heavy block fill the budget); with
# core's one block ahead, the heavy blocks and a light one fit.
HEAVY = Shape("heavy-among-light", (L, L, 3 * L, L, L, 3 * L), (0.9, 0.9, 2.5, 0.9, 0.9, 2.5), 0.6,
              L / 1.5, budget=9 * L + 64)
# Every copy hides behind the compute before it.
HIDDEN = Shape("compute-bound", (L,) * 6, (2.0,) * 6, 0.6, L / 0.5, budget=5 * L)


def _start(shape: Shape) -> tuple[int, ...]:
    """The rule's order: as many blocks as the budget holds, spread evenly."""
    return tuple(plan_residency(list(shape.sizes), 0, resident=None, vram_budget_bytes=shape.budget,
                                prefetch=DEFAULT_PREFETCH))


def _timed_run(shape, clock, stack, resident):
    """Core's streaming of ``resident`` first (the engine at prefetch 1), timed as the node times
    it: (steady step, (block times, period) of the last call marked whole)."""
    timer = None

    def mark(k: int) -> None:
        nonlocal timer
        if k == 0:  # after the streamer's hooks: the marks see a block's wait for its copy
            timer = CallTimer(torch.device("cpu"), stack, list(stack.blocks), calls=PASSES)

    result = run(shape, clock, stack, PASSES, setting=Setting(tuple(resident), CORE_PREFETCH), on_pass=mark)
    return result.steady(STEADY), timer.close(), result.output


def _all_sets(shape: Shape) -> list[tuple[int, ...]]:
    n = len(shape.sizes)
    return [s for k in range(n + 1) for s in combinations(range(n), k)
            if bound_bytes(list(shape.sizes), s, 0, CORE_PREFETCH) <= shape.budget]


def _tune(shape: Shape, monkeypatch, first_fits_all: bool = False):
    """A first run in the rule's order within ``shape.budget``, timed; or (``first_fits_all``) with
    room for every block, then VRAM for the budget only (another model took the rest). Then the
    tuner's order, the run with it, and every set's step."""
    n = len(shape.sizes)
    clock = shape.clock()
    with installed(clock, monkeypatch):
        stack = shape.build(clock)
        start = _start(shape)
        tuner = OrderTuner(shape.sizes, asynchronous=True)
        first = tuple(range(n)) if first_fits_all else start
        assert tuner.order(KEY, None if first_fits_all else shape.budget, first) == first
        assert tuner.wants_timing(KEY)
        _, (spans, period), reference = _timed_run(shape, clock, stack, first)
        tuner.measured(KEY, spans, period, shape.link, [i for i in range(n) if i not in first])
        chosen = tuner.order(KEY, shape.budget, start)
        step, (spans, period), output = _timed_run(shape, clock, stack, chosen)
        planned = tuner.report()
        tuner.measured(KEY, spans, period, shape.link, [i for i in range(n) if i not in chosen])
        steps = {s: _timed_run(shape, clock, stack, s)[0] for s in _all_sets(shape)}
        start_step = steps.get(start) or _timed_run(shape, clock, stack, start)[0]
    assert not clock.violations, clock.violations
    assert torch.equal(output, reference)
    return tuner, start, start_step, chosen, step, planned, steps


def test_the_measured_order_is_the_best_within_the_budget(monkeypatch):
    tuner, start, start_step, chosen, step, planned, steps = _tune(HEAVY, monkeypatch)
    best = min(steps.values())
    report = (f"start {start} {start_step:.3f} ms, chosen {chosen} {step:.3f} ms (predicted "
              f"{planned['predicted_ms']:.3f}; {planned['reason']}), best {min(steps, key=steps.get)} "
              f"{best:.3f} ms of {len(steps)} sets")
    print(report)
    assert chosen != start and planned["phase"] == "check", report
    assert {2, 5} <= set(chosen), report  # the heavy blocks: compute waits longest for them
    assert step <= best * 1.03 and step < start_step, report
    after = tuner.report()
    # From a run with every block streamed the model cannot tell how far ahead of a call the
    # first copies were made (the engine here fetches across calls; core, as a call begins), so
    # its prediction may be off; the check holds the faster order all the same.
    assert after["phase"] == "hold" and after["setting"]["resident_blocks"] == list(chosen), after
    assert after["changes"] == planned["changes"] and len(after["changes"]) == 1, after
    assert "blocks 2, 5 first in VRAM" in after["reason"], after
    assert not tuner.wants_timing(KEY), "a held order is not timed again"


def test_measured_with_every_block_resident_the_order_is_the_best_when_vram_shrinks(monkeypatch):
    """Every block's compute measured alone (nothing waited for a copy), then less VRAM."""
    tuner, start, start_step, chosen, step, planned, steps = _tune(HEAVY, monkeypatch, first_fits_all=True)
    best = min(steps.values())
    report = f"chosen {chosen} {step:.3f} ms (predicted {planned['predicted_ms']:.3f}), best {best:.3f} ms"
    print(report)
    assert {2, 5} <= set(chosen) and step <= best * 1.03, report
    assert abs(planned["predicted_ms"] - step) <= 0.05 * step, report


def test_copies_hidden_behind_compute_keep_the_order(monkeypatch):
    tuner, start, start_step, chosen, step, planned, steps = _tune(HIDDEN, monkeypatch)
    assert chosen == start and planned["phase"] == "hold" and not planned["changes"], planned
    assert step <= min(steps.values()) * 1.03, (step, steps)
    assert "copies hidden behind compute" in planned["reason"], planned


def test_a_fixed_count_stays_and_the_report_says_what_auto_would_keep(monkeypatch):
    """The user fixed one resident block (spread evenly: block 3, a light one). Its first run is
    measured; the order never changes, and the report gives auto's order within the same budget
    (the heavy blocks: the best of every set, run one by one) and the step it would save, a
    prediction from the fixed order's run that runs of both orders confirm: the fixed one slower.
    (From a run with most blocks streamed the model cannot tell how far ahead of a call core made
    the first copies, so the saving is not held to the 5% of a run measured with every block
    resident; test_measured_with_every_block_resident... holds that.)"""
    n = len(HEAVY.sizes)
    clock = HEAVY.clock()
    fixed = (3,)
    with installed(clock, monkeypatch):
        stack = HEAVY.build(clock)
        tuner = OrderTuner(HEAVY.sizes, asynchronous=True, fixed=True)
        tuner.advise(KEY, HEAVY.budget, _start(HEAVY), fixed)
        assert tuner.wants_timing(KEY) and tuner.report()["phase"] == "measure"
        fixed_step, (spans, period), _ = _timed_run(HEAVY, clock, stack, fixed)
        tuner.measured(KEY, spans, period, HEAVY.link, [i for i in range(n) if i not in fixed])
        report = tuner.report()
        auto = tuple(report["auto_choice"]["resident_blocks"])
        auto_step = _timed_run(HEAVY, clock, stack, auto)[0]
        best = min(_timed_run(HEAVY, clock, stack, s)[0] for s in _all_sets(HEAVY))
    assert not clock.violations, clock.violations
    text = (f"fixed {fixed} {fixed_step:.3f} ms, auto would keep {auto} {auto_step:.3f} ms (predicted "
            f"{report['auto_predicted_ms']:.3f}, saving {report['explicit_cost_ms']:.3f}), best {best:.3f} ms")
    print(text)
    assert report["auto"] == [] and report["setting"]["resident_blocks"] == [3], report
    assert report["phase"] == "hold" and not report["changes"] and not tuner.wants_timing(KEY), report
    assert {2, 5} <= set(auto) and auto_step <= best * 1.03, text
    assert report["explicit_cost_ms"] > 0 and fixed_step > auto_step * 1.03, text
    assert report["measured_ms"] == pytest.approx(period) and report["predicted_ms"] is None, report
    assert "blocks 2, 5" in report["auto_reason"], report
    # The next run keeps the user's order and is not measured again.
    tuner.advise(KEY, None, (), fixed)
    assert tuner.report()["setting"]["resident_blocks"] == [3] and not tuner.wants_timing(KEY)


def test_a_fixed_count_that_auto_would_keep_has_no_difference():
    """Copies hidden behind compute: auto keeps the rule's order, which the user's count gives."""
    tuner = OrderTuner((L, L, L), asynchronous=True, fixed=True)
    tuner.advise(KEY, 5 * L, (), ())
    tuner.measured(KEY, [(0.5, 2.5), (2.5, 4.5), (4.5, 6.5)], 7.0, L / 0.5, [0, 1, 2])
    report = tuner.report()
    assert report["auto_choice"]["resident_blocks"] == [] and "explicit_cost_ms" not in report, report
    assert "copies hidden behind compute" in report["auto_reason"], report


def _spans(compute, outside=0.6):
    """Blocks one after another, each for its compute, half the outside work before them."""
    spans, t = [], outside / 2
    for ms in compute:
        spans.append((t, t + ms))
        t += ms
    return spans, t + outside / 2


def test_a_slower_order_is_rolled_back_and_not_tried_again():
    """The order measured best turns out slower than the one before in the next run's conditions
    (a block now computes twice as long, which hid the copies the old order made): it is rolled
    back, and not chosen again."""
    sizes = (3 * L, 3 * L, L, 3 * L)
    tuner = OrderTuner(sizes, asynchronous=True)
    start = (0,)
    budget = 9 * L
    assert tuner.order(KEY, budget, start) == start
    spans, period = _spans((0.8, 1.3, 1.4, 0.9))
    tuner.measured(KEY, spans, period, L / 1.0, [])  # core held every block: VRAM to spare
    chosen = tuner.order(KEY, budget, start)
    assert chosen == (1,) and tuner.wants_timing(KEY)
    spans, period = _spans((0.8, 1.3, 2.8, 0.9))
    tuner.measured(KEY, spans, period, L / 1.0, [])
    report = tuner.report()
    assert report["phase"] == "hold" and report["changes"][-1]["why"] == "slower than predicted", report
    assert report["reason"].startswith("rolled back"), report
    assert tuner.order(KEY, budget, start) == start
    tuner.measured(KEY, spans, period, L / 1.0, [])  # measured again: planned again without it
    assert tuner.order(KEY, budget, start) != chosen


def test_a_host_that_slowed_every_order_down_keeps_the_new_order(monkeypatch):
    """The run with the new order comes out three times slower than predicted, every block with
    it (a busy host): no order would have been faster, so it stays."""
    n = len(HEAVY.sizes)
    clock = HEAVY.clock()
    with installed(clock, monkeypatch):
        stack = HEAVY.build(clock)
        tuner = OrderTuner(HEAVY.sizes, asynchronous=True)
        tuner.order(KEY, None, tuple(range(n)))
        _, (spans, period), _ = _timed_run(HEAVY, clock, stack, tuple(range(n)))
        tuner.measured(KEY, spans, period, HEAVY.link, [])
        chosen = tuner.order(KEY, HEAVY.budget, _start(HEAVY))
        _, (spans, period), _ = _timed_run(HEAVY, clock, stack, chosen)
    tuner.measured(KEY, [(a * 3, b * 3) for a, b in spans], period * 3, HEAVY.link,
                   [i for i in range(n) if i not in chosen])
    report = tuner.report()
    assert report["verdict"] == "slower than predicted" and report["phase"] == "hold", report
    assert len(report["changes"]) == 1 and tuner.order(KEY, HEAVY.budget, _start(HEAVY)) == chosen


def test_another_latent_is_measured_and_planned_apart():
    tuner = OrderTuner((L, 3 * L, L), asynchronous=True)
    tuner.order(KEY, 10 * L, (0, 1, 2))
    tuner.measured(KEY, [(0.5, 1.5), (1.5, 3.5), (3.5, 4.5)], 5.0, L / 1.5, [])
    assert tuner.order(KEY, 10 * L, (0, 1, 2)) == (0, 1, 2)
    assert not tuner.wants_timing(KEY)
    other = (2, 16, 8, 8)
    assert tuner.order(other, 10 * L, (1,)) == (1,) and tuner.wants_timing(other)


def test_without_room_for_streaming_no_block_is_first():
    tuner = OrderTuner((L, 3 * L, L), asynchronous=True)
    tuner.order(KEY, None, ())
    tuner.measured(KEY, [(0.5, 1.5), (1.5, 3.5), (3.5, 4.5)], 5.0, L / 1.5, [0, 1, 2])
    assert tuner.order(KEY, None, ()) == () and not tuner.wants_timing(KEY)
    assert tuner.report()["reason"].startswith("no VRAM left for a resident block"), tuner.report()


def test_the_timer_marks_each_block_and_comes_off():
    blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = blocks

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    stack = Stack()
    timer = CallTimer(torch.device("cpu"), stack, list(blocks), calls=2)
    with torch.no_grad():
        for _ in range(4):  # the third call takes the hooks off
            stack(torch.zeros(1, 8))
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in [stack, *blocks])
    assert hooks == 0
    spans, period = timer.close()
    assert len(spans) == 3 and all(0 <= a < b <= period for a, b in spans), (spans, period)
    assert all(spans[i][1] <= spans[i + 1][0] for i in range(2)), "blocks run one after another"
    # A run whose calls never reached every block has nothing to say.
    idle = CallTimer(torch.device("cpu"), stack, list(blocks))
    assert idle.close() is None
    assert sum(len(m._forward_pre_hooks) for m in [stack, *blocks]) == 0
