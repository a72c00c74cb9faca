"""The device tier: which blocks stay resident, device slots fed from host packs, block hooks, counters.
May import: host, ordering, units."""
