"""The harness starts classic servers unless a test asks for Dynamic VRAM (comfy_server.py).

On CUDA, ComfyUI 0.33 loads every model with Dynamic VRAM unless told otherwise, and the suite's
tests are written against classic models; only the Dynamic VRAM tests may get core's default.
No GPU runs here, so CUDA is what the harness is told it has: the flag it picks is read from the
real trees' own command-line parsers.
"""
from __future__ import annotations

import pytest
import torch

import comfy_server
from comfy_server import REPO, ComfyServer, has_dynamic_vram_switch

TREE_0375 = REPO / ".comfyui"
TREE_033 = REPO / ".comfyui-033"


def _tree(path):
    if not (path / "comfy" / "cli_args.py").is_file():
        pytest.skip(f"no ComfyUI tree at {path}")
    return path


def test_only_a_tree_with_dynamic_vram_has_the_switch():
    assert has_dynamic_vram_switch(_tree(TREE_0375)) is False
    assert has_dynamic_vram_switch(_tree(TREE_033)) is True


@pytest.mark.parametrize("tree,cuda,dynamic_vram,expected", [
    (TREE_033, True, False, ("--disable-dynamic-vram",)),
    (TREE_033, True, True, ()),
    (TREE_033, False, False, ()),       # --cpu turns Dynamic VRAM off already
    (TREE_0375, True, False, ()),       # 0.3.75 has no Dynamic VRAM and would refuse the flag
])
def test_servers_are_classic_unless_they_ask_for_dynamic_vram(monkeypatch, tmp_path, tree, cuda,
                                                              dynamic_vram, expected):
    monkeypatch.setattr(comfy_server, "COMFY_ROOT", _tree(tree))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    server = ComfyServer(tmp_path / "base", dynamic_vram=dynamic_vram)
    assert server.classic_args() == expected
