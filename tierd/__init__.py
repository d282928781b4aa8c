"""tierd: a tiered KV-cache store for LLM inference (GPU HBM, shared host RAM, NVMe).

Public surface: `connect(url)`, `TieredStore`, `Namespace`, `tierd.keys.block_keys`.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit

from .config import StoreConfig
from .errors import ConfigError, TierdError
from .namespace import Namespace
from . import report
from .store import Lease, Reservation, TieredStore

__version__ = "0.2.0.dev0"   # the one place; pyproject.toml reads it
__all__ = ["connect", "report", "TieredStore", "Namespace", "StoreConfig", "Lease", "Reservation",
           "TierdError", "__version__"]

# embedded:// query parameters -> StoreConfig fields
_URL_PARAMS = {
    "host": "host_bytes", "host_bytes": "host_bytes", "host_slab": "host_slab_bytes",
    "disk": "disk_path", "disk_path": "disk_path", "disk_bytes": "disk_bytes",
    "disk_slab": "disk_slab_bytes", "disk_file": "disk_file_bytes", "codec": "disk_codec",
    "policy": "eviction_policy", "admit_min_hits": "disk_admit_min_hits",
    "direct_io": "disk_direct_io", "remote": "remote_url",
    "gpu": "gpu_bytes", "gpu_bytes": "gpu_bytes", "gpu_slab": "gpu_slab_bytes", "gpu_device": "gpu_device",
    "gpu_admit_hits": "gpu_admit_hits",
}


def connect(url: str = "embedded://"):
    """A Store for `url`.

    `embedded://?host=8GiB&disk=/var/cache/tierd&disk_bytes=100GiB&policy=s3fifo&codec=zstd`
    opens a TieredStore in this process (`gpu=2GiB&gpu_device=cuda:0` adds an HBM tier, whose
    copies connectors on that device read device-to-device); `unix:///run/tierd/tierd.sock?timeout_s=2` connects to a
    daemon (`tierd.client.Client`; `timeout_s` bounds each request, 60 s by default;
    `connect_timeout_s` the connection, 5 s; `retries` how often a read-only request is retried
    on a new connection, 1; `spin_us` how long a request busy-polls for its reply before
    sleeping, 100 µs, 0 never; `index=0` asks the daemon for every lookup instead of answering
    from its shared lookup index (`index_lookups=0` only lookups: gets still read blocks the
    index shows ready without a lease); `hbm=1|0` says whether this client reads the HBM tier's copies,
    by default when it maps the daemon's HBM tier: only readers make blocks move into HBM;
    `prefault=1` maps every page of the daemon's host arena into this process ahead of use, in
    a background thread at the lowest priority, so that no copy through a slot stops on page
    faults: what engines' connectors ask for); `pin_after_eviction_s` how long after the host
    tier's last eviction a pipelined lease (a connector's load) still pins its blocks, 1 s (`inf`
    always, 0 never; without an eviction that recent a load sends the daemon nothing, and its
    copy is checked after all the same). Both have the same interface.
    """
    parts = urlsplit(url)
    if parts.scheme == "embedded":
        cfg = StoreConfig()
        for k, v in parse_qsl(parts.query, keep_blank_values=True):
            if k not in _URL_PARAMS:
                raise ConfigError(f"{url}: unknown parameter {k!r}; known: {', '.join(sorted(_URL_PARAMS))}")
            field = _URL_PARAMS[k]
            if field in ("disk_admit_min_hits", "gpu_admit_hits"):
                v = int(v)
            elif field == "disk_direct_io":
                v = v.lower() not in ("0", "false", "no", "off")
            setattr(cfg, field, v)
        return TieredStore(cfg)
    if parts.scheme == "unix":
        from .client import Client
        path = parts.path or parts.netloc
        if not path:
            raise ConfigError(f"{url}: no socket path; use unix:///run/tierd/tierd.sock")
        kw: dict = {}
        known = {"timeout_s": float, "connect_timeout_s": float, "retries": int, "spin_us": float, "index": int,
                 "index_lookups": int, "hbm": int, "prefault": int, "pin_after_eviction_s": float}
        for k, v in parse_qsl(parts.query, keep_blank_values=True):
            if k not in known:
                raise ConfigError(f"{url}: unknown parameter {k!r}; known: {', '.join(known)}")
            try:
                kw[k] = known[k](v)
            except ValueError:
                raise ConfigError(f"{url}: {k} must be a number") from None
            if not kw[k] >= 0 or (k not in ("retries", "spin_us", "index", "index_lookups", "hbm", "prefault",
                                             "pin_after_eviction_s") and not kw[k] > 0):
                raise ConfigError(f"{url}: {k} must be positive")
        if "index" in kw:
            kw["use_index"] = bool(kw.pop("index"))
        if "index_lookups" in kw:
            kw["index_lookups"] = bool(kw["index_lookups"])
        for k in ("hbm", "prefault"):
            if k in kw:
                kw[k] = bool(kw[k])
        return Client(path, **kw)
    raise ConfigError(f"{url}: unknown scheme {parts.scheme!r}; use embedded:// or unix://")
