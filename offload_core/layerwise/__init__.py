"""The layerwise streamer: a model's blocks run with only some of them on the device.
May import: alignment, blocks, device, disk, host, ordering, sharing, units (it is the one room
that joins the tiers)."""
