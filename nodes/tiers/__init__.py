"""The tier manager on ComfyUI's side: the Tiered loaders, the VRAM Tier Manager node, the backend
that moves a loader's models between tiers through core, the manager's models as ComfyUI objects,
and the preload at start-up.
May import: core, the engine (offload_core); no other node family."""
