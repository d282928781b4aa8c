"""The remote tier: a shared store on Redis or Valkey (standalone or Cluster) for fleets that
outgrow one node.

Unlike the other tiers it has no slots: the server owns capacity and eviction (`maxmemory` and
an LRU policy), so the store keeps no residency record for it, only a short-lived memory of
which keys the server had (see TieredStore). This module is the data plane: batched, pipelined
exists / get / set / delete — one round trip per call whatever the number of blocks (a Cluster
client splits a pipeline per node) — and the value format.

A value is a hash of two fields, written by one HSET (atomic): `h`, the disk slot's
self-describing header (magic, format version, codec, namespace id, key, parent, payload length
and checksum, header checksum), and `p`, the payload — sent straight from the host slot, with no
copy. A value that is foreign, truncated, overwritten or corrupt fails verification and is never
served (`CorruptBlockError`: the store counts it, deletes it and treats it as a miss).

URLs: `redis://[user:password@]host:port[/db]`, `rediss://...` (TLS; `ssl_*` settings as query
parameters, passed to the client), `unix:///path/redis.sock`, and
`redis+cluster://host:port[,host:port...]` (or `rediss+cluster://`) for a Redis Cluster,
discovered from whichever seed node answers.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import threading
import time
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from .. import codec as _codec
from ..errors import ConfigError
from .base import BlockMeta, Tier
from .slot_header import PAGE, CorruptBlockError, _csum, encode_block, pack_slot_header, unpack_slot_header

KEY_PREFIX = b"tierd:"
_FIELDS = (b"h", b"p")      # a value is a hash: h = the slot header, p = the payload


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


def redact(url: str) -> str:
    """`url` without its password (for stats and logs)."""
    p = urlsplit(url)
    if p.password is None:
        return url
    netloc = p.netloc.rsplit("@", 1)[1]
    user = f"{p.username}:***@" if p.username else ":***@"
    return urlunsplit((p.scheme, user + netloc, p.path, p.query, p.fragment))


def read_fleet_key(path: str) -> bytes | None:
    """The fleet key from `path` ("" none): a secret every node of the fleet shares, at least
    16 bytes, in a file only the daemon's user may read."""
    if not path:
        return None
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            key = f.read().strip()
    except OSError as e:
        raise ConfigError(f"remote.fleet_key_file {path}: cannot read it ({e.strerror})") from None
    if st.st_mode & 0o077:
        raise ConfigError(f"remote.fleet_key_file {path} may be read by other users (mode "
                          f"{st.st_mode & 0o777:o}); chmod 600 it")
    if len(key) < 16:
        raise ConfigError(f"remote.fleet_key_file {path}: the key must be at least 16 bytes")
    return key[:64]   # blake2b's longest key


def parse_rkey(rk: bytes) -> tuple[bytes, bytes] | None:
    """(namespace id, key) of a block's value key `tierd:<ns hex>:<key hex>`, else None."""
    rk = bytes(rk)
    if not rk.startswith(KEY_PREFIX) or len(rk) != len(KEY_PREFIX) + 65 or rk[len(KEY_PREFIX) + 32:][:1] != b":":
        return None
    try:
        return bytes.fromhex(rk[len(KEY_PREFIX):len(KEY_PREFIX) + 32].decode()), bytes.fromhex(rk[-32:].decode())
    except ValueError:
        return None


class RemoteTier(Tier):
    name = "remote"

    def __init__(self, url: str, *, timeout_s: float = 0.5, codec: str = "none", zstd_level: int = 1,
                 fleet_key: bytes | None = None):
        try:
            import redis
        except ImportError:
            raise ConfigError("the remote tier needs redis-py (pip install 'tierd[remote]')") from None
        self.url = url
        # With a fleet key every value carries a MAC (keyed blake2b over header and payload) in
        # field "m"; a value without a valid one is dropped, never served.
        self.fleet_key = fleet_key or None
        self.fields = _FIELDS + (b"m",) if self.fleet_key else _FIELDS
        self.codec_name = codec
        self.zstd_level = zstd_level
        self.cluster = False
        self._client = None
        parts = urlsplit(url)
        self._kw = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        if parts.scheme in ("redis+cluster", "rediss+cluster"):
            self.cluster = True
            hosts = parts.netloc.rsplit("@", 1)[-1]
            seeds = []
            for hp in hosts.split(","):
                host, _, port = hp.rpartition(":")
                try:
                    seeds.append((host.strip("[]") or "127.0.0.1", int(port or 6379)))
                except ValueError:
                    raise ConfigError(f"remote tier: {redact(url)}: bad host:port {hp!r}") from None
            self._seeds = seeds
            tls = parts.scheme.startswith("rediss")
            self._auth = dict(username=parts.username, password=parts.password,
                              **({"ssl": True} if tls else connection_options(cluster=True)))
        elif parts.scheme in ("redis", "rediss", "unix"):
            try:
                self._client = redis.Redis.from_url(url, **self._kw, **connection_options())  # lazily
            except (redis.RedisError, ValueError) as e:
                raise ConfigError(f"remote tier: cannot use {redact(url)}: {e}") from None
        else:
            raise ConfigError(f"remote tier: {redact(url)}: use redis://, rediss://, unix:// or "
                              "redis+cluster://host:port[,host:port...]")
        self.capacity_bytes = 0
        self.used_bytes = 0
        self.direct_reads = True     # fetch_many's fast path (tests turn it off to compare)

    @property
    def client(self):
        """The redis-py client. A Cluster client is made on first use (it must reach one of the
        seed nodes to learn the slot map): a cluster that is down when tierd starts degrades
        the tier instead of stopping the daemon."""
        if self._client is None:
            from redis.cluster import ClusterNode, RedisCluster
            nodes = [ClusterNode(h, p) for h, p in self._seeds]
            extra = {}
            if "connection_class" in self._auth:
                # made from a URL, RedisCluster builds its nodes' connection pools from these
                # options (a node's Redis() would not take a connection class)
                host = f"[{nodes[0].host}]" if ":" in nodes[0].host else nodes[0].host
                extra["url"] = f"redis://{host}:{nodes[0].port}"
                nodes = nodes[1:]
            self._client = RedisCluster(startup_nodes=nodes, **extra, **self._auth, **self._kw)
        return self._client

    # -- keys and values -----------------------------------------------------------------------
    @staticmethod
    def rkey(ns_id: bytes, key: bytes) -> bytes:
        return KEY_PREFIX + ns_id.hex().encode() + b":" + key.hex().encode()

    def encode(self, src: np.ndarray, meta: BlockMeta) -> tuple[bytes, memoryview | bytes]:
        """A block's value: (header, payload). The payload is `src` itself (a view: redis-py sends
        it without a copy) unless a codec made it smaller."""
        codec, payload = encode_block(self.codec_name, self.zstd_level, src[:meta.block_bytes],
                                      meta.dtype_bytes, meta.lossy, meta.kv_dtype)
        payload = memoryview(payload).cast("B")
        header = pack_slot_header(codec, meta.dtype_bytes, meta.ns_id, meta.key, meta.parent or b"",
                                  len(payload), meta.block_bytes, 0, 0, _csum(payload))
        return header, payload

    @staticmethod
    def check_header(header, ns_id: bytes, key: bytes, raw_len: int,
                     lossy_ok: bool = False) -> tuple[int, int, int, bytes | None]:
        """Verify a value's header as block `key` of namespace `ns_id`, `raw_len` bytes long
        (a lossy codec only where the namespace asked for one): (codec, payload length, payload
        checksum, parent key or None). Raises CorruptBlockError."""
        h = unpack_slot_header(memoryview(header)[:PAGE])
        if h is None:
            raise CorruptBlockError("value has no header")
        _, _, codec, _, _, h_ns, h_key, parent, payload_len, h_raw_len, _, _, pcsum = h
        if h_ns != ns_id or h_key != key:
            raise CorruptBlockError("value belongs to another block")
        if h_raw_len != raw_len:
            raise CorruptBlockError(f"value holds {h_raw_len} bytes, the block has {raw_len}")
        if payload_len > raw_len:
            # a codec never makes a block larger (it is stored raw then): a value claiming more
            # must not size what the reader allocates
            raise CorruptBlockError(f"value claims a {payload_len}-byte payload for a {raw_len}-byte block")
        if codec in _codec.LOSSY and not lossy_ok:
            raise CorruptBlockError(f"a {_codec.CODEC_NAMES[codec]} (lossy) value in an exact namespace")
        return codec, payload_len, pcsum, None if parent == b"\0" * 16 else parent

    def decode(self, value, ns_id: bytes, key: bytes, dst: np.ndarray, lossy_ok: bool = False) -> bytes | None:
        """Verify `value` ((header, payload[, mac]), as `get_many` returns it) as block `key` of
        namespace `ns_id` and copy it into `dst` (raw_len,); returns the block's parent key (or
        None). Raises CorruptBlockError."""
        if isinstance(value, Exception) or not isinstance(value, (list, tuple)) or len(value) != len(self.fields):
            raise CorruptBlockError(f"value is not a block ({type(value).__name__})")
        header, payload = value[0], value[1]
        if header is None or payload is None:
            raise CorruptBlockError("value lacks its header or payload")
        codec, payload_len, pcsum, parent = self.check_header(header, ns_id, key, dst.nbytes, lossy_ok)
        if len(payload) != payload_len:
            raise CorruptBlockError("value truncated")
        self.check_mac(header, payload, value[2] if len(value) > 2 else None)
        finish_payload(codec, payload, pcsum, dst)
        return parent

    # -- data calls (no store lock; each one round trip) ----------------------------------------------
    def exists_many(self, ns_id: bytes, keys: list[bytes]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(self.rkey(ns_id, k))
        return [bool(x) for x in pipe.execute()]

    def get_many(self, ns_id: bytes, keys: list[bytes]) -> list:
        """Per key: [header, payload] ([None, None] when absent), or the server's error for a
        value that is not one of ours (e.g. another type)."""
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.hmget(self.rkey(ns_id, k), self.fields)
        return pipe.execute(raise_on_error=False)

    def fetch_many(self, ns_id: bytes, keys: list[bytes], dsts: list[np.ndarray], *,
                   lossy_ok: bool = False) -> list:
        """Load blocks `keys` of namespace `ns_id` into `dsts` (each raw_len bytes), verified:
        per key None (loaded), KeyError (not on the server) or CorruptBlockError (the value is not
        this block, intact: `dsts[i]` then holds garbage). One round trip per server. Raises
        when the server cannot be reached or answers out of protocol.

        Payloads stored raw are received straight into their destination (one copy, by the
        kernel) and verified there: redis-py would copy each one twice more on the way (into its
        parser's buffer, then into a bytes object) before tierd copied it into host RAM. Keys
        the fast path cannot serve (a Cluster redirect, a RESP3 connection) go through redis-py."""
        out: list = [None] * len(keys)
        slow = list(range(len(keys)))
        if self.direct_reads:
            rkeys = [self.rkey(ns_id, k) for k in keys]
            slow = []
            for pool, idx in self._pools_for(rkeys):
                if pool is None:
                    slow += idx
                    continue
                slow += _fetch_direct(self, pool, [rkeys[i] for i in idx], ns_id, [keys[i] for i in idx],
                                      [dsts[i] for i in idx], idx, out, lossy_ok)
        if slow:
            # redis-py reads a whole value before tierd sees it: ask the sizes first, and fetch
            # only values whose fields fit a header and the block
            pipe = self.client.pipeline(transaction=False)
            for i in slow:
                pipe.hstrlen(self.rkey(ns_id, keys[i]), _FIELDS[0])
                pipe.hstrlen(self.rkey(ns_id, keys[i]), _FIELDS[1])
            sizes = pipe.execute(raise_on_error=False)
            fetch = []
            for j, i in enumerate(slow):
                h, p = sizes[2 * j], sizes[2 * j + 1]
                for v in (h, p):
                    if isinstance(v, Exception):
                        if not str(v).startswith("WRONGTYPE"):
                            raise RemoteServerError(str(v)[:120])
                if isinstance(h, Exception) or isinstance(p, Exception):
                    out[i] = CorruptBlockError(f"value is not a block ({str(h if isinstance(h, Exception) else p)[:80]})")
                elif h == 0 and p == 0:
                    out[i] = KeyError("not on the server")
                elif h > PAGE or p > dsts[i].nbytes:
                    out[i] = CorruptBlockError(f"value's fields ({h}, {p} bytes) are larger than a block's")
                else:
                    fetch.append(i)
            values = self.get_many(ns_id, [keys[i] for i in fetch]) if fetch else []
            for i, v in zip(fetch, values):
                if isinstance(v, list) and v[:2] == [None, None]:
                    out[i] = KeyError("not on the server")
                    continue
                if isinstance(v, Exception) and not str(v).startswith("WRONGTYPE"):
                    raise RemoteServerError(str(v)[:120])
                try:
                    self.decode(v, ns_id, keys[i], dsts[i], lossy_ok)
                except CorruptBlockError as e:
                    out[i] = e
        return out

    def _pools_for(self, rkeys: list[bytes]) -> list[tuple[object, list[int]]]:
        """[(connection pool, indices of `rkeys` it serves)]: the one pool of a standalone
        server; per node for a Cluster (None where the slot's owner is not known)."""
        if not self.cluster:
            return [(_direct_pool(self.client.connection_pool), list(range(len(rkeys))))]
        groups: dict[int, tuple[object, list[int]]] = {}
        for i, rk in enumerate(rkeys):
            try:
                node = self.client.get_node_from_key(rk)
                pool = _direct_pool(node.redis_connection.connection_pool)
            except Exception:  # noqa: BLE001 -- no slot map yet, or a node in flux: redis-py's path
                pool = None
            groups.setdefault(id(pool), (pool, []))[1].append(i)
        return list(groups.values())

    def mac(self, header, payload) -> bytes:
        """The fleet's MAC of a value: blake2b keyed with the fleet key, over header and payload."""
        h = hashlib.blake2b(bytes(header), key=self.fleet_key, digest_size=32)
        h.update(memoryview(payload).cast("B") if not isinstance(payload, (bytes, bytearray)) else payload)
        return h.digest()

    def check_mac(self, header, payload, mac) -> None:
        """Raise CorruptBlockError unless `mac` is this fleet's MAC of the value (no key: no check)."""
        if self.fleet_key is None:
            return
        if not mac or not hmac.compare_digest(bytes(mac), self.mac(header, payload)):
            raise CorruptBlockError("value is not signed with this fleet's key")

    def set_many(self, items: list[tuple[bytes, tuple]]) -> None:
        """[(redis key, (header, payload))], one round trip; each value one HSET (atomic)."""
        pipe = self.client.pipeline(transaction=False)
        for k, (header, payload) in items:
            fields = {b"h": header, b"p": payload}
            if self.fleet_key is not None:
                fields[b"m"] = self.mac(header, payload)
            pipe.hset(k, mapping=fields)
        pipe.execute()

    def delete_many(self, rkeys: list[bytes]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for k in rkeys:
            pipe.delete(k)
        pipe.execute()

    def write(self, slot, src: np.ndarray, meta: BlockMeta) -> bytes:
        rk = self.rkey(meta.ns_id, meta.key)
        self.set_many([(rk, self.encode(src, meta))])
        return rk

    def read(self, where: tuple[bytes, bytes], dst: np.ndarray) -> None:
        ns_id, key = where
        (err,) = self.fetch_many(ns_id, [key], [dst])
        if isinstance(err, KeyError):
            raise CorruptBlockError("value is gone")
        if err is not None:
            raise err

    def flush_namespace(self, ns_id: bytes | None, batch: int = 500) -> list[tuple[bytes, bytes]]:
        """Delete every block value of namespace `ns_id` (all of tierd's with None): SCAN by
        prefix, in batches; keys that do not name a block (the probe key, anything else under
        the prefix) are left alone. Returns the (namespace id, key) of each value deleted."""
        pattern = KEY_PREFIX + (ns_id.hex().encode() + b":*" if ns_id is not None else b"*")
        done: list[tuple[bytes, bytes]] = []
        todo: list[tuple[bytes, bytes, bytes]] = []
        for rk in self.client.scan_iter(match=pattern, count=batch):
            named = parse_rkey(rk)
            if named is None:
                continue
            todo.append((rk, *named))
            if len(todo) >= batch:
                self.delete_many([t[0] for t in todo])
                done += [(n, k) for _, n, k in todo]
                todo = []
        if todo:
            self.delete_many([t[0] for t in todo])
            done += [(n, k) for _, n, k in todo]
        return done

    def refresh_usage(self) -> None:
        """The server's memory figures (no lock; called by the store's remote thread)."""
        infos = self.client.info("memory")
        if self.cluster:   # one entry per node
            infos = list(infos.values()) if isinstance(infos, dict) and "used_memory" not in infos else [infos]
        else:
            infos = [infos]
        self.used_bytes = sum(int(i.get("used_memory", 0)) for i in infos)
        self.capacity_bytes = sum(int(i.get("maxmemory", 0)) for i in infos)

    def usage(self) -> dict:
        return {"capacity_bytes": self.capacity_bytes, "used_bytes": self.used_bytes,
                "free_bytes": max(0, self.capacity_bytes - self.used_bytes) if self.capacity_bytes else 0,
                "url": redact(self.url), "cluster": self.cluster, "codec": self.codec_name}

    def probe(self) -> float:
        """One small write and read back (a Cluster: on the node that owns the probe key, so a
        failed-over master is seen once its replica has taken over). Returns the seconds taken."""
        t0 = time.perf_counter()
        if self.cluster:
            # a failover moves slots: re-read the slot map, then every master must answer
            self.client.nodes_manager.initialize()
            self.client.ping(target_nodes=self.client.PRIMARIES)
        k = KEY_PREFIX + b"probe"
        pipe = self.client.pipeline(transaction=False)
        pipe.set(k, b"1", ex=60)
        pipe.get(k)
        if pipe.execute()[1] != b"1":
            raise ConnectionError("the probe key did not read back")
        return time.perf_counter() - t0

    def close(self) -> None:
        try:
            if self._client is not None:
                self._client.close()
        except Exception:  # noqa: BLE001 -- closing a dead connection
            pass


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
                codec, payload_len, pcsum, _ = RemoteTier.check_header(header, ns_id, keys[j], dst.nbytes, lossy_ok)
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


class RemoteMemory:
    """What this node learned of the server lately: keys it had (each counts as there for
    `known_s`) and keys it lacked (`absent_s`), so lookups and write-behind skip round trips.
    Bounded: entries expire in the order they were noted and at most `max_entries` of each kind
    are kept, trimmed at every insert (amortised O(1)). Not thread-safe: its user's lock guards it."""

    def __init__(self, known_s: float, absent_s: float, max_entries: int = 200_000):
        self.known_s, self.absent_s, self.max_entries = known_s, absent_s, max_entries
        self._had: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._lacked: collections.OrderedDict[bytes, float] = collections.OrderedDict()

    def had(self, ikey: bytes, now: float) -> bool:
        return self._had.get(ikey, 0.0) > now

    def lacked(self, ikey: bytes, now: float) -> bool:
        return self._lacked.get(ikey, 0.0) > now

    def note_had(self, ikey: bytes, now: float) -> None:
        self._lacked.pop(ikey, None)
        self._note(self._had, ikey, now + self.known_s, now)

    def note_lacked(self, ikey: bytes, now: float) -> None:
        self._had.pop(ikey, None)
        self._note(self._lacked, ikey, now + self.absent_s, now)

    def forget(self, ikey: bytes) -> None:
        self._had.pop(ikey, None)
        self._lacked.pop(ikey, None)

    def forget_namespace(self, ns_id: bytes | None) -> None:
        for d in (self._had, self._lacked):
            for k in [k for k in d if ns_id is None or k[:16] == ns_id]:
                del d[k]

    def __len__(self) -> int:
        return len(self._had) + len(self._lacked)

    def _note(self, d: collections.OrderedDict, ikey: bytes, until: float, now: float) -> None:
        d[ikey] = until
        d.move_to_end(ikey)
        while d:   # expired or over the bound: the oldest go first
            k, t = next(iter(d.items()))
            if t > now and len(d) <= self.max_entries:
                break
            del d[k]


class WriteBehind:
    """The remote tier's write-behind: blocks pinned in host RAM by the store, written to the
    server in batches (at most BATCH blocks, about BATCH_BYTES) by WRITERS threads on their own
    connections, so one batch is encoded while another waits for the server. The lead thread
    also probes a degraded server and refreshes the server's memory figures.

    It owns its queue, threads and batching, and reaches the store only through callbacks:
    `settle(tokens, metas, err, seconds)` when a batch is over (written, failed, or dropped
    because the tier is degraded: `DroppedError`), `degraded()` -> (is degraded, probe due),
    `probed(err)`. Its own lock is never held while it calls them, so the store may hold its
    lock when it calls `submit`. A token is the store's (its pinned block), opaque here."""

    BATCH = 32
    BATCH_BYTES = 8 << 20
    WRITERS = 2
    USAGE_S = 5.0

    class DroppedError(Exception):
        """The tier was degraded: the batch was dropped unsent."""

    def __init__(self, tier: "RemoteTier", *, queue_blocks: int, settle, degraded, probed):
        self.tier = tier
        self.queue_blocks = queue_blocks
        self._settle, self._degraded, self._probed = settle, degraded, probed
        self._lock = threading.Lock()
        self._q: collections.deque = collections.deque()   # (token, meta, view)
        self._inflight = 0
        self._wake = threading.Event()
        self._closing = False
        self._threads = [threading.Thread(target=self._run, args=(i == 0,), name=f"tierd-remote-{i}", daemon=True)
                         for i in range(self.WRITERS)]
        for t in self._threads:
            t.start()

    def submit(self, token, meta: BlockMeta, view) -> bool:
        """Queue one pinned block (`view`: its bytes, valid while the store keeps it pinned);
        False (not queued) when the queue is full."""
        with self._lock:
            if len(self._q) >= self.queue_blocks or self._closing:
                return False
            self._q.append((token, meta, view))
        self._wake.set()
        return True

    def pending(self) -> int:
        """Blocks waiting for, or on their way to, the server."""
        with self._lock:
            return len(self._q) + self._inflight

    def nudge(self) -> None:
        self._wake.set()

    def close(self, timeout_s: float) -> None:
        """Write what is queued (or drop it, degraded), then stop the threads."""
        with self._lock:
            self._closing = True
        self._wake.set()
        for t in self._threads:
            t.join(timeout_s)

    def _take(self, drop: bool) -> list:
        with self._lock:
            if drop:
                batch, self._q = list(self._q), collections.deque()
            else:
                n = min(self.BATCH, len(self._q))
                if n:   # a few MiB a round trip: the other writer's batch fills the wait
                    n = min(n, max(1, self.BATCH_BYTES // max(1, self._q[0][1].block_bytes)))
                batch = [self._q.popleft() for _ in range(n)]
            self._inflight += len(batch)
            return batch

    def _done(self, batch: list, err, seconds: float) -> None:
        try:
            self._settle([t for t, _, _ in batch], [m for _, m, _ in batch], err, seconds)
        finally:
            with self._lock:
                self._inflight -= len(batch)

    def _run(self, lead: bool) -> None:
        tier = self.tier
        usage_at = 0.0
        if lead:
            try:
                tier.probe()                 # is the server there at all? (else: degraded now)
            except Exception as e:  # noqa: BLE001 -- any client or server failure
                self._probed(e)
        while True:
            self._wake.wait(0.25)
            self._wake.clear()
            with self._lock:
                closing = self._closing
            degraded, probe_due = self._degraded()
            if degraded:
                dropped = self._take(drop=True)    # nothing waits for a degraded server
                if dropped:
                    self._done(dropped, self.DroppedError("remote tier degraded"), 0.0)
            if lead and probe_due:
                try:
                    tier.probe()
                except Exception as e:  # noqa: BLE001 -- any client or server failure
                    self._probed(e)
                else:
                    self._probed(None)
            now = time.monotonic()
            if lead and now >= usage_at:
                usage_at = now + self.USAGE_S
                try:
                    tier.refresh_usage()
                except Exception:  # noqa: BLE001 -- figures for stats only; probes judge health
                    pass
            batch = [] if degraded else self._take(drop=False)
            if batch:
                err = None
                t0 = time.perf_counter()
                try:
                    tier.set_many([(tier.rkey(m.ns_id, m.key), tier.encode(v, m)) for _, m, v in batch])
                except Exception as e:  # noqa: BLE001 -- the blocks stay on this node
                    err = e
                self._done(batch, err, time.perf_counter() - t0)
                if self.pending():
                    self._wake.set()
            if closing and not self.pending():
                return
