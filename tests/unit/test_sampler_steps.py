"""nodes/layerwise/sampler_steps.py reads a sampling run's length and each step's end from the
arguments of core's OUTER_SAMPLE, as core passes them (``executor.execute(noise, latent_image,
sampler, sigmas, denoise_mask, callback, disable_pbar, seed, latent_shapes=...)``), or by keyword;
core's own callback still runs after each step, with what it was given, and a failure to count
never reaches the sampler. It imports no ComfyUI, so it is loaded from its file here."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parents[2] / "nodes" / "layerwise" / "sampler_steps.py"
_spec = importlib.util.spec_from_file_location("sampler_steps", SOURCE)
sampler_steps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sampler_steps)

SIGMAS = torch.linspace(1.0, 0.0, 9)  # 8 steps


def test_positional_arguments_as_core_passes_them():
    seen, ends = [], []
    args = ("noise", "latent", "sampler", SIGMAS, None, lambda *a: seen.append(a), False, 0)
    assert sampler_steps.steps_of(args, {}) == 8
    new_args, kwargs = sampler_steps.with_step_ends(args, {"latent_shapes": None}, lambda: ends.append(1))
    assert new_args[:5] == args[:5] and new_args[6:] == args[6:] and kwargs == {"latent_shapes": None}
    new_args[5](3, "x0", "x", 8)
    assert ends == [1] and seen == [(3, "x0", "x", 8)]


def test_keyword_arguments_and_no_callback_of_cores():
    ends = []
    kwargs = {"sigmas": SIGMAS[:5], "callback": None}
    assert sampler_steps.steps_of((), kwargs) == 4
    _, new = sampler_steps.with_step_ends((), kwargs, lambda: ends.append(1))
    assert new["callback"](0, None, None, 4) is None and ends == [1]


def test_what_is_not_cores_signature_counts_nothing():
    assert sampler_steps.steps_of(("noise",), {}) is None
    assert sampler_steps.steps_of((), {"sigmas": torch.ones(1)}) is None  # no step at all
    assert sampler_steps.steps_of((), {"sigmas": "not a tensor"}) is None
    args = ("noise", "latent")
    assert sampler_steps.with_step_ends(args, {}, lambda: None) == (args, {})


def test_a_failure_to_count_never_reaches_the_sampler():
    seen = []

    def broken() -> None:
        raise RuntimeError("counting failed")

    _, kwargs = sampler_steps.with_step_ends((), {"callback": lambda *a: seen.append(a)}, broken)
    kwargs["callback"](1, "x0", "x", 8)
    assert seen == [(1, "x0", "x", 8)]
