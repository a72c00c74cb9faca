"""Benchmark-only ComfyUI nodes, linked into the server that bench/comfy_wan.py starts.

- TieredBenchClock (MODEL -> MODEL): times every call of the model's apply_model and resets the
  device's peak-memory counter, so a run's figures cover its sampling (model loads included)
  and nothing before it. It is an APPLY_MODEL wrapper under its own key, so it chains with the
  pack's wrappers and any others instead of replacing them.
- TieredBenchReport (output node): puts the call times, the device's peak memory, the server's
  host RSS and what core believes is loaded into /history.

Peak device memory is counted twice: torch's allocator peak, and the device's own use (total less
free, read after every model call). Under Dynamic VRAM (ComfyUI 0.15 and later) core maps its
weights' VRAM outside torch's allocator, so only the second sees them. Host RSS is the server's
anonymous and file-backed resident memory when the run ends, and its peak (VmHWM, reset with the
clock).

On CUDA the times come from events on the compute stream, so timing never adds a host sync
that would drain the copy stream's prefetch between steps.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
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
        self.device_peak = 0  # device-wide bytes in use, the most seen after a model call

    def reset(self, device: torch.device) -> None:
        self.device, self.marks, self.device_peak = device, [], 0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        with contextlib.suppress(OSError):  # Linux: VmHWM := current RSS
            Path("/proc/self/clear_refs").write_text("5")

    def sample_device(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            self.device_peak = max(self.device_peak, total - free)

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
    CLOCK.sample_device()
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


def _host_rss() -> dict[str, int] | None:
    """The server's resident memory (Linux /proc), in bytes."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return None
    fields = {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in lines)
              if k in ("RssAnon", "RssFile", "VmHWM")}
    return {"anon_bytes": fields.get("RssAnon"), "file_bytes": fields.get("RssFile"),
            "peak_bytes": fields.get("VmHWM")}


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
        CLOCK.sample_device()
        figures = {
            "label": label,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if cuda else None,
            "call_s": calls,
            "span_s": CLOCK.span(),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
            "peak_device_used_bytes": CLOCK.device_peak if cuda else None,
            "host_rss": _host_rss(),
            "loaded_models": _loaded_models(),
        }
        return {"ui": {"bench": [figures]}}


NODE_CLASS_MAPPINGS = {"TieredBenchClock": TieredBenchClock, "TieredBenchReport": TieredBenchReport}
NODE_DISPLAY_NAME_MAPPINGS = {"TieredBenchClock": "Bench: clock model calls",
                              "TieredBenchReport": "Bench: report"}
