"""Reading a model: its repeated blocks in run order, and each block's phases.
May import: host (a block's tensors as the packing sees them), ordering."""
