"""The server side the Offload panel talks to: the REST routes and websocket events (routes.py) and
every model ComfyUI has loaded, with what the pack does to it (loaded_models.py).
May import: the node families (layerwise, swap, tiers), core, the engine (offload_core)."""
