"""The host tier: weights packed into contiguous host buffers, pinned where the budget allows.
May import: alignment, ordering, units (and nothing else of the engine)."""
