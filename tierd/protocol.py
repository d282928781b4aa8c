"""The control protocol between the daemon and its clients: framing, limits, error codes.

A frame is a 4-byte big-endian length N followed by N bytes of msgpack: a map. Requests are
`{id, op, ...}`; replies `{id, ok: true, ...}` or `{id, error: {code, message}}`. No block data
ever crosses the socket: slots are named by their offset in the shared host arena. This module
only encodes, decodes and validates; it never touches a store or a socket. docs/protocol.md is
its description for humans.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from .errors import TierdError
from .keys import checksums_ok, well_formed

PROTOCOL_VERSION = 1
HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME_BYTES = 1 << 20
DEFAULT_MAX_KEYS = 4096

OPS = ("hello", "register", "lookup", "lookup_all", "where", "reserve", "commit", "abort", "acquire", "release",
       "stage", "put", "hits", "flush", "sync", "stats", "ping", "costs")

# reserve slot status codes
SLOT_RESERVED, SLOT_PRESENT, SLOT_FULL = 0, 1, 2
SLOT_STATUS = {"reserved": SLOT_RESERVED, "present": SLOT_PRESENT, "full": SLOT_FULL}
SLOT_STATUS_NAMES = {v: k for k, v in SLOT_STATUS.items()}


class ProtocolError(TierdError):
    """A frame or a request is malformed (the daemon replies with code `bad_request`)."""

    code = "bad_request"


class FrameTooLarge(ProtocolError):
    code = "frame_too_large"


class RemoteError(TierdError):
    """An error reply from the daemon, re-raised in the client with the daemon's code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def encode(msg: dict[str, Any]) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> dict[str, Any]:
    """A request or reply map from a frame body; ProtocolError if it is not one."""
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=len(body),
                              max_str_len=len(body), max_array_len=len(body), max_map_len=len(body))
    except Exception as e:  # msgpack raises several unrelated classes
        raise ProtocolError(f"frame is not valid msgpack: {type(e).__name__}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("frame is not a msgpack map")
    return msg


def frame_length(header: bytes, max_frame_bytes: int) -> int:
    (n,) = HEADER.unpack(header)
    if n > max_frame_bytes:
        raise FrameTooLarge(f"frame of {n} bytes exceeds the limit of {max_frame_bytes}")
    return n


def error_reply(req_id, code: str, message: str) -> dict[str, Any]:
    return {"id": req_id, "error": {"code": code, "message": message}}


# -- field validation (server side) -----------------------------------------------------------

def field(msg: dict, name: str, kind: type | tuple, *, default=..., what: str | None = None):
    v = msg.get(name, default)
    if v is ...:
        raise ProtocolError(f"request lacks field {name!r}")
    if v is None and default is None:
        return None
    if not isinstance(v, kind) or isinstance(v, bool) and kind is int:
        raise ProtocolError(f"field {name!r} must be {what or getattr(kind, '__name__', kind)}")
    return v


def keys_field(msg: dict, max_keys: int, name: str = "keys") -> list[bytes]:
    keys = field(msg, name, list, what="a list of 16-byte keys")
    if len(keys) > max_keys:
        raise ProtocolError(f"{len(keys)} keys in one request; the limit is {max_keys}")
    if not well_formed(keys):
        raise ProtocolError("every key must be 16 bytes (msgpack bin)")
    return keys


def checksums_field(msg: dict, n: int) -> list[int] | None:
    """A put's or commit's optional per-key checksums of the bytes the writer copied (xxh3-64,
    or -1 where it gives none), checked; None where the request gives none."""
    v = msg.get("checksums")
    if v is None:
        return None
    if not checksums_ok(v, n):
        raise ProtocolError(f"checksums must hold one 64-bit checksum (or -1) per key ({n})")
    return v
