"""How the remote tier speaks RESP (the Redis protocol) to its server: the redis-py options that
send a block as its own buffer, and the fast read path, which reads HMGET replies straight off a
redis-py connection's socket into host slots and verifies them there (`_fetch_direct`). What a
value holds and when it is served is `RemoteTier`'s (tierd/tiers/remote.py); this module only
moves and checks bytes, and never judges the server by a value: a value that is not a block is a
miss, the server's own errors raise `RemoteServerError` (the tier degrades, nothing is deleted).
"""

from __future__ import annotations

import numpy as np

from .. import codec as _codec
from .slot_header import PAGE, CorruptBlockError, _csum


def _encode_arg(value):
    """A command argument as redis-py would send it (bytes and memoryviews as they are)."""
    if isinstance(value, (bytes, memoryview)):
        return value
    if isinstance(value, str):
        return value.encode()
    return repr(value).encode() if isinstance(value, float) else str(value).encode()


def _packer():
    """redis-py's Python command serializer, which sends a large value as its own buffer. With
    hiredis installed redis-py would pack every command through hiredis, which copies each value
    into one string first: half the write rate for block-sized values. Replies still go through
    hiredis's parser (twice redis-py's own rate for block-sized values)."""
    try:
        from redis.connection import PythonRespSerializer
    except ImportError:          # an older redis-py: its default packer
        return None
    return PythonRespSerializer(6000, _encode_arg)


def connection_options(cluster: bool = False) -> dict:
    """Keyword arguments for a redis-py client that moves blocks well (also used by the
    benchmark's raw reference, so that both sides send and parse the same way). A TLS Cluster
    client picks its own connection class, so it keeps redis-py's default packer."""
    packer = _packer()
    if packer is None:
        return {}
    if not cluster:
        return {"command_packer": packer}
    import redis

    class _Connection(redis.Connection):
        def __init__(self, **kw):
            kw.setdefault("command_packer", packer)
            super().__init__(**kw)
    return {"connection_class": _Connection}


def finish_payload(codec: int, payload, pcsum: int, dst: np.ndarray) -> None:
    """Verify a received payload against its header's checksum and decode it into `dst` (a
    payload received into `dst` itself is only verified). Raises CorruptBlockError."""
    if _csum(payload) != pcsum:
        raise CorruptBlockError("payload checksum mismatch")
    if payload is dst:
        return
    try:
        _codec.decode(codec, payload, dst)
    except Exception as ex:  # noqa: BLE001 -- zstd errors are not one class
        raise CorruptBlockError(f"payload does not decode: {ex}") from None


# -- the fast read path -------------------------------------------------------------------------
_CRLF = b"\r\n"
_REDIRECTS = (b"MOVED", b"ASK", b"TRYAGAIN", b"CLUSTERDOWN")
_FOREIGN = (b"WRONGTYPE",)   # errors about the value at that key (not one of ours): a miss for it


class RemoteServerError(ConnectionError):
    """The server answered with an error about its own state (-LOADING, -BUSY, -NOPERM,
    -MASTERDOWN, ...): the remote tier degrades; no value is judged, none deleted."""


class _ReplyStream:
    """Replies read off a redis-py connection's socket: lines through a small buffer, large bulk
    strings straight into where they go."""

    def __init__(self, sock):
        self.sock = sock
        self.buf = bytearray()
        self.pos = 0
        self.scratch = bytearray(64 << 10)

    def _fill(self) -> None:
        n = self.sock.recv_into(self.scratch)
        if n == 0:
            raise ConnectionError("the server closed the connection")
        if self.pos:
            del self.buf[:self.pos]
            self.pos = 0
        self.buf += memoryview(self.scratch)[:n]

    def line(self) -> bytes:
        while True:
            i = self.buf.find(_CRLF, self.pos)
            if i >= 0:
                out = bytes(self.buf[self.pos:i])
                self.pos = i + 2
                return out
            if len(self.buf) - self.pos > 1 << 16:
                raise ConnectionError("reply line too long")
            self._fill()

    def into(self, dst: memoryview) -> None:
        """The next len(dst) bytes of a bulk string, then its CRLF."""
        n = len(dst)
        have = min(n, len(self.buf) - self.pos)
        dst[:have] = self.buf[self.pos:self.pos + have]
        self.pos += have
        while have < n:
            got = self.sock.recv_into(dst[have:])
            if got == 0:
                raise ConnectionError("the server closed the connection")
            have += got
        while len(self.buf) - self.pos < 2:
            self._fill()
        if self.buf[self.pos:self.pos + 2] != _CRLF:
            raise ConnectionError("bulk string not terminated")
        self.pos += 2

    def skip(self, n: int) -> None:
        """Read past the next n bytes of a bulk string and its CRLF, holding none of them."""
        have = min(n, len(self.buf) - self.pos)
        self.pos += have
        view = memoryview(self.scratch)
        while have < n:
            got = self.sock.recv_into(view[:min(len(view), n - have)])
            if got == 0:
                raise ConnectionError("the server closed the connection")
            have += got
        self.into(memoryview(bytearray(0)))      # the CRLF

    def bulk(self, limit: int) -> bytearray | None | bool:
        """A bulk string (None for nil; False for one longer than `limit`, read past)."""
        n = self._length(self.line(), b"$")
        if n is None:
            return None
        if n > limit:
            self.skip(n)
            return False
        out = bytearray(n)
        self.into(memoryview(out))
        return out

    @staticmethod
    def _length(line: bytes, kind: bytes) -> int | None:
        if line in (b"$-1", b"*-1", b"_"):
            return None
        if line[:1] != kind:
            raise ConnectionError(f"unexpected reply {line[:40]!r}")
        return int(line[1:])


def _direct_pool(pool):
    """`pool` where the fast path can read its replies (RESP2, as tierd's clients speak), else
    None."""
    return pool if str(pool.connection_kwargs.get("protocol") or 2) == "2" else None


def _fetch_direct(tier, pool, rkeys, ns_id, keys, dsts, idx, out, lossy_ok) -> list[int]:
    """HMGET `rkeys` on one connection of `pool`, one round trip; results into `out` at `idx`.
    Returns the indices to retry through redis-py (Cluster redirects). A failure mid-stream
    disconnects the connection (its stream cannot be trusted) and raises."""
    try:
        conn = pool.get_connection()
    except TypeError:     # redis-py before 5.3
        conn = pool.get_connection("HMGET")
    ok = False
    retry: list[int] = []
    server_error = None
    try:
        fields = tier.fields
        conn.send_packed_command(conn.pack_commands([(b"HMGET", rk) + fields for rk in rkeys]))
        rs = _ReplyStream(conn._sock)
        for j, i in enumerate(idx):
            line = rs.line()
            if line[:1] == b"-":
                code = line[1:].split(b" ", 1)[0]
                if code in _REDIRECTS:
                    retry.append(i)
                elif code in _FOREIGN:
                    out[i] = CorruptBlockError(f"value is not a block ({line[1:80].decode(errors='replace')})")
                else:   # LOADING, BUSY, NOPERM, MASTERDOWN, OOM...: the server's state, not the value's
                    server_error = server_error or RemoteServerError(line[1:120].decode(errors="replace"))
                continue
            if rs._length(line, b"*") != len(fields):
                raise ConnectionError(f"unexpected reply {line[:40]!r}")
            header = rs.bulk(limit=PAGE)             # a slot header fits a page: larger is foreign
            n = rs._length(rs.line(), b"$")
            dst = dsts[j]
            payload = None
            try:
                if header is None and n is None:
                    raise KeyError("not on the server")
                if header is None or n is None:
                    raise CorruptBlockError("value lacks its header or payload")
                if header is False:
                    raise CorruptBlockError("value's header is too long to be one")
                codec, payload_len, pcsum, _ = tier.check_header(header, ns_id, keys[j], dst.nbytes, lossy_ok)
                if n != payload_len:
                    raise CorruptBlockError("value truncated")
            except (KeyError, CorruptBlockError) as e:
                if n is not None:
                    rs.skip(n)                             # read past it
                out[i] = e
            else:
                if codec == _codec.CODEC_NONE and n == dst.nbytes:
                    rs.into(memoryview(dst).cast("B"))
                    payload = dst
                else:
                    payload = bytearray(n)
                    rs.into(memoryview(payload))
            mac = rs.bulk(limit=64) if len(fields) > 2 else None   # read past it in every case
            if payload is None:
                continue
            try:
                tier.check_mac(header, payload, mac if mac is not False else None)
                finish_payload(codec, payload, pcsum, dst)
            except CorruptBlockError as e:
                out[i] = e
        ok = rs.pos == len(rs.buf)
        if not ok:
            raise ConnectionError("the server sent more than was asked for")
    finally:
        if not ok:
            conn.disconnect()
        pool.release(conn)
    if server_error is not None:
        raise server_error    # the tier degrades; nothing is deleted, every key of it is a miss
    return retry

