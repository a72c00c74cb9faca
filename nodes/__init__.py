"""Thin ComfyUI adapters over offload_core."""
from . import tiers
from .layerwise import ApplyLayerwiseOffload

NODE_CLASS_MAPPINGS = {
    "ApplyLayerwiseOffload": ApplyLayerwiseOffload,
    **tiers.NODE_CLASS_MAPPINGS,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "ApplyLayerwiseOffload": "Apply Layerwise Offload",
    **tiers.NODE_DISPLAY_NAME_MAPPINGS,
}
