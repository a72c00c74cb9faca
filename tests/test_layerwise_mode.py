"""Apply Layerwise Offload's `mode` input through a real server (both lanes).

Every model here is classic (on CPU `--cpu` turns Dynamic VRAM off; on CUDA the harness starts
ComfyUI 0.33 with `--disable-dynamic-vram`, see comfy_server.py), so both modes run the pack's
engine and must give core's own result. The Dynamic VRAM side is in test_dynamic_vram_compat.py
(against 0.33's classes on CPU) and test_dynamic_vram_gpu.py (CUDA).
"""
from __future__ import annotations

from comfy_server import comfy_version
from workflows import latent_sha, sample_workflow

STREAMED = {"resident_blocks": 1, "prefetch": 1}


def test_mode_is_an_optional_input_defaulting_to_auto(comfy):
    info = comfy.get("/object_info/ApplyLayerwiseOffload")["ApplyLayerwiseOffload"]
    spec = info["input"]["optional"]["mode"]   # a V3 combo
    assert spec[0] == "COMBO" and spec[1]["options"] == ["auto", "engine"] and spec[1]["default"] == "auto"
    assert "mode" not in info["input"]["required"]


def test_both_modes_stream_a_classic_model_bit_identically(comfy):
    baseline = latent_sha(comfy.run(sample_workflow("wan21")))
    for mode in ("auto", "engine"):
        wf = sample_workflow("wan21", layerwise=dict(STREAMED, mode=mode))
        assert latent_sha(comfy.run(wf)) == baseline, mode
        state = [m for m in comfy.get("/offload/layerwise")["models"] if m["model_class"] == "WanModel"][-1]
        # The engine ran (a classic model needs no copy, so there is no cost entry).
        assert state["telemetry"]["bytes_copied"] > 0 and state["streamed_indices"] == [0]
        assert state["dynamic_vram"] is None


def test_unknown_mode_is_refused_and_the_server_keeps_serving(comfy):
    """ComfyUI 0.33 checks a V3 combo's choices when the prompt is queued; 0.3.75 checks only a
    V1 node's, so there the node refuses it when it runs (the frontend offers only the choices;
    an API prompt with another gets a clear error either way)."""
    wf = sample_workflow("wan21", layerwise=dict(STREAMED, mode="fastest"))
    if comfy_version().startswith("0.3."):
        error = comfy.run_expect_error(wf)
        assert error["node_type"] == "ApplyLayerwiseOffload", error
        assert "mode must be one of auto, engine, got 'fastest'" in error["exception_message"], error
    else:
        assert "fastest" in comfy.refused(wf, "offload")
    assert latent_sha(comfy.run(sample_workflow("wan21"))) is not None
