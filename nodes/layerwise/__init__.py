"""Apply Layerwise Offload: the node (node.py) with its settings and its session on a classic
patcher, the device budget it streams in, the spill folder, torch.compile's rules and LoRA merged
with core's arithmetic, and its cooperation with Dynamic VRAM (core streams in the node's order,
or the engine streams a classic twin).
May import: core, the engine (offload_core); no other node family."""
