"""Block-list discovery on real torch modules shaped like ComfyUI's model classes."""
import pytest
import torch.nn as nn

from offload_core.blocks.discovery import UnsupportedModelError, find_blocks


def _blocks(n, width=4):
    return nn.ModuleList([nn.Linear(width, width) for _ in range(n)])


class FluxLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.img_in = nn.Linear(4, 4)
        self.double_blocks = _blocks(3)
        self.single_blocks = _blocks(2)


class WanVace(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = _blocks(4)
        self.vace_blocks = _blocks(2)
        self.vace_layers_mapping = {0: 0, 2: 1}


class UNetLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_blocks = _blocks(2)
        self.middle_block = nn.Sequential(nn.Linear(4, 4))
        self.output_blocks = _blocks(2)


class Generic(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.stack = _blocks(5, width=8)


class Unsupported(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.small = _blocks(2)


def test_double_then_single_blocks_in_run_order():
    m = FluxLike()
    found = find_blocks(m)
    assert found.paths == ("double_blocks.0", "double_blocks.1", "double_blocks.2",
                           "single_blocks.0", "single_blocks.1")
    assert found.blocks[3] is m.single_blocks[0]


def test_wan_vace_blocks_follow_their_mapped_block():
    m = WanVace()
    assert find_blocks(m).paths == ("blocks.0", "vace_blocks.0", "blocks.1", "blocks.2",
                                    "vace_blocks.1", "blocks.3")


def test_unet_runs_input_middle_output():
    found = find_blocks(UNetLike())
    assert found.paths == ("input_blocks.0", "input_blocks.1", "middle_block.0",
                           "output_blocks.0", "output_blocks.1")


def test_generic_fallback_takes_the_dominant_module_list():
    found = find_blocks(Generic())
    assert found.paths == tuple(f"stack.{i}" for i in range(5))
    assert found.layout.startswith("generic")


def test_unsupported_model_names_its_class_and_the_layouts():
    with pytest.raises(UnsupportedModelError) as err:
        find_blocks(Unsupported())
    message = str(err.value)
    assert "Unsupported" in message and "joint_blocks" in message and "double_blocks" in message


@pytest.mark.parametrize("model", [FluxLike, Generic])
def test_blocks_wrapped_by_torch_compile_are_found_as_themselves(model):
    """Per-block compile nodes put torch.compile's wrapper into the block list (ComfyUI keeps
    object patches applied between prompts), and a whole-model compile may be patched in for
    the model: the engine must hook and pack the blocks themselves, under their own paths."""
    import torch
    m = model()
    plain = find_blocks(m)
    lists = [getattr(m, name) for name in ("double_blocks", "single_blocks", "stack") if hasattr(m, name)]
    for blocks in lists:
        for i, block in enumerate(blocks):
            blocks[i] = torch.compile(block)  # lazy: nothing compiles until it is called
    for wrapped in (find_blocks(m), find_blocks(torch.compile(m))):
        assert wrapped.paths == plain.paths and wrapped.layout == plain.layout
        assert all(a is b for a, b in zip(wrapped.blocks, plain.blocks))
