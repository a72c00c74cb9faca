"""Quantized models through a real server: streamed, swapped and tiered, bit-identical to core.

Formats, each with quantized *block* layers and a LoRA on them:
- fp8 blocks in 0.3.75's mixed-precision format: 0.3.75 loads its in-tree QuantizedTensor, 0.33
  converts the metadata and loads comfy_kitchen's;
- 0.33 only: its native comfy_quant checkpoints in fp8, INT8 tensorwise, NVFP4 and MXFP8
  (comfy_kitchen's eager backend runs all four on a CPU);
- GGUF Q8_0, Q4_0 and Q4_K through ComfyUI-GGUF (the unmodified pack, from `make third-party`),
  whose LoRA stays on the weights' `patches` and is applied at dequantization.

Every comparison is against the same workflow without the pack's nodes on the same server (the
reference is core's full load), and the host pack must hold exactly the bytes the checkpoint
stores for the blocks: a quantized model packs at its quantized size.
"""
from __future__ import annotations

import os

import copy
import re
import subprocess
import sys

import pytest
from safetensors import safe_open

import quantized_models as qm
from comfy_server import COMFY_PYTHON, COMFY_ROOT, THIRD_PARTY, ComfyServer
from conftest import WAN_CLIP_LORA
from test_model_swap import with_text_encode
from workflows import LORA_FILE, latent_sha, sample_workflow

GGUF_NODES = THIRD_PARTY / "ComfyUI-GGUF"
FP8_BLOCKS = "tiny_wan21_fp8_blocks.safetensors"
PARTLY_FP8 = "tiny_wan21_partly_fp8.safetensors"
STREAMED = {"resident_blocks": 0, "prefetch": 1}
SETTINGS = [STREAMED, {"resident_blocks": 1, "prefetch": 1}]


def comfy_version() -> tuple[int, ...]:
    text = (COMFY_ROOT / "comfyui_version.py").read_text()
    return tuple(int(n) for n in re.search(r'__version__\s*=\s*"([\d.]+)"', text).group(1).split("."))


def _imports(python: str, module: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


ON_033 = comfy_version() >= (0, 33)
HAS_GGUF = GGUF_NODES.is_dir() and _imports(COMFY_PYTHON, "gguf") and _imports(sys.executable, "gguf")
only_033 = pytest.mark.skipif(not ON_033, reason="comfy_quant with comfy_kitchen layouts is ComfyUI 0.33's")
needs_gguf = pytest.mark.skipif(not HAS_GGUF, reason="needs the gguf package and ComfyUI-GGUF (make third-party)")


def gguf_name(qtype: str) -> str:
    return f"tiny_wan21_{qtype.lower()}.gguf"


def comfy_quant_name(fmt: str) -> str:
    return f"tiny_wan21_comfy_quant_{fmt}.safetensors"


@pytest.fixture(scope="module")
def qserver(comfy_base, tmp_path_factory):
    """A server with ComfyUI-GGUF linked in, over the session's models plus the quantized ones."""
    unets = comfy_base / "models" / "diffusion_models"
    if not (unets / FP8_BLOCKS).exists():
        qm.write_tiny_wan21_fp8_blocks(unets / FP8_BLOCKS)
    if not (unets / PARTLY_FP8).exists():
        qm.write_tiny_wan21_partly_fp8(unets / PARTLY_FP8)
    if HAS_GGUF:
        for qtype in qm.GGUF_TYPES:
            if not (unets / gguf_name(qtype)).exists():
                qm.write_tiny_wan21_gguf(unets / gguf_name(qtype), qtype)
    if ON_033:
        for fmt in qm.COMFY_QUANT_FORMATS:
            if not (unets / comfy_quant_name(fmt)).exists():
                qm.comfy_quant_checkpoint(unets / comfy_quant_name(fmt), fmt, COMFY_PYTHON, COMFY_ROOT)
    base = tmp_path_factory.mktemp("quantized")
    (base / "models").symlink_to(comfy_base / "models", target_is_directory=True)
    server = ComfyServer(base, extra_nodes={"ComfyUI-GGUF": GGUF_NODES} if HAS_GGUF else None).start()
    yield server
    server.stop()
    leaks = [line for line in server.log_text().splitlines() if "memory leak with model" in line]
    assert not leaks, leaks[:5]


def workflow(unet: str, *, lora: bool = False, layerwise: dict | None = None, loader: str = "UNETLoader",
             report: bool = False) -> dict:
    wf = sample_workflow("wan21", lora_strength=1.0 if lora else None, layerwise=layerwise)
    wf["load"] = {"class_type": loader, "inputs": {"unet_name": unet}}
    if loader != "UnetLoaderGGUF":
        wf["load"]["inputs"]["weight_dtype"] = "default"
    if report:
        wf["weights"] = {"class_type": "TieredTestWeightReport",
                         "inputs": {"model": wf["sample"]["inputs"]["model"], "samples": ["sample", 0]}}
    return wf


def wan_state(server) -> dict:
    models = [m for m in server.get("/offload/layerwise")["models"] if m["model_class"] == "WanModel"]
    assert models, server.get("/offload/layerwise")
    return models[-1]


def stored_block_bytes(unet: str, unets) -> int:
    """Bytes the checkpoint stores for the blocks' tensors (comfy_quant's JSON tensors excluded)."""
    path = unets / unet
    if path.suffix == ".gguf":
        import gguf
        return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if t.name.startswith("blocks."))
    total = 0
    with safe_open(path, "pt") as f:
        for key in f.keys():
            if key.startswith("blocks.") and not key.endswith(".comfy_quant"):
                t = f.get_tensor(key)
                total += t.numel() * t.element_size()
    return total


def check_streams_like_core(server, unet: str, loader: str = "UNETLoader") -> dict:
    """With and without the node, LoRA or not, streamed or with a resident block: the same bits.
    Returns the engine's report of the last offloaded run."""
    ref_plain = latent_sha(server.run(workflow(unet, loader=loader)))
    ref_lora = latent_sha(server.run(workflow(unet, lora=True, loader=loader)))
    assert ref_plain != ref_lora, "the LoRA must change the result"
    for settings in SETTINGS:
        assert latent_sha(server.run(workflow(unet, lora=True, layerwise=settings, loader=loader))) == ref_lora
        assert latent_sha(server.run(workflow(unet, layerwise=settings, loader=loader))) == ref_plain
    state = wan_state(server)
    assert latent_sha(server.run(workflow(unet, lora=True, loader=loader))) == ref_lora
    assert latent_sha(server.run(workflow(unet, loader=loader))) == ref_plain
    # Streamed with the LoRA once more: the kept pack is reused and the merge lands on each copy.
    assert latent_sha(server.run(workflow(unet, lora=True, layerwise=STREAMED, loader=loader))) == ref_lora
    return state


def check_packs_at_stored_size(server, state: dict, unet: str, comfy_base) -> None:
    stored = stored_block_bytes(unet, comfy_base / "models" / "diffusion_models")
    assert state["host"]["tensors"] == stored, (state["host"], stored)
    assert state["host"]["packed"] >= stored


def test_fp8_blocks_stream_like_cores_full_load_and_pack_at_fp8_size(qserver, comfy_base):
    state = check_streams_like_core(qserver, FP8_BLOCKS)
    check_packs_at_stored_size(qserver, state, FP8_BLOCKS, comfy_base)
    logical = 0
    with safe_open(comfy_base / "models" / "diffusion_models" / FP8_BLOCKS, "pt") as f:
        for key in f.keys():
            if key.startswith("blocks.") and key.endswith(".weight"):
                logical += f.get_tensor(key).numel() * 4  # the compute dtype here: float32
    assert state["host"]["tensors"] < logical, "the quantized weights packed at more than one byte each"


def test_fp8_blocks_under_model_level_swap_and_tiered_loader(qserver):
    wf = with_text_encode(workflow(FP8_BLOCKS), swap=False)
    wf["lora"] = {"class_type": "LoraLoader", "inputs": {
        "model": ["load", 0], "clip": ["clip", 0], "lora_name": WAN_CLIP_LORA,
        "strength_model": 1.0, "strength_clip": 1.0}}
    wf["sample"]["inputs"]["model"] = ["lora", 0]
    wf["encode"]["inputs"]["clip"] = ["lora", 1]
    reference = qserver.run(wf)
    swapped = copy.deepcopy(wf)
    swapped["swap"] = {"class_type": "ModelLevelSwap", "inputs": {"model": ["lora", 0], "clip": ["lora", 1]}}
    swapped["sample"]["inputs"]["model"] = ["swap", 0]
    swapped["encode"]["inputs"]["clip"] = ["swap", 1]
    for _ in range(2):
        got = qserver.run(swapped)
        assert latent_sha(got) == latent_sha(reference)
        assert got["encode_stats"] == reference["encode_stats"]
    members = {m["name"]: m for m in qserver.get("/offload/swap")["members"]}
    assert members["WAN21"]["bytes"]["master"] > 0, members
    assert latent_sha(qserver.run(wf)) == latent_sha(reference)

    tiered = copy.deepcopy(wf)
    tiered["load"]["class_type"] = "TieredUNETLoader"
    assert latent_sha(qserver.run(tiered)) == latent_sha(reference)
    found = {m["name"]: m for m in qserver.get("/offload/tiers")["models"]}
    key = found[FP8_BLOCKS]["id"]
    for action in ("park", "evict"):  # from RAM, then read from disk again
        status, body = qserver.request("POST", f"/offload/models/{key}/{action}")
        assert status == 200, body
        assert latent_sha(qserver.run(tiered)) == latent_sha(reference), action


def test_partly_quantized_model_under_model_level_swap(qserver):
    """A few fp8 layers among full-precision ones (one outside the blocks, one in each block), as
    converted checkpoints often are. The fp8 tensors and their 4-byte scales leave the file's
    other weights 4 bytes off a 16-byte boundary, and on a CPU core computes the one-row time
    embedding from the file's memory map, where that address decides the kernel's summation
    order (cfg 1: one row). Swapped, the master keeps those addresses; after the master is
    handed back (Apply Layerwise Offload retires it) the fresh copies keep them too."""
    def flow(lora: bool, swap: bool, layerwise: dict | None = None) -> dict:
        wf = with_text_encode(workflow(PARTLY_FP8, lora=lora, layerwise=layerwise), swap=swap,
                              model_node="lora" if lora else "load")
        wf["sample"]["inputs"]["cfg"] = 1.0
        return wf

    plain, lora = qserver.run(flow(False, False)), qserver.run(flow(True, False))  # core alone first
    assert latent_sha(plain) != latent_sha(lora)
    for _ in range(2):
        for use_lora, reference in ((False, plain), (True, lora)):
            got = qserver.run(flow(use_lora, True))
            assert latent_sha(got) == latent_sha(reference), f"swapped, lora={use_lora}"
            assert got["encode_stats"] == reference["encode_stats"]
    assert latent_sha(qserver.run(flow(False, False))) == latent_sha(plain)
    assert latent_sha(qserver.run(flow(False, False, layerwise=STREAMED))) == latent_sha(plain)
    assert latent_sha(qserver.run(flow(False, False))) == latent_sha(plain), "after the master went"


@needs_gguf
@pytest.mark.parametrize("qtype", qm.GGUF_TYPES)
def test_gguf_streams_with_its_lora_and_keeps_its_tensors(qserver, comfy_base, qtype):
    """Quantized types: the LoRA stays on the weights' patches. F16: ComfyUI-GGUF merges it
    itself (fp32, rounding seeded 0), and so does the transform."""
    unet = gguf_name(qtype)
    state = check_streams_like_core(qserver, unet, loader="UnetLoaderGGUF")
    check_packs_at_stored_size(qserver, state, unet, comfy_base)
    if qtype == "F16":
        return
    core = qserver.run(workflow(unet, lora=True, loader="UnetLoaderGGUF", report=True))
    ours = qserver.run(workflow(unet, lora=True, layerwise=STREAMED, loader="UnetLoaderGGUF", report=True))
    assert latent_sha(ours) == latent_sha(core)
    core_w, ours_w = core["weights"]["weights"][0], ours["weights"]["weights"][0]
    quantized = [n for n, w in core_w.items() if w["tensor_type"] == qtype]
    assert quantized and all(core_w[n]["class"] == "GGMLTensor" for n in quantized), core_w
    # Core's load hung the LoRA on the weights it patches; the engine hands them back unpatched
    # (as GGUF's own unpatch does), with class, storage and GGUF attributes unchanged.
    assert any(core_w[n]["patches"] for n in quantized)
    assert not any(w["patches"] for w in ours_w.values())
    strip = {n: {k: v for k, v in w.items() if k != "patches"} for n, w in core_w.items()}
    assert {n: {k: v for k, v in w.items() if k != "patches"} for n, w in ours_w.items()} == strip


@needs_gguf
def test_gguf_under_model_level_swap(qserver):
    unet = gguf_name("Q8_0")
    wf = with_text_encode(workflow(unet, lora=True, loader="UnetLoaderGGUF"), swap=False)
    reference = qserver.run(wf)
    swapped = with_text_encode(workflow(unet, lora=True, loader="UnetLoaderGGUF"), swap=True, model_node="lora")
    for _ in range(2):
        got = qserver.run(swapped)
        assert latent_sha(got) == latent_sha(reference)
        assert got["encode_stats"] == reference["encode_stats"]
    assert latent_sha(qserver.run(wf)) == latent_sha(reference)


@only_033
@pytest.mark.parametrize("fmt", qm.COMFY_QUANT_FORMATS)
def test_comfy_quant_formats_stream_like_cores_full_load(qserver, comfy_base, fmt):
    unet = comfy_quant_name(fmt)
    state = check_streams_like_core(qserver, unet)
    check_packs_at_stored_size(qserver, state, unet, comfy_base)


@only_033
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "nvfp4"])
def test_comfy_quant_under_model_level_swap(qserver, fmt):
    unet = comfy_quant_name(fmt)
    reference = qserver.run(with_text_encode(workflow(unet, lora=True), swap=False))
    swapped = with_text_encode(workflow(unet, lora=True), swap=True, model_node="lora")
    for _ in range(2):
        assert latent_sha(qserver.run(swapped)) == latent_sha(reference)



KIB = 1 << 10


def disk_cases() -> list:
    """(model, loader, host cache): each cache holds the 4 phase units streaming needs at once,
    and less than the model's blocks, so they are read from disk."""
    cases = [pytest.param(FP8_BLOCKS, "UNETLoader", 320 * KIB, id="fp8_blocks")]
    if HAS_GGUF:
        cases.append(pytest.param(gguf_name("Q8_0"), "UnetLoaderGGUF", 320 * KIB, id="gguf_q8_0"))
    if ON_033:
        cases.append(pytest.param(comfy_quant_name("nvfp4"), "UNETLoader", 192 * KIB, id="comfy_quant_nvfp4"))
    return cases


@pytest.mark.parametrize("unet,loader,cache", disk_cases())
def test_quantized_blocks_streamed_from_disk_as_phases(qserver, unet, loader, cache):
    """Disk streaming and phase units carry quantized weights too (their inner tensors are read
    from the file or a spill), with and without a LoRA."""
    disk = {"resident_blocks": 0, "vram_budget_gb": 0.0, "host_cache_gb": cache / (1 << 30),
            "granularity": "phase"}
    ref_plain = latent_sha(qserver.run(workflow(unet, loader=loader)))
    ref_lora = latent_sha(qserver.run(workflow(unet, lora=True, loader=loader)))
    for lora, ref in ((False, ref_plain), (True, ref_lora), (False, ref_plain)):
        assert latent_sha(qserver.run(workflow(unet, lora=lora, layerwise=disk, loader=loader))) == ref
    state = wan_state(qserver)
    assert state["disk"]["active"] and state["granularity"] == "phase", state["disk"]
    assert state["telemetry"]["disk_reads"] > 0, state["telemetry"]
    sources = [s for s in state["disk"]["unit_sources"] if s]
    assert len(sources) == state["disk"]["file_units"] + state["disk"]["spill_units"], state["disk"]
    if loader == "UnetLoaderGGUF":  # the loaded tensors are the GGUF file's raw bytes: read in place
        assert state["disk"]["spill_units"] == 0 and state["disk"]["spill_written_bytes"] == 0, state["disk"]
        assert [os.path.basename(p) for p in state["disk"]["model_files"]] == [unet], state["disk"]
        assert set(sources) == {"file"}, state["disk"]
    print(f"{unet}: {state['disk']['file_units']} units read in place, {state['disk']['spill_units']} "
          f"spilled ({state['disk']['spill_reasons']})")
    assert latent_sha(qserver.run(workflow(unet, lora=True, loader=loader))) == ref_lora


def test_fp8_blocks_after_a_free_take_a_lora_in_the_tier_manager(qserver):
    """Found by the differential test (seed 61, 0.3.75): the fp8 model streamed with all blocks
    resident under the tier manager, then `/free` (which core's prompt worker runs outside
    inference mode), then the same loaded model with a LoRA under a tier budget it cannot meet:
    core's LoRA loader reads the model's state_dict inside inference mode, and every quantized
    parameter must still be readable there."""
    def chain(offload: bool, lora: float, budget: float, disk: bool, loader: str) -> dict:
        wf = workflow(FP8_BLOCKS, loader=loader)
        model = ["load", 0]
        if offload:
            wf["offload"] = {"class_type": "ApplyLayerwiseOffload", "inputs": {
                "model": model, "resident_blocks": -1, "vram_budget_gb": 0.0, "prefetch": 16, "pin": False}}
            model = ["offload", 0]
        if loader == "TieredUNETLoader":
            wf["tiers"] = {"class_type": "VRAMTierManager", "inputs": {
                "model": model, "ram_budget_gb": budget, "ram_reserve_gb": 0.0, "vram_reserve_gb": 0.0,
                "disk_tier": disk, "keep_in_ram": False, "priority": 0}}
            model = ["tiers", 0]
        wf["lora"] = {"class_type": "LoraLoaderModelOnly", "inputs": {
            "model": model, "lora_name": LORA_FILE, "strength_model": lora}}
        model = ["lora", 0]
        wf["sample"]["inputs"]["model"] = model
        return wf

    first = latent_sha(qserver.run(chain(False, 0.0, 0, False, "UNETLoader")))
    second = latent_sha(qserver.run(chain(False, -0.7, 0, False, "UNETLoader")))
    assert latent_sha(qserver.run(chain(True, 0.0, 0.5, True, "TieredUNETLoader"))) == first
    qserver.free()
    assert latent_sha(qserver.run(chain(False, -0.7, 0.001, False, "TieredUNETLoader"))) == second


@needs_gguf
def test_a_gguf_streamed_from_ram_first_is_then_read_in_place_from_disk(qserver):
    """A run from RAM moves the GGUF blocks out of ComfyUI-GGUF's map of the file; the file the
    model was mapped from is recorded at its load, so the next run from disk still reads every
    unit in place: nothing spilled, nothing written, the same latents as core's."""
    unet = gguf_name("Q8_0")  # its phases outgrow the cache (as in disk_cases)
    reference = latent_sha(qserver.run(workflow(unet, loader="UnetLoaderGGUF")))
    ram = {"resident_blocks": 0, "vram_budget_gb": 0.0, "granularity": "phase"}
    assert latent_sha(qserver.run(workflow(unet, layerwise=ram, loader="UnetLoaderGGUF"))) == reference
    disk = dict(ram, host_cache_gb=320 * KIB / (1 << 30))
    assert latent_sha(qserver.run(workflow(unet, layerwise=disk, loader="UnetLoaderGGUF"))) == reference
    state = wan_state(qserver)
    assert state["disk"]["active"] and state["telemetry"]["disk_reads"] > 0, state["disk"]
    assert state["disk"]["spill_units"] == 0 and state["disk"]["spill_written_bytes"] == 0, state["disk"]
    assert [os.path.basename(p) for p in state["disk"]["model_files"]] == [unet], state["disk"]
