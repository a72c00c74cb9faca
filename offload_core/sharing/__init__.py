"""The machine's one host copy of a model's packs, shared by its processes: the store file, its
folder and locks, its key, the views processes map, packing into it. May import: host, units."""

# The room's one fork handler and one exit handler (shared_store.py) are registered with the room
# itself, so that no use of a store or of its folder's locks can run without them.
from . import shared_store  # noqa: E402,F401
