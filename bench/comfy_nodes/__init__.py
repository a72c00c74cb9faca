"""Benchmark-only ComfyUI nodes, linked into the server that bench/comfy_wan.py starts.

- TieredBenchClock (MODEL -> MODEL): times every call of the model's apply_model and resets the
  device's peak-memory counter, so a run's figures cover its sampling (model loads included)
  and nothing before it. It is an APPLY_MODEL wrapper under its own key, so it chains with the
  pack's wrappers and any others instead of replacing them.
- TieredBenchReport (output node): puts the call times, the device's peak memory and what core
  believes is loaded into /history.

On CUDA the times come from events on the compute stream, so timing never adds a host sync
that would drain the copy stream's prefetch between steps.
"""
from __future__ import annotations

import time
from typing import Any

import comfy.model_management
import comfy.patcher_extension
import torch

KEY = "tiered_offload_bench"


class _Clock:
    """Start and end marks of each apply_model call of the current run."""

    def __init__(self) -> None:
        self.device: torch.device | None = None
        self.marks: list[tuple[Any, Any]] = []

    def reset(self, device: torch.device) -> None:
        self.device, self.marks = device, []
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)

    def mark(self) -> Any:
        if self.device is not None and self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self) -> list[float]:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return [start.elapsed_time(end) / 1000 for start, end in self.marks]
        return [end - start for start, end in self.marks]

    def span(self) -> float:
        """From the first call's start to the last call's end: the sampling loop's time."""
        if not self.marks:
            return 0.0
        first, last = self.marks[0][0], self.marks[-1][1]
        if self.device is not None and self.device.type == "cuda":
            return first.elapsed_time(last) / 1000
        return last - first


CLOCK = _Clock()


def _timed_apply_model(executor, *args, **kwargs):
    start = CLOCK.mark()
    out = executor(*args, **kwargs)
    CLOCK.marks.append((start, CLOCK.mark()))
    return out


class TieredBenchClock:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "wrap"
    CATEGORY = "tiered_offload/bench"

    @classmethod
    def IS_CHANGED(cls, **_):
        return float("nan")

    def wrap(self, model):
        clocked = model.clone()
        clocked.remove_wrappers_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, KEY)
        clocked.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, KEY,
                                     _timed_apply_model)
        CLOCK.reset(clocked.load_device)
        return (clocked,)


def _loaded_models() -> list[dict[str, Any]]:
    """What core's memory manager believes is on the device, model by model."""
    out = []
    for loaded in comfy.model_management.current_loaded_models:
        patcher = loaded.model
        if patcher is None:
            continue
        out.append({"class": type(patcher.model).__name__,
                    "device": str(loaded.device),
                    "loaded_bytes": int(loaded.model_loaded_memory()),
                    "total_bytes": int(patcher.model_size()),
                    "lowvram_patches": int(getattr(patcher.model, "lowvram_patch_counter", 0))})
    return out


class TieredBenchReport:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "label": ("STRING", {"default": ""})}}

    RETURN_TYPES = ()
    FUNCTION = "report"
    OUTPUT_NODE = True
    CATEGORY = "tiered_offload/bench"

    def report(self, samples, label):
        device = CLOCK.device
        calls = CLOCK.seconds()
        cuda = device is not None and device.type == "cuda"
        figures = {
            "label": label,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if cuda else None,
            "call_s": calls,
            "span_s": CLOCK.span(),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
            "loaded_models": _loaded_models(),
        }
        return {"ui": {"bench": [figures]}}


NODE_CLASS_MAPPINGS = {"TieredBenchClock": TieredBenchClock, "TieredBenchReport": TieredBenchReport}
NODE_DISPLAY_NAME_MAPPINGS = {"TieredBenchClock": "Bench: clock model calls",
                              "TieredBenchReport": "Bench: report"}
