"""The machine's one host copy of a model's packs, shared by its processes: the store file, its
folder and locks, its key, the views processes map, packing into it. May import: host, units."""
