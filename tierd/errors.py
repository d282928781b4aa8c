"""The one exception hierarchy of tierd.

Every error a user can cause or meet derives from `TierdError`; each message says what was
wrong and what to do about it. Nothing here may carry state beyond the message and a stable
`code` (the daemon sends `code` over the wire).
"""

from __future__ import annotations


class TierdError(Exception):
    """Base of all tierd errors."""

    code = "internal"


class ConfigError(TierdError, ValueError):
    """A setting is missing, malformed or unsafe."""

    code = "bad_config"


class NamespaceError(TierdError, ValueError):
    """A namespace description is invalid (bad shape, dtype, model directory)."""

    code = "bad_namespace"


class UnknownNamespaceError(TierdError, KeyError):
    """An operation named a namespace the store does not know."""

    code = "unknown_namespace"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown namespace"


class BlockError(TierdError, ValueError):
    """A block does not match its namespace (byte size, dtype, count of keys)."""

    code = "bad_block"


class KeyFormatError(TierdError, ValueError):
    """A key is not 16 bytes, or token ids are out of range."""

    code = "bad_key"


class CapacityError(TierdError, ValueError):
    """A tier is too small for what was asked (e.g. smaller than one block)."""

    code = "capacity"


class DiskTierError(TierdError, OSError):
    """The disk tier cannot be opened or used."""

    code = "disk"


class DiskDegradedError(DiskTierError):
    """The disk tier is failing (I/O errors, no space, gone): blocks are served from RAM only
    and a sync cannot make them durable."""
    code = "disk_degraded"


class NotASlabFileError(DiskTierError):
    """A file in the disk directory is not a tierd slab file (or of an unknown version)."""

    code = "not_a_slab_file"


class DirectoryLockedError(DiskTierError):
    """Another store holds the disk directory."""

    code = "locked"


class LeaseError(TierdError, ValueError):
    """A lease or reservation is unknown, already released, or not the caller's."""

    code = "bad_lease"


class StoreClosedError(TierdError, RuntimeError):
    """The store was closed."""

    code = "closed"


class InstanceLockedError(TierdError, RuntimeError):
    """Another daemon holds the instance lock of this socket (and so its arena and index)."""

    code = "locked"


class NamespaceLimitError(TierdError):
    """The daemon refused a new namespace: this uid registered as many as it may, and none of
    them is unused. A refused namespace is a miss for that request, not a failed daemon."""

    code = "namespace_limit"


class ForbiddenError(TierdError, PermissionError):
    """The daemon refused an operator action (flush) to a peer that is not an operator."""

    code = "forbidden"


class RequestTooLargeError(TierdError):
    """A request is over a limit the daemon's `hello` reply gave (`max_frame_bytes`,
    `max_keys_per_request`): the client refuses it before sending, and nothing changes."""

    code = "frame_too_large"
