"""find_blocks on ComfyUI 0.3.75's real diffusion model classes, built on the meta device.

ComfyUI runs in a subprocess (tests/fixtures/discover_comfy_models.py) so none of its global state (cli args,
model_management, logging) leaks into this pytest process. That script builds each model the way UNETLoader does
from a detected unet_config (model_detection.model_config_from_unet_config -> model_config.get_model), with the
released checkpoints' sizes, on "meta", and reports what find_blocks returns. It then runs one meta forward pass of
the same class with fewer blocks, with a forward pre-hook on every returned block: the order those hooks fire in is
the model's own run order as the layerwise engine's hooks (offload_core/device/hooks.py) see it.

Per model this asserts: the class ComfyUI builds, the layout name, the number of blocks, the exact paths in run order
(all double then all single; Wan VACE interleaved by vace_layers_mapping; UNet input -> middle -> output), that every
returned block *is* the submodule at its path, and that a real forward calls the returned blocks in that order.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.nn as nn

from comfy_server import run_tree_script
from offload_core.blocks.discovery import LAYOUTS, UnsupportedModelError, find_blocks

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "fixtures" / "discover_comfy_models.py"

UNET_ATTRS = ("input_blocks", "middle_block", "output_blocks")


@dataclass(frozen=True)
class Group:
    attr: str
    n: int | None  # None: a single module (the UNet's middle_block), not a list
    block_class: str = ""
    key: str = "{}"  # how item i is named: ModuleList index, or "block{}" for Cosmos v1's ModuleDict


@dataclass(frozen=True)
class Case:
    supported_model: str  # comfy.supported_models class that matches the detected unet_config
    model_base: str  # comfy.model_base class that get_model returns
    diffusion_model: str  # the class find_blocks is given (model.diffusion_model)
    groups: tuple[Group, ...]  # block lists in run order, realistic sizes
    small: tuple[int | None, ...]  # list lengths of the smaller build used for the forward pass
    params_b: float | None  # published size in billions of parameters (configs are the real ones)

    @property
    def attrs(self) -> tuple[str, ...]:
        return tuple(g.attr for g in self.groups)

    @property
    def unet(self) -> bool:
        return self.attrs == UNET_ATTRS


def _dd(d, s, cls_d="DoubleStreamBlock", cls_s="SingleStreamBlock"):
    return (Group("double_blocks", d, cls_d), Group("single_blocks", s, cls_s))


FLUX = "comfy.ldm.flux.model.Flux"
HUNYUAN = "comfy.ldm.hunyuan_video.model.HunyuanVideo"
WAN = "comfy.ldm.wan.model.WanModel"
NEXTDIT = "comfy.ldm.lumina.model.NextDiT"
UNET = "comfy.ldm.modules.diffusionmodules.openaimodel.UNetModel"
TSEQ = "TimestepEmbedSequential"

CASES: dict[str, Case] = {
    "flux_dev": Case("Flux", "Flux", FLUX, _dd(19, 38), (2, 3), 12.0),
    "flux2_dev": Case("Flux2", "Flux2", FLUX, _dd(8, 48), (2, 3), 32.0),
    "chroma": Case("Chroma", "Chroma", "comfy.ldm.chroma.model.Chroma", _dd(19, 38), (2, 3), 8.9),
    "hunyuan_video": Case("HunyuanVideo", "HunyuanVideo", HUNYUAN, _dd(20, 40), (2, 3), 13.0),
    "hunyuan_image_21": Case("HunyuanImage21", "HunyuanImage21", HUNYUAN, _dd(20, 40), (2, 3), 17.0),
    "wan21_t2v_14b": Case("WAN21_T2V", "WAN21", WAN, (Group("blocks", 40, "WanAttentionBlock"),), (3,), 14.0),
    "wan22_ti2v_5b": Case("WAN22_T2V", "WAN22", WAN, (Group("blocks", 30, "WanAttentionBlock"),), (3,), 5.0),
    "wan21_vace_14b": Case("WAN21_Vace", "WAN21_Vace", "comfy.ldm.wan.model.VaceWanModel",
                           (Group("blocks", 40, "WanAttentionBlock"), Group("vace_blocks", 8, "VaceWanAttentionBlock")),
                           (8, 4), None),
    "ltxv_2b": Case("LTXV", "LTXV", "comfy.ldm.lightricks.model.LTXVModel",
                    (Group("transformer_blocks", 28, "BasicTransformerBlock"),), (3,), 2.0),
    "qwen_image": Case("QwenImage", "QwenImage", "comfy.ldm.qwen_image.model.QwenImageTransformer2DModel",
                       (Group("transformer_blocks", 60, "QwenImageTransformerBlock"),), (3,), 20.0),
    "sd3_medium": Case("SD3", "SD3", "comfy.ldm.modules.diffusionmodules.mmdit.OpenAISignatureMMDITWrapper",
                       (Group("joint_blocks", 24, "JointBlock"),), (3,), 2.0),
    "hidream_i1": Case("HiDream", "HiDream", "comfy.ldm.hidream.model.HiDreamImageTransformer2DModel",
                       (Group("double_stream_blocks", 16, "HiDreamImageBlock"),
                        Group("single_stream_blocks", 32, "HiDreamImageBlock")), (2, 3), 17.0),
    "lumina2": Case("Lumina2", "Lumina2", NEXTDIT, (Group("layers", 26, "JointTransformerBlock"),), (3,), 2.6),
    "z_image": Case("ZImage", "Lumina2", NEXTDIT, (Group("layers", 30, "JointTransformerBlock"),), (3,), 6.0),
    "cosmos_predict2_2b": Case("CosmosT2IPredict2", "CosmosPredict2", "comfy.ldm.cosmos.predict2.MiniTrainDIT",
                               (Group("blocks", 28, "Block"),), (3,), 2.0),
    "cosmos_v1_7b": Case("CosmosT2V", "CosmosVideo", "comfy.ldm.cosmos.model.GeneralDIT",
                         (Group("blocks", 28, "GeneralDITTransformerBlock", key="block{}"),), (3,), 7.0),
    "sd15": Case("SD15", "BaseModel", UNET,
                 (Group("input_blocks", 12, TSEQ), Group("middle_block", None, TSEQ), Group("output_blocks", 12, TSEQ)),
                 (12, None, 12), 0.86),
    "sdxl": Case("SDXL", "SDXL", UNET,
                 (Group("input_blocks", 9, TSEQ), Group("middle_block", None, TSEQ), Group("output_blocks", 9, TSEQ)),
                 (9, None, 9), 2.6),
}



def _layout_name(attrs: tuple[str, ...]) -> str:
    names = [name for name, layout_attrs in LAYOUTS if layout_attrs == attrs]
    assert names, f"discovery.LAYOUTS has no layout for {attrs}"
    return names[0]


def _paths(groups: tuple[Group, ...], sizes: tuple[int | None, ...]) -> list[str]:
    out: list[str] = []
    for g, n in zip(groups, sizes):
        out += [g.attr] if n is None else [f"{g.attr}.{g.key.format(i)}" for i in range(n)]
    return out


def _vace_paths(n_main: int, mapping: dict[int, int]) -> list[str]:
    """VaceWanModel.forward_orig: after main block i it runs vace_blocks[vace_layers_mapping[i]]."""
    out: list[str] = []
    for i in range(n_main):
        out.append(f"blocks.{i}")
        if i in mapping:
            out.append(f"vace_blocks.{mapping[i]}")
    return out


def _expected(name: str, small: bool, reported_mapping=None) -> list[str]:
    case = CASES[name]
    sizes = case.small if small else tuple(g.n for g in case.groups)
    if name == "wan21_vace_14b":
        mapping = {i: n for i, n in reported_mapping}
        return _vace_paths(sizes[0], mapping)
    return _paths(case.groups, sizes)


def _unet_groups(paths: list[str]) -> list[str]:
    """UNet paths reduced to their block (input_blocks.N / middle_block / output_blocks.N), runs collapsed.

    So the UNet assertions hold whether discovery returns the blocks themselves or their layers in order."""
    groups: list[str] = []
    for p in paths:
        parts = p.split(".")
        g = "middle_block" if parts[0] == "middle_block" else ".".join(parts[:2])
        if not groups or groups[-1] != g:
            groups.append(g)
    return groups


@pytest.fixture(scope="module")
def comfy_models(tmp_path_factory) -> dict:
    return run_tree_script(SCRIPT, tmp_path_factory.mktemp("discovery") / "results.json", threads=2, timeout=300)


def _case(results: dict, name: str) -> dict:
    res = results["cases"][name]
    assert res["error"] is None, f"{name} (ComfyUI {results['comfyui_version']}):\n{res['error']}"
    return res


@pytest.mark.parametrize("name", CASES)
def test_builds_the_real_comfy_class(comfy_models, name):
    case, res = CASES[name], _case(comfy_models, name)
    assert (res["supported_model"], res["model_base"], res["diffusion_model"]) == \
        (case.supported_model, case.model_base, case.diffusion_model)
    assert res["all_meta"], "a parameter or buffer was allocated off the meta device"
    if case.params_b is not None:  # the configs are the released ones, so the size is the published one
        assert res["n_params"] == pytest.approx(case.params_b * 1e9, rel=0.1)


@pytest.mark.parametrize("name", CASES)
def test_find_blocks_layout_count_order_identity(comfy_models, name):
    case, res = CASES[name], _case(comfy_models, name)
    assert res["layout"] == _layout_name(case.attrs)
    assert res["attr_lens"] == {g.attr: g.n for g in case.groups if g.n is not None}
    # the returned objects are the model's own submodules, each found at the path reported for it
    assert res["identity"] == res["paths"]
    assert all(res["get_submodule_same"])
    if case.unet:
        assert res["middle_block"] == TSEQ
        assert _unet_groups(res["paths"]) == _expected(name, small=False)  # input 0..N, middle, output 0..M
        assert res["unet_params_covered"], "UNet parameters outside the returned blocks"
        assert res["n_blocks"] == len(res["paths"])
        return
    expected = _expected(name, small=False, reported_mapping=res["vace_layers_mapping"])
    assert res["n_blocks"] == len(expected) == sum(g.n for g in case.groups)
    assert res["paths"] == expected
    # double (or main) blocks are the double-block class, single blocks the single-block class
    for path, block_type in zip(res["paths"], res["block_types"]):
        group = next(g for g in case.groups if path.split(".")[0] == g.attr)
        assert block_type == group.block_class, path


def test_wan_vace_order_is_vace_layers_mapping(comfy_models):
    """Wan VACE 14B: 40 blocks, 8 vace blocks, vace_layers_mapping {0: 0, 5: 1, ..., 35: 7}."""
    res = _case(comfy_models, "wan21_vace_14b")
    assert res["vace_layers_mapping"] == [[5 * j, j] for j in range(8)]
    paths = res["paths"]
    for j in range(8):
        assert paths.index(f"vace_blocks.{j}") == paths.index(f"blocks.{5 * j}") + 1
    assert paths[:8] == ["blocks.0", "vace_blocks.0", "blocks.1", "blocks.2", "blocks.3", "blocks.4", "blocks.5",
                         "vace_blocks.1"]
    assert paths[-6:] == ["blocks.35", "vace_blocks.7", "blocks.36", "blocks.37", "blocks.38", "blocks.39"]
    # The forward pass of the small build (8 blocks, 4 vace blocks) ran them in exactly this interleaving.
    fwd = res["forward"]
    assert fwd["vace_layers_mapping"] == [[0, 0], [2, 1], [4, 2], [6, 3]]
    assert fwd["paths"] == ["blocks.0", "vace_blocks.0", "blocks.1", "blocks.2", "vace_blocks.1", "blocks.3",
                            "blocks.4", "vace_blocks.2", "blocks.5", "blocks.6", "vace_blocks.3", "blocks.7"]
    assert fwd["calls"] == list(range(12))


@pytest.mark.parametrize("name", CASES)
def test_forward_calls_returned_blocks_in_returned_order(comfy_models, name):
    """One real forward (meta tensors): a pre-hook on each returned block fires once per block, in path order."""
    case, res = CASES[name], _case(comfy_models, name)
    fwd = res["forward"]
    assert fwd["layout"] == _layout_name(case.attrs)
    expected = _expected(name, small=True, reported_mapping=fwd["vace_layers_mapping"])
    assert (_unet_groups(fwd["paths"]) if case.unet else fwd["paths"]) == expected
    assert fwd["calls"] == list(range(len(fwd["paths"])))


@pytest.mark.parametrize("name", CASES)
def test_forward_runs_block_compute_in_returned_order(comfy_models, name):
    """Seen through every module inside the blocks: block i's compute runs once, whole, before block i+1's.

    For the UNet this is the proof of input -> middle -> output, since its block modules are never called."""
    case, res = CASES[name], _case(comfy_models, name)
    fwd = res["forward"]
    expected = _expected(name, small=True, reported_mapping=fwd["vace_layers_mapping"])
    assert (_unet_groups(fwd["paths"]) if case.unet else fwd["paths"]) == expected
    assert fwd["block_runs"] == list(range(len(fwd["paths"])))


def test_unet_without_middle_block_streams_input_and_output_blocks(comfy_models):
    res = _case(comfy_models, "sdxl_no_middle")
    assert res["middle_block"] == "NoneType"
    assert res["layout"] == _layout_name(UNET_ATTRS)
    assert res["unet_params_covered"]


def test_real_comfy_module_without_block_list_raises(comfy_models):
    res = comfy_models["unsupported"]
    assert res["raised"] == "UnsupportedModelError" and res["is_unsupported_error"]
    assert res["message"].startswith("MLPEmbedder ")


def test_module_without_block_list_raises_naming_the_class():
    class NoBlockList(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj_in = nn.Linear(8, 8)
            self.proj_out = nn.Linear(8, 8)

    with pytest.raises(UnsupportedModelError, match=r"^NoBlockList has no block list"):
        find_blocks(NoBlockList())
