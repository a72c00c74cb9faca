"""Model-Level Swap: the diffusion model and the text encoder take turns on the GPU (node.py).
May import: core, the engine (offload_core); no other node family."""
