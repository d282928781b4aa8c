"""Settings of a store and the parsing of human sizes ("64GiB", "512MiB", "10%").

Owns defaults and validation only; it never touches memory or files.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import ConfigError

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
ALIGN = 4096

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z%]*)\s*$")


def parse_size(value: str | int | float, *, total: int | None = None, what: str = "size") -> int:
    """Bytes from `64GiB`, `512MiB`, `1.5G`, `4096`, or `10%` (of `total`)."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size like 64GiB, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"{what}: size must not be negative, got {value}")
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ConfigError(f"{what}: cannot parse {value!r}; use e.g. 64GiB, 512MiB, 4096 or 10%")
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit == "%":
        if total is None:
            raise ConfigError(f"{what}: a percentage ({value}) is not allowed here; give bytes")
        if number > 100:
            raise ConfigError(f"{what}: {value} is more than 100%")
        return int(total * number / 100)
    if unit not in _UNITS:
        raise ConfigError(f"{what}: unknown unit {m.group(2)!r} in {value!r}; use B, KiB, MiB, GiB, TiB or %")
    return int(number * _UNITS[unit])


def format_size(n: int | float) -> str:
    """`1536` -> `1.5KiB`; exact powers print without decimals."""
    n = float(n)
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{int(n)}B"


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def total_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _device_bytes(device: str) -> int | None:
    """Memory of a torch device (for `gpu_bytes = "10%"`); None if it cannot be told."""
    if not str(device).startswith("cuda"):
        return total_ram_bytes()
    try:
        import torch
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    except Exception:  # no torch, no CUDA: a percentage cannot be resolved
        return None


@dataclass(slots=True)
class StoreConfig:
    """Everything a `TieredStore` needs; sizes in bytes after `resolved()`."""

    host_bytes: int | str = "1GiB"
    host_slab_bytes: int | str = "64MiB"
    host_high_watermark: float = 0.90
    host_low_watermark: float = 0.80
    # past the high watermark, with a disk tier: the share of the host tier that may hold
    # blocks with no disk copy yet before the oldest are written down (to half of it)
    host_dirty_ratio: float = 0.20
    disk_path: str | None = None
    disk_bytes: int | str = "16GiB"
    disk_slab_bytes: int | str = "256MiB"
    disk_file_bytes: int | str = "4GiB"
    disk_high_watermark: float = 0.95
    disk_low_watermark: float = 0.90
    disk_codec: str = "none"            # "none" or "zstd" (byte-plane shuffled for 16-bit dtypes)
    disk_zstd_level: int = 1
    disk_direct_io: bool = True          # O_DIRECT where the filesystem allows it
    disk_admit_min_hits: int = 0         # SSD admission: demote to disk only blocks hit >= N times
    disk_io_threads: int = 4
    disk_buffer_idle_s: float = 30.0     # I/O bounce buffers unused this long go back to the system
    disk_fault_file: str = ""            # failpoints for fault tests (see tiers/disk_faults.py); off
    disk_stall_s: float = 2.0            # a disk call running longer than this: disk tier degraded
    gpu_bytes: int | str = 0             # HBM tier (0: none): bytes, or % of the device's memory
    gpu_slab_bytes: int | str = "64MiB"
    gpu_device: str = "cuda"             # torch device of the HBM tier ("cpu" only for tests)
    gpu_admit_hits: int = 1              # copy a block to the HBM tier when served after N earlier serves
    remote_url: str = ""                 # shared remote tier: redis://, rediss://, redis+cluster:// ("": none)
    remote_timeout_s: float = 0.5        # longest one remote call may take (then: degraded)
    remote_queue_blocks: int = 256       # write-behind queue: blocks waiting to be written (pinned)
    remote_codec: str = "none"           # "none" or "zstd", as on disk
    remote_write_behind: bool = True     # send every committed block to the server (else only on sync --remote)
    remote_known_s: float = 30.0         # how long a key the server had counts as there
    remote_absent_s: float = 1.0         # how long a key the server lacked counts as missing
    remote_fleet_key_file: str = ""      # a secret shared by the fleet: values carry its MAC ("" none)
    eviction_policy: str = "lru"         # "lru" or "s3fifo"
    demotion_interval_s: float = 0.5     # background pass period (also woken on high watermark)
    host_shm_path: str | None = None     # None: an anonymous memfd; else a file other processes map
    host_shm_mode: int = 0o600
    # keep the host tier's blocks across restarts: block records beside the arena, both files
    # left in place at close, and blocks found at host_shm_path at open re-verified and re-adopted
    # (needs host_shm_path and exclusive use of it: the daemon, which holds the instance lock)
    host_keep: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def resolved(self) -> "StoreConfig":
        """A copy with sizes in bytes, checked for consistency."""
        c = StoreConfig(**{f.name: getattr(self, f.name) for f in fields(self)})
        c.host_bytes = parse_size(c.host_bytes, total=total_ram_bytes(), what="host_bytes")
        if c.host_bytes < 2 * ALIGN:
            raise ConfigError(f"host_bytes: {c.host_bytes} bytes is below the 8 KiB minimum of the host tier; "
                              "raise host.bytes (--host-bytes)")
        c.host_slab_bytes = parse_size(c.host_slab_bytes, what="host_slab_bytes")
        if c.disk_path in ("", None):  # "" in a config file or flag: no disk tier
            c.disk_path = None
        if c.disk_path is not None:
            c.disk_path = os.fspath(c.disk_path)
            disk_total = None
            at = os.path.abspath(c.disk_path)
            while not os.path.isdir(at) and os.path.dirname(at) != at:
                at = os.path.dirname(at)   # the filesystem it will be made on
            try:
                st = os.statvfs(at)
                disk_total = st.f_frsize * st.f_blocks
            except OSError:
                pass
            c.disk_bytes = parse_size(c.disk_bytes, total=disk_total, what="disk_bytes")
            if c.disk_bytes < 3 * ALIGN:
                raise ConfigError(f"disk_bytes: {c.disk_bytes} bytes is below the 12 KiB minimum of the disk "
                                  "tier; raise disk.bytes (--disk-bytes), or set disk.path = \"\" for no disk tier")
        else:
            c.disk_bytes = 0
        c.gpu_bytes = parse_size(c.gpu_bytes, total=_device_bytes(c.gpu_device) if c.gpu_bytes else None,
                                 what="gpu_bytes")
        c.gpu_slab_bytes = parse_size(c.gpu_slab_bytes, what="gpu_slab_bytes")
        if c.gpu_admit_hits < 0:
            raise ConfigError("gpu_admit_hits must be >= 0")
        c.disk_slab_bytes = parse_size(c.disk_slab_bytes, what="disk_slab_bytes")
        c.disk_file_bytes = parse_size(c.disk_file_bytes, what="disk_file_bytes")
        for name in ("host_slab_bytes", "disk_slab_bytes"):
            v = getattr(c, name)
            if v < 2 * ALIGN or v % ALIGN:
                raise ConfigError(f"{name}: {v} must be a multiple of 4096 and at least 8192")
        for tier in ("host", "disk"):
            hi, lo = getattr(c, f"{tier}_high_watermark"), getattr(c, f"{tier}_low_watermark")
            if not (0.0 < lo <= hi <= 1.0):
                raise ConfigError(
                    f"{tier} watermarks: need 0 < low ({lo}) <= high ({hi}) <= 1")
        if not 0.0 < c.host_dirty_ratio <= 1.0:
            raise ConfigError(f"host_dirty_ratio: {c.host_dirty_ratio} must be in (0, 1]")
        if c.disk_codec not in ("none", "zstd"):
            raise ConfigError(f"disk_codec: {c.disk_codec!r} is not one of 'none', 'zstd'")
        if c.eviction_policy not in ("lru", "s3fifo"):
            raise ConfigError(f"eviction_policy: {c.eviction_policy!r} is not one of 'lru', 's3fifo'")
        if c.disk_admit_min_hits < 0:
            raise ConfigError("disk_admit_min_hits must be >= 0")
        if c.disk_io_threads < 1:
            raise ConfigError("disk_io_threads must be >= 1")
        if not c.disk_buffer_idle_s >= 0:
            raise ConfigError("disk_buffer_idle_s must be >= 0")
        if not c.disk_stall_s > 0:
            raise ConfigError("disk_stall_s must be > 0")
        if c.remote_codec not in ("none", "zstd"):
            raise ConfigError(f"remote_codec: {c.remote_codec!r} is not one of 'none', 'zstd'")
        if not c.remote_timeout_s > 0 or c.remote_queue_blocks < 1:
            raise ConfigError("remote_timeout_s must be > 0 and remote_queue_blocks >= 1")
        return c


# -- the daemon's settings -------------------------------------------------------------------

DEFAULT_CONFIG_PATH = "/etc/tierd/tierd.toml"


# The longest Unix socket path: sun_path holds 108 bytes on Linux, its terminating NUL included.
SOCKET_PATH_MAX = 107


def socket_path_problem(path: str) -> str | None:
    """Why `path` cannot be a Unix socket's path (None when it can): too long for sun_path."""
    n = len(os.fsencode(path))
    if n == 0:
        return "the socket path is empty: give the path of a Unix socket (e.g. /run/tierd/tierd.sock)"
    if n > SOCKET_PATH_MAX:
        return (f"socket path {path} is {n} bytes long; a Unix socket path may have at most {SOCKET_PATH_MAX} "
                f"bytes ({SOCKET_PATH_MAX + 1} with its terminating NUL, Linux's limit): choose a shorter path "
                "(e.g. /run/tierd/tierd.sock)")
    return None


def default_socket_path() -> str:
    if os.geteuid() == 0:
        return "/run/tierd/tierd.sock"
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/tierd-{os.getuid()}"
    return os.path.join(base, "tierd", "tierd.sock")


def default_arena_dir() -> str:
    """A directory of the daemon's own under /dev/shm (never /dev/shm itself, which every user
    may write: another job emptying it would take the arena with it): /dev/shm/tierd for the
    service (root, or systemd's tmpfiles.d), /dev/shm/tierd-UID for a user's own daemon."""
    return "/dev/shm/tierd" if os.geteuid() == 0 else f"/dev/shm/tierd-{os.geteuid()}"


def default_state_dir() -> str:
    if os.environ.get("STATE_DIRECTORY"):  # set by systemd's StateDirectory=
        return os.environ["STATE_DIRECTORY"].split(":")[0]
    if os.geteuid() == 0:
        return "/var/lib/tierd"
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(base, "tierd")


def _bool(v) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"expected true or false, got {v!r}")


def _ids(v) -> list[int]:
    if isinstance(v, str):
        v = [x for x in v.replace(",", " ").split() if x]
    try:
        return [int(x) for x in v]
    except (TypeError, ValueError):
        raise ConfigError(f"expected a list of numeric ids, got {v!r}") from None


def _mode(v) -> int:
    try:
        return int(v, 8) if isinstance(v, str) else int(v)
    except ValueError:
        raise ConfigError(f"expected an octal mode like 0660, got {v!r}") from None


def _listen_addr(v) -> str:
    """HOST:PORT to listen on ([::1]:PORT for IPv6; port 0: any free port), or "" for off."""
    s = str(v).strip()
    if not s:
        return ""
    host, sep, port = s.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"expected HOST:PORT with a port from 0 to 65535 (or \"\" for off), got {v!r}")
    if host.startswith("[") != host.endswith("]"):
        raise ConfigError(f"expected HOST:PORT with an IPv6 host in brackets ([::1]:9464), got {v!r}")
    return s


# TOML key -> (target, attribute, parser). target "store" is a StoreConfig field.
SERVE_KEYS: dict[str, tuple[str, str, Any]] = {
    "socket": ("serve", "socket", str),
    "socket_mode": ("serve", "socket_mode", _mode),
    "arena_dir": ("serve", "arena_dir", str),
    "metrics_addr": ("serve", "metrics_addr", _listen_addr),
    "allowed_uids": ("serve", "allowed_uids", _ids),
    "allowed_gids": ("serve", "allowed_gids", _ids),
    "operator_uids": ("serve", "operator_uids", _ids),
    "operator_gids": ("serve", "operator_gids", _ids),
    "sync_on_stop": ("serve", "sync_on_stop", _bool),
    "sync_on_stop_s": ("serve", "sync_on_stop_s", float),
    "event_loop": ("serve", "event_loop", str),
    "events_addr": ("serve", "events_addr", str),
    "events_allow_remote": ("serve", "events_allow_remote", _bool),
    "events_token_ids": ("serve", "events_token_ids", _bool),
    "host.bytes": ("store", "host_bytes", str),
    "host.slab_bytes": ("store", "host_slab_bytes", str),
    "host.high_watermark": ("store", "host_high_watermark", float),
    "host.low_watermark": ("store", "host_low_watermark", float),
    "host.dirty_ratio": ("store", "host_dirty_ratio", float),
    "host.keep": ("store", "host_keep", _bool),
    "disk.path": ("store", "disk_path", str),
    "disk.bytes": ("store", "disk_bytes", str),
    "disk.slab_bytes": ("store", "disk_slab_bytes", str),
    "disk.file_bytes": ("store", "disk_file_bytes", str),
    "disk.high_watermark": ("store", "disk_high_watermark", float),
    "disk.low_watermark": ("store", "disk_low_watermark", float),
    "disk.codec": ("store", "disk_codec", str),
    "disk.zstd_level": ("store", "disk_zstd_level", int),
    "disk.direct_io": ("store", "disk_direct_io", _bool),
    "disk.admit_min_hits": ("store", "disk_admit_min_hits", int),
    "disk.io_threads": ("store", "disk_io_threads", int),
    "disk.buffer_idle_s": ("store", "disk_buffer_idle_s", float),
    "disk.fault_file": ("store", "disk_fault_file", str),
    "disk.stall_s": ("store", "disk_stall_s", float),
    "remote.url": ("store", "remote_url", str),
    "remote.timeout_s": ("store", "remote_timeout_s", float),
    "remote.queue_blocks": ("store", "remote_queue_blocks", int),
    "remote.codec": ("store", "remote_codec", str),
    "remote.write_behind": ("store", "remote_write_behind", _bool),
    "remote.fleet_key_file": ("store", "remote_fleet_key_file", str),
    "gpu.bytes": ("store", "gpu_bytes", str),
    "gpu.slab_bytes": ("store", "gpu_slab_bytes", str),
    "gpu.device": ("store", "gpu_device", str),
    "gpu.admit_hits": ("store", "gpu_admit_hits", int),
    "policy.eviction": ("store", "eviction_policy", str),
    "limits.max_frame_bytes": ("serve", "max_frame_bytes", int),
    "limits.max_keys_per_request": ("serve", "max_keys_per_request", int),
    "limits.idle_timeout_s": ("serve", "idle_timeout_s", float),
    "limits.frame_timeout_s": ("serve", "frame_timeout_s", float),
    "limits.request_timeout_s": ("serve", "request_timeout_s", float),
    "limits.max_clients": ("serve", "max_clients", int),
    "limits.max_namespaces_per_uid": ("serve", "max_namespaces_per_uid", int),
}
# settings SIGHUP may change in a running daemon
RELOADABLE = {"host.high_watermark", "host.low_watermark", "host.dirty_ratio", "disk.high_watermark",
              "disk.low_watermark", "disk.admit_min_hits"}


@dataclass(slots=True)
class ServeConfig:
    """Settings of `tierd serve`; `sources` says where each came from."""

    socket: str = field(default_factory=default_socket_path)
    socket_mode: int = 0o660
    arena_dir: str = field(default_factory=default_arena_dir)
    metrics_addr: str = "127.0.0.1:9464"
    allowed_uids: list[int] = field(default_factory=list)
    allowed_gids: list[int] = field(default_factory=list)
    # who may run operator actions (flush, of the remote tier too): the daemon's own uid, root,
    # and these; every other allowed peer (engines) gets data operations only
    operator_uids: list[int] = field(default_factory=list)
    operator_gids: list[int] = field(default_factory=list)
    sync_on_stop: bool = True
    # how long the sync on stop may take: within what the supervisor gives a stop (systemd's
    # TimeoutStopSec, the pod's terminationGracePeriodSeconds) less the request drain (20 s)
    sync_on_stop_s: float = 60.0
    event_loop: str = "auto"           # auto: uvloop where installed, else asyncio; or either by name
    events_addr: str = ""              # ZeroMQ PUB address of KV events (tierd.events); "" off
    events_allow_remote: bool = False  # events_addr may be a non-loopback TCP address
    events_token_ids: bool = False     # events carry the blocks' prompt token ids (privacy: opt in)
    max_frame_bytes: int = 1 << 20
    max_keys_per_request: int = 4096
    idle_timeout_s: float = 0.0        # 0: an idle connection is kept (engines idle for hours)
    frame_timeout_s: float = 10.0      # a started frame must be complete within this
    request_timeout_s: float = 60.0
    max_clients: int = 1024
    max_namespaces_per_uid: int = 4096   # with blocks or in use; unused ones are forgotten first
    store: StoreConfig = field(default_factory=lambda: StoreConfig(
        host_bytes="10%", disk_path=os.path.join(default_state_dir(), "disk"), disk_bytes="4GiB",
        host_keep=True))
    sources: dict[str, str] = field(default_factory=dict)
    config_path: str | None = None


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def read_toml(path: str, data: bytes | None = None, *, implicit: bool = False) -> dict[str, Any]:
    """The settings in TOML file `path` (or in `data`, its contents already read). `implicit`:
    `path` is the default config file, read although no --config named it."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        if data is not None:
            return _flatten(tomllib.loads(data.decode()))
        with open(path, "rb") as f:
            return _flatten(tomllib.load(f))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory; pass the TOML file (--config FILE)") from None
    except PermissionError as e:
        from .access import not_admitted
        if implicit:
            # the node's daemon settings (root:tierd 0640): a user outside group tierd may not
            # read them, and a daemon or plan made without them would silently differ
            raise ConfigError(f"cannot read the default config file {path} ({e.strerror}): "
                              f"{not_admitted(path, os.R_OK)}; or pass --config FILE with settings of "
                              "your own (an empty file for the defaults)") from None
        raise ConfigError(f"config file {path}: cannot read it ({e.strerror}): {not_admitted(path, os.R_OK)}; "
                          "or pass another --config") from None
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot read it ({e.strerror or e}); pass another --config") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML ({e})") from None


# TIERD_* variables that belong to clients and tools, not to `tierd serve`.
CLIENT_ENV = frozenset({"TIERD_CONFIG", "TIERD_URL", "TIERD_DIGEST_CACHE", "TIERD_LOAD_POLICY",
                        "TIERD_SGLANG_DRAIN_S", "TIERD_SGLANG_PLUGIN", "TIERD_CACHE_DIR"})  # read by clients


def load_serve_config(config_path: str | None = None, flags: dict[str, Any] | None = None,
                      env: dict[str, str] | None = None, *, data: bytes | None = None) -> ServeConfig:
    """Defaults < config file < TIERD_* environment < command-line flags. Unknown keys in any
    layer are errors, so a typo never silently does nothing. `data`: the config file's
    contents, already read (the daemon reads it without blocking its event loop)."""
    cfg = ServeConfig()
    env = os.environ if env is None else env
    layers: list[tuple[str, dict[str, Any]]] = []
    implicit = False
    if config_path is None:
        # the default file where there is one; one this user may not even see (its directory
        # does not admit it) is there too: refused below, never skipped silently
        try:
            os.stat(DEFAULT_CONFIG_PATH)
        except PermissionError:
            config_path, implicit = DEFAULT_CONFIG_PATH, True
        except OSError:
            pass
        else:
            config_path, implicit = DEFAULT_CONFIG_PATH, True
    if config_path is not None:
        layers.append((f"file {config_path}", read_toml(config_path, data, implicit=implicit)))
        cfg.config_path = config_path
    env_layer = {}
    for name, value in env.items():
        if name.startswith("TIERD_") and name not in CLIENT_ENV:
            key = name[len("TIERD_"):].lower()
            key = next((k for k in SERVE_KEYS if k.replace(".", "_") == key), None)
            if key is None:
                raise ConfigError(f"environment variable {name} names no setting; "
                                  f"known: {', '.join('TIERD_' + k.replace('.', '_').upper() for k in SERVE_KEYS)}")
            env_layer[key] = value
    layers.append(("environment", env_layer))
    layers.append(("command line", {k: v for k, v in (flags or {}).items() if v is not None}))
    for key in SERVE_KEYS:
        cfg.sources[key] = "default"
    for source, values in layers:
        for key, value in values.items():
            if key not in SERVE_KEYS:
                raise ConfigError(f"{source}: unknown setting {key!r}; known: {', '.join(SERVE_KEYS)}")
            target, attr, parse = SERVE_KEYS[key]
            try:
                parsed = parse(value)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"{source}: {key} = {value!r}: {e}") from None
            setattr(cfg.store if target == "store" else cfg, attr, parsed)
            cfg.sources[key] = source
    if not cfg.sync_on_stop_s > 0:
        raise ConfigError(f"sync_on_stop_s = {cfg.sync_on_stop_s}: give the seconds a stop's sync may take, above 0")
    if cfg.max_frame_bytes < 1024 or cfg.max_keys_per_request < 1:
        raise ConfigError("limits: max_frame_bytes must be >= 1024 and max_keys_per_request >= 1")
    cfg.store.resolved()  # validate now, with the source of the error in the message
    return cfg


def setting_value(cfg: ServeConfig, key: str):
    target, attr, _ = SERVE_KEYS[key]
    return getattr(cfg.store if target == "store" else cfg, attr)
