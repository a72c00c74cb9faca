"""Thin ComfyUI adapters over offload_core."""
from .layerwise import ApplyLayerwiseOffload

NODE_CLASS_MAPPINGS = {
    "ApplyLayerwiseOffload": ApplyLayerwiseOffload,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "ApplyLayerwiseOffload": "Apply Layerwise Offload",
}
