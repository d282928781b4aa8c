"""The remote tier: a shared store on Redis or Valkey (standalone or Cluster) for fleets that
outgrow one node.

Unlike the other tiers it has no slots: the server owns capacity and eviction (`maxmemory` and
an LRU policy), so the store keeps no residency record for it, only a short-lived memory of
which keys the server had (see TieredStore). This module is the data plane: batched, pipelined
exists / get / set / delete — one round trip per call whatever the number of blocks (a Cluster
client splits a pipeline per node) — and the value format. Its neighbours: the wire (redis-py's
options and the fast read path straight into host slots, tierd/tiers/resp.py), the write-behind
(tierd/tiers/remote_writes.py) and the memory of what the server had (tierd/tiers/remote_memory.py).

A value is a hash of two fields, written by one HSET (atomic): `h`, the disk slot's
self-describing header (magic, format version, codec, namespace id, key, parent, payload length
and checksum, header checksum), and `p`, the payload — sent straight from the host slot, with no
copy. A value that is foreign, truncated, overwritten or corrupt fails verification and is never
served (`CorruptBlockError`: the store counts it, leaves it on the server and treats it as a miss).

URLs: `redis://[user:password@]host:port[/db]`, `rediss://...` (TLS; `ssl_*` settings as query
parameters, passed to the client), `unix:///path/redis.sock`, and
`redis+cluster://host:port[,host:port...]` (or `rediss+cluster://`) for a Redis Cluster,
discovered from whichever seed node answers.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from .. import codec as _codec
from ..errors import ConfigError
from .base import BlockMeta, Tier
from .slot_header import PAGE, CorruptBlockError, _csum, encode_block, pack_slot_header, unpack_slot_header
from .remote_memory import RemoteMemory  # noqa: F401
from .remote_writes import WriteBehind  # noqa: F401
from .resp import (_CRLF, _FOREIGN, _REDIRECTS, RemoteServerError, _direct_pool,  # noqa: F401
                   _encode_arg, _fetch_direct, _packer, _ReplyStream, connection_options, finish_payload)

KEY_PREFIX = b"tierd:"
_FIELDS = (b"h", b"p")      # a value is a hash: h = the slot header, p = the payload


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
