"""Whole models: one module's pinned master (swap), and the VRAM / RAM / disk tiers of many models.
May import: files, host, ordering, sharing, units."""
