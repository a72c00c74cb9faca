"""The disk tier: the engine's spill file, its RAM cache read ahead of need, and the slots fed from it.
May import: alignment, files, host, device, ordering, units."""
