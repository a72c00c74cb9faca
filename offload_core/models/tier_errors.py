"""The tier manager's refusals. Each subclass maps to one HTTP status in the REST layer, so a caller
can tell a bad file from a full machine from a model in use."""
from __future__ import annotations


class TierError(RuntimeError):
    """Base of the manager's refusals; each subclass maps to one HTTP status in the REST layer."""


class UnknownModelError(TierError, LookupError):
    """No model is registered under that id (404)."""


class ModelInUseError(TierError):
    """The model is acquired by a running job, so it must not move (409)."""


class ModelPinnedError(TierError):
    """The model is pinned, so it must not be dropped to disk (409)."""


class TierCapacityError(TierError):
    """The model cannot fit: what would have to move is in use or pinned, or it is too large."""


class SourceGoneError(TierError):
    """The model's source file is gone, so it cannot be loaded from disk (REST: 404)."""


class SourceChangedError(TierError):
    """The source file changed since this id was registered, or a newer id superseded it (409).

    Loading it would put new bytes under the old identity, so it is refused and the stale
    entry is forgotten; the model's loader registers the file again under its new id.
    """


class SourceUnreadableError(TierError):
    """The source file exists but is not a model the backend can read (corrupt, wrong kind) (422)."""
