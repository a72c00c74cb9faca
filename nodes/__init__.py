"""Thin ComfyUI adapters over offload_core."""
from . import tiers
from .core_pins import install as share_pinned_budget_with_core
from .layerwise import ApplyLayerwiseOffload
from .swap import ModelLevelSwap

share_pinned_budget_with_core()

NODE_CLASS_MAPPINGS = {
    "ApplyLayerwiseOffload": ApplyLayerwiseOffload,
    "ModelLevelSwap": ModelLevelSwap,
    **tiers.NODE_CLASS_MAPPINGS,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "ApplyLayerwiseOffload": "Apply Layerwise Offload",
    "ModelLevelSwap": "Model-Level Swap",
    **tiers.NODE_DISPLAY_NAME_MAPPINGS,
}
