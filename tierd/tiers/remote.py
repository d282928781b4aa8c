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

import time
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from .. import codec as _codec
from ..errors import ConfigError
from .base import BlockMeta, Tier
from .disk import PAGE, CorruptBlockError, _csum, pack_slot_header, unpack_slot_header

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


class RemoteTier(Tier):
    name = "remote"

    def __init__(self, url: str, *, timeout_s: float = 0.5, codec: str = "none", zstd_level: int = 1):
        try:
            import redis
        except ImportError:
            raise ConfigError("the remote tier needs redis-py (pip install 'tierd[remote]')") from None
        self.url = url
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
            self._auth = dict(username=parts.username, password=parts.password,
                              ssl=parts.scheme.startswith("rediss"))
        elif parts.scheme in ("redis", "rediss", "unix"):
            try:
                self._client = redis.Redis.from_url(url, **self._kw)   # connects lazily
            except (redis.RedisError, ValueError) as e:
                raise ConfigError(f"remote tier: cannot use {redact(url)}: {e}") from None
        else:
            raise ConfigError(f"remote tier: {redact(url)}: use redis://, rediss://, unix:// or "
                              "redis+cluster://host:port[,host:port...]")
        self.capacity_bytes = 0
        self.used_bytes = 0

    @property
    def client(self):
        """The redis-py client. A Cluster client is made on first use (it must reach one of the
        seed nodes to learn the slot map): a cluster that is down when tierd starts degrades
        the tier instead of stopping the daemon."""
        if self._client is None:
            from redis.cluster import ClusterNode, RedisCluster
            self._client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in self._seeds],
                                        **self._auth, **self._kw)
        return self._client

    # -- keys and values -----------------------------------------------------------------------
    @staticmethod
    def rkey(ns_id: bytes, key: bytes) -> bytes:
        return KEY_PREFIX + ns_id.hex().encode() + b":" + key.hex().encode()

    def encode(self, src: np.ndarray, meta: BlockMeta) -> tuple[bytes, memoryview | bytes]:
        """A block's value: (header, payload). The payload is `src` itself (a view: redis-py sends
        it without a copy) unless a codec made it smaller."""
        raw = src[:meta.block_bytes]
        codec = _codec.choose_codec(self.codec_name, meta.dtype_bytes, meta.block_bytes)
        payload = _codec.encode(codec, raw, self.zstd_level) if codec else raw
        if codec and len(payload) >= meta.block_bytes:
            codec, payload = _codec.CODEC_NONE, raw
        payload = memoryview(payload).cast("B")
        header = pack_slot_header(codec, meta.dtype_bytes, meta.ns_id, meta.key, meta.parent or b"",
                                  len(payload), meta.block_bytes, 0, 0, _csum(payload))
        return header, payload

    @staticmethod
    def decode(value, ns_id: bytes, key: bytes, dst: np.ndarray) -> bytes | None:
        """Verify `value` ((header, payload), as `get_many` returns it) as block `key` of
        namespace `ns_id` and copy it into `dst` (raw_len,); returns the block's parent key (or
        None). Raises CorruptBlockError."""
        if isinstance(value, Exception) or not isinstance(value, (list, tuple)) or len(value) != 2:
            raise CorruptBlockError(f"value is not a block ({type(value).__name__})")
        header, payload = value
        if header is None or payload is None:
            raise CorruptBlockError("value lacks its header or payload")
        h = unpack_slot_header(memoryview(header)[:PAGE])
        if h is None:
            raise CorruptBlockError("value has no header")
        _, _, codec, _, _, h_ns, h_key, parent, payload_len, raw_len, _, _, pcsum = h
        if h_ns != ns_id or h_key != key:
            raise CorruptBlockError("value belongs to another block")
        if raw_len != dst.nbytes:
            raise CorruptBlockError(f"value holds {raw_len} bytes, the block has {dst.nbytes}")
        if len(payload) != payload_len:
            raise CorruptBlockError("value truncated")
        if _csum(payload) != pcsum:
            raise CorruptBlockError("payload checksum mismatch")
        try:
            _codec.decode(codec, payload, dst)
        except Exception as ex:  # zstd errors are not one class
            raise CorruptBlockError(f"payload does not decode: {ex}") from None
        return None if parent == b"\0" * 16 else parent

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
            pipe.hmget(self.rkey(ns_id, k), _FIELDS)
        return pipe.execute(raise_on_error=False)

    def set_many(self, items: list[tuple[bytes, tuple]]) -> None:
        """[(redis key, (header, payload))], one round trip; each value one HSET (atomic)."""
        pipe = self.client.pipeline(transaction=False)
        for k, (header, payload) in items:
            pipe.hset(k, mapping={b"h": header, b"p": payload})
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
        (value,) = self.get_many(ns_id, [key])
        if isinstance(value, list) and value == [None, None]:
            raise CorruptBlockError("value is gone")
        self.decode(value, ns_id, key, dst)

    def flush_namespace(self, ns_id: bytes | None, batch: int = 500) -> int:
        """Delete every value of namespace `ns_id` (all of tierd's with None): SCAN by prefix, in
        batches. Returns how many were deleted."""
        pattern = KEY_PREFIX + (ns_id.hex().encode() + b":*" if ns_id is not None else b"*")
        n, todo = 0, []
        for k in self.client.scan_iter(match=pattern, count=batch):
            todo.append(k)
            if len(todo) >= batch:
                self.delete_many(todo)
                n, todo = n + len(todo), []
        if todo:
            self.delete_many(todo)
            n += len(todo)
        return n

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
