"""The `tierd` command: serve, stats, flush, sync, ping, clean, size.

Every client command takes --socket; an unreachable daemon or any other error prints one line
on stderr and exits 1 (2 for usage errors). This module parses arguments and formats output;
the work is done by the server, the client and the store.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from .version import version_string
from .config import ALIGN, default_socket_path, format_size, parse_size, socket_path_problem
from .errors import ConfigError, TierdError
from .report import format_stats, table


class UsageError(TierdError):
    """A command used in a way it refuses (exit status 2)."""


SYSTEM_SOCKET = "/run/tierd/tierd.sock"   # the service's (systemd/tierd.toml, deploy/kubernetes)


def _socket_default() -> str:
    """TIERD_SOCKET, else the node's daemon where there is one (whoever runs the command: an
    engine user in group tierd too), else this user's own daemon's socket. A node's socket
    directory that this user may not search counts as there when this user has no daemon of its
    own: connecting to it then says which directory keeps the user out, and the fix."""
    if os.environ.get("TIERD_SOCKET"):
        return os.environ["TIERD_SOCKET"]
    own = default_socket_path()
    if own == SYSTEM_SOCKET or os.path.exists(own):
        return own
    try:
        os.stat(SYSTEM_SOCKET)
    except PermissionError:
        return SYSTEM_SOCKET
    except OSError:
        return own
    return SYSTEM_SOCKET


def _client(args):
    """A control client: it maps nothing of the daemon's (a daemon whose arena cannot be mapped
    here still answers), and waits at most --timeout where the command has one."""
    from .client import Client
    timeout = getattr(args, "timeout", None)
    if timeout is None:
        return Client(args.socket, name="tierd-cli", data_plane=False)
    return Client(args.socket, name="tierd-cli", data_plane=False, timeout_s=timeout,
                  connect_timeout_s=min(5.0, timeout), retries=0)


def cmd_serve(args) -> int:
    from .server import serve
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    flags = {"socket": args.socket, "host.bytes": args.host_bytes, "disk.path": args.disk_path,
             "disk.bytes": args.disk_bytes, "metrics_addr": args.metrics_addr}
    return serve(args.config, flags)


def _format_daemon(st: dict) -> str:
    d = st.get("daemon", {})
    lines = [f"tierd {d.get('version', '?')} pid {d.get('pid', '?')} on {d.get('socket', '?')}, "
             f"up {d.get('uptime_s', 0):.0f}s, {d.get('clients', 0)} clients "
             f"({d.get('connections_total', 0)} connections, {d.get('requests', 0)} requests, "
             f"{d.get('bad_requests', 0)} bad, {d.get('refused_peers', 0)} refused)",
             f"reclaimed from departed clients: {d.get('reclaimed_leases', 0)} leases, "
             f"{d.get('reclaimed_reservations', 0)} reservations"]
    clients = d.get("client_list") or []
    if clients:
        lines.append(table([[str(c["id"]), str(c["pid"]), str(c["uid"]), c["name"] or "-", str(c["ops"])]
                            for c in clients], ["client", "pid", "uid", "name", "ops"]))
    return "\n".join(lines)


def cmd_stats(args) -> int:
    with _client(args) as c:
        while True:
            st = c.stats()
            if args.json:
                print(json.dumps(st, indent=2, sort_keys=True))
            else:
                if args.watch:
                    print("\x1b[H\x1b[2J", end="")
                print(_format_daemon(st))
                print()
                print(format_stats(st))
            if not args.watch:
                return 0
            sys.stdout.flush()
            if getattr(sys.stdout, "reader_gone", False):
                return 0   # (nobody reads on: `tierd stats --watch 2 | head`)
            time.sleep(args.watch)


def cmd_flush(args) -> int:
    what = f"tier {args.tier}" + (f", namespace {args.namespace}" if args.namespace else ", all namespaces")
    if not args.yes:
        if not sys.stdin.isatty():
            raise UsageError(f"flush drops every block of {what} and asks first; with no terminal to ask "
                             "on, pass --yes")
        answer = input(f"Drop every block of {what} from the daemon at {args.socket}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing dropped")
            return 1
    with _client(args) as c:
        n = c.flush(tier=args.tier, namespace=args.namespace)
    print(f"dropped {n} blocks ({what})")
    return 0


def cmd_sync(args) -> int:
    """Write every host-only block down to disk durably. Exit 0 only when all that were there
    when it began are on disk (the daemon's full `sync` fails, naming how many are not, when
    the disk cannot take them); on a terminal, bounded steps draw progress first."""
    tty = sys.stdout.isatty()
    total_written = 0
    with _client(args) as c:
        if args.remote and "remote" not in c.stats().get("tiers", {}):
            raise ConfigError(f"the daemon at {args.socket} has no remote tier ([remote] url): --remote has "
                              "nowhere to send blocks; nothing was done")
        if tty:
            # progress: steps of 256 until what was there at the start is written (blocks put
            # meanwhile do not keep it going), or a step writes nothing
            target = None
            try:
                while True:
                    written, remaining = c.sync_step(256)
                    total_written += written
                    target = total_written + remaining if target is None else target
                    done = total_written / max(1, total_written + remaining)
                    bar = "#" * int(30 * done)
                    print(f"\rsync [{bar:<30}] {total_written} written, {remaining} to go", end="", flush=True)
                    if remaining == 0 or written == 0 or total_written >= target:
                        break
            finally:
                print()   # (a failure's line goes below the bar)
        # the full sync answers for every block: it returns only once all that were there
        # before it are on disk, else fails with the reason (one line, exit 1)
        total_written += c.sync()
    print(f"synced: {total_written} blocks written to disk durably")
    if args.remote:
        with _client(args) as c:
            pushed, pending = c.push_remote()
            remote = c.stats().get("tiers", {}).get("remote", {})
        print(f"remote: {pushed} blocks sent to the shared tier" + (f", {pending} still queued" if pending else ""))
        if remote.get("degraded") or pending:
            # a drained node must not look handed off when its blocks did not reach the fleet
            state = f"degraded ({remote['degraded']})" if remote.get("degraded") else "behind"
            print(f"tierd sync: the remote tier is {state}: {pending} blocks still queued, not sent",
                  file=sys.stderr)
            return 1
    return 0


def cmd_clean(args) -> int:
    """List, then remove, the host arenas of daemons that are not running."""
    from . import leftovers
    from .config import load_serve_config
    named = list(args.arena_dir or [])
    dirs = list(named)
    if not dirs or args.config:
        dirs.insert(0, load_serve_config(args.config).arena_dir)
    for d in dirs:
        try:
            os.listdir(d)
        except (FileNotFoundError, NotADirectoryError):
            if d in named:   # a directory named on the command line must be there (a typo lists nothing)
                raise TierdError(f"--arena-dir {d}: " + ("not a directory" if os.path.exists(d) else "no such directory")
                                 + "; name the arena_dir of the daemon's config (or pass its --config), or leave "
                                   "--arena-dir out for the default") from None
            # (the configured arena_dir of a daemon that never ran: nothing to clean)
        except OSError as e:
            raise TierdError(f"arena_dir {d}: cannot list it ({e.strerror or e}; uid {os.geteuid()}); run "
                             "`tierd clean` as root or as the daemon's user (sudo tierd clean)") from None
    found = leftovers.find(dirs)
    rows = [[g.base, str(g.uid), str(len(g.files)), format_size(g.bytes), g.live_because or "not running"]
            for g in found]
    stale = [g for g in found if not g.live]
    if not found:
        print(f"no tierd arenas in {', '.join(dirs)}")
        return 0
    print(table(rows, ["arena", "uid", "files", "memory", "state"]))
    if not stale or args.list:
        return 0
    total = sum(g.bytes for g in stale)
    if not args.yes:
        if not sys.stdin.isatty():
            raise UsageError(f"{len(stale)} arenas of stopped daemons ({format_size(total)}) would be removed and "
                             "their blocks lost; with no terminal to ask on, pass --yes (or --list to only list)")
        answer = input(f"Remove {len(stale)} arenas of stopped daemons ({format_size(total)}); a daemon started "
                       "on them later starts with an empty host tier. [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return 1
    failed = 0
    for g in stale:
        try:
            gone = leftovers.remove(g)
        except (RuntimeError, OSError) as e:
            print(f"tierd clean: kept {g.base}: {e}", file=sys.stderr)
            failed += 1
            continue
        print(f"removed {g.base} ({len(gone)} files)")
    print(f"freed {format_size(total)}" if not failed else f"{failed} arenas could not be removed")
    return 1 if failed else 0


def cmd_ping(args) -> int:
    with _client(args) as c:
        r = c.ping()
    print(f"tierd {r['version']} at {args.socket}: {r['rtt_s'] * 1e6:.0f} us")
    return 0


def kv_plan(cfg: dict, *, tp: int = 1, kv_dtype: str = "auto", block_tokens: int = 256) -> dict:
    """What the connectors store per token of a model (its config.json as read by
    `read_model_config`), at tensor-parallel size `tp`: the layout, the bytes one rank's
    namespace holds per token, and how many ranks store their own copy.

    - Full attention (Llama-like): K and V of every KV head, `layers x 2 x kv_heads x head_dim x
      bytes`, split across ranks: each rank stores `kv_heads / tp` heads (one head, replicated,
      where tp exceeds the KV heads, as engines do; other splits engines refuse).
    - MLA (DeepSeek-V2/V3-like: `kv_lora_rank` in the config): one latent row per token,
      `layers x (kv_lora_rank + qk_rope_head_dim) x bytes`, the same on every rank, so stored
      once for all of them."""
    from .namespace import DTYPE_BYTES, canonical_dtype
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg.get("num_attention_heads") or 1)
    if kv_dtype == "auto":
        kv_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float16"
    dtype = canonical_dtype(kv_dtype)
    nbytes = DTYPE_BYTES[dtype]
    if tp < 1:
        raise TierdError(f"--tp {tp}: must be at least 1")
    if cfg.get("kv_lora_rank"):
        latent = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
        return {"layout": "mla", "layers": layers, "heads": heads, "kv_heads": 1, "kv_heads_per_rank": 1,
                "head_dim": latent, "planes": 1, "dtype": dtype, "dtype_bytes": nbytes, "copies": 1,
                "bytes_per_token_rank": layers * latent * nbytes,
                "formula": f"layers x (kv_lora_rank + rope dims) x bytes = {layers} x {latent} x {nbytes}",
                "tp": tp, "block_tokens": block_tokens}
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    if kv_heads % tp == 0:
        per_rank = kv_heads // tp
    elif tp % kv_heads == 0:
        per_rank = 1                     # each head replicated on tp / kv_heads ranks
    else:
        raise TierdError(f"--tp {tp} splits neither {kv_heads} KV heads evenly nor replicates them evenly; "
                         "engines refuse that tensor-parallel size for this model")
    return {"layout": "gqa" if kv_heads < heads else "mha", "layers": layers, "heads": heads,
            "kv_heads": kv_heads, "kv_heads_per_rank": per_rank, "head_dim": head_dim, "planes": 2,
            "dtype": dtype, "dtype_bytes": nbytes, "copies": tp,
            "bytes_per_token_rank": layers * 2 * per_rank * head_dim * nbytes,
            "formula": f"layers x 2 x kv_heads{' per rank' if tp > 1 else ''} x head_dim x bytes = "
                       f"{layers} x 2 x {per_rank} x {head_dim} x {nbytes}",
            "tp": tp, "block_tokens": block_tokens}


def cmd_size(args) -> int:
    """KV memory planning for a model directory; needs no daemon. Tier sizes and slab sizes
    come from the same settings `tierd serve` reads (its config file, TIERD_* variables,
    defaults), unless given here."""
    from .arena import plan_slabs, slot_bytes_for
    from .config import load_serve_config
    from .namespace import read_model_config
    cfg = read_model_config(args.model)
    try:
        plan = kv_plan(cfg, tp=args.tp, kv_dtype=args.kv_dtype, block_tokens=args.block_tokens)
    except KeyError as e:
        raise TierdError(f"{args.model}/config.json: {e.args[0]} is missing") from None
    serve = load_serve_config(args.config, {"host.bytes": args.host_bytes, "disk.bytes": args.disk_bytes})
    store = serve.store.resolved()   # sizes in bytes, as the daemon reads them (10%: of RAM, of the disk)
    max_len = args.max_seq_len or int(cfg.get("max_position_embeddings") or 4096)
    per_rank = plan["bytes_per_token_rank"]
    per_token = per_rank * plan["copies"]          # every rank's share: what one token costs a tier
    block_bytes = per_rank * args.block_tokens     # one tier block: one rank's namespace
    tp = args.tp
    if plan["layout"] == "mla":
        what = (f"MLA: latent of {plan['head_dim']} per token (kv_lora_rank + rope dims), "
                f"{plan['heads']} query heads" + (f"; the same on all {tp} TP ranks, stored once" if tp > 1 else ""))
    else:
        what = (f"{plan['heads']} query heads, {plan['kv_heads']} KV heads ({plan['layout'].upper()}), head_dim "
                f"{plan['head_dim']}" + (f"; {plan['kv_heads_per_rank']} KV heads per rank of TP {tp}"
                                          + (" (replicated)" if tp > plan["kv_heads"] else "") if tp > 1 else ""))
    out = {"model": args.model, **plan, "bytes_per_token": per_token, "block_bytes": block_bytes,
           "max_seq_len": max_len, "batch": args.batch, "tiers": []}
    lines = [f"model {args.model}: {plan['layers']} layers, {what}, KV dtype {plan['dtype']}",
             f"KV bytes per token{' per rank' if plan['copies'] > 1 else ''} = {plan['formula']} = {per_rank} "
             f"({format_size(per_rank)})" + (f"; x {plan['copies']} ranks = {per_token} ({format_size(per_token)})"
                                              if plan["copies"] > 1 else "")]
    rows = [["per token", "1", format_size(per_token)],
            ["per request", f"{max_len} tokens", format_size(per_token * max_len)],
            ["per batch", f"{args.batch} x {max_len} tokens", format_size(per_token * max_len * args.batch)],
            [f"tier block ({args.block_tokens} tokens{', one rank' if plan['copies'] > 1 else ''})", "",
             format_size(block_bytes)]]
    tiers = []
    for name, total, slab, source in (("host", store.host_bytes, store.host_slab_bytes, serve.sources["host.bytes"]),
                                      ("disk", store.disk_bytes, store.disk_slab_bytes, serve.sources["disk.bytes"])):
        if not total:   # no disk tier (disk.path ""; the host tier is never empty: config.py)
            tiers.append([f"{name} ({serve.sources['disk.path']}: none)", "0B", "0", "0", "0"])
            out["tiers"].append({"tier": name, "capacity_bytes": 0, "blocks": 0, "tokens": 0,
                                 "source": serve.sources["disk.path"]})
            continue
        slot = slot_bytes_for(block_bytes) + (4096 if name == "disk" else 0)
        slab = max(slab, slot + 4096)
        n_slabs, slab = plan_slabs(total, slab, name)
        usable = slab - (4096 if name == "disk" else 0)
        blocks = n_slabs * (usable // slot) if slot <= usable else 0
        tokens = blocks * args.block_tokens // plan["copies"]   # a token needs one block slot per copy
        tiers.append([f"{name} ({source})", format_size(total), str(blocks), f"{tokens:,}", f"{tokens / max_len:,.1f}"])
        out["tiers"].append({"tier": name, "capacity_bytes": total, "blocks": blocks, "tokens": tokens,
                             "source": source})
    if args.remote_bytes:
        # a value is a hash of the slot header and the payload; Redis adds its own per-key overhead
        total = parse_size(args.remote_bytes, what="remote bytes")
        per_value = block_bytes + 112 + REDIS_VALUE_OVERHEAD
        blocks = total // per_value
        tokens = blocks * args.block_tokens // plan["copies"]
        tiers.append(["remote (shared)", format_size(total), str(blocks), f"{tokens:,}", f"{tokens / max_len:,.1f}"])
        out["tiers"].append({"tier": "remote", "capacity_bytes": total, "blocks": blocks, "tokens": tokens,
                             "source": "command line"})
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print("\n".join(lines))
    print(table(rows, ["", "size", "KV bytes"]))
    print(table(tiers, ["tier (size from)", "capacity", "blocks", "tokens", "full requests"]))
    return 0


REDIS_VALUE_OVERHEAD = 256   # bytes per value besides header and payload: key, hash, allocator (estimate)


def _positive_seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of seconds above 0")
    return v


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of at least 1")
    return v


def _size_arg(*, percent: bool, minimum: int = 1):
    """An argparse type: a size such as 64GiB (or, where `percent`, 10%), at least `minimum`
    bytes; the text itself is kept (a percentage is resolved where its total is known)."""
    def parse(text: str) -> str:
        try:
            # (a percentage is checked against a large total here: 0% and 0.0001% are refused)
            n = parse_size(text, total=1 << 50 if percent else None, what="size")
        except ConfigError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {str(e).removeprefix('size: ')}") from None
        if n < minimum:
            least = "above 0" if minimum == 1 else f"of at least {format_size(minimum)}"
            raise argparse.ArgumentTypeError(f"{text!r}: give a size {least}, e.g. "
                                             + ("64GiB or 10%" if percent else "512GiB"))
        return text
    return parse


def _socket_arg(text: str) -> str:
    problem = socket_path_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


class _Parser(argparse.ArgumentParser):
    """Argument errors in one line (`tierd size: argument --batch: ...`), exit status 2, as every
    other error of the command (docs/troubleshooting.md); the usage is one --help away."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="tierd", description="Tiered KV-cache daemon for LLM inference.")
    ap.add_argument("--version", action="version", version=f"tierd {version_string()}")
    sub = ap.add_subparsers(dest="command", required=True)

    def client_cmd(name, help_, fn, timeout: float | None = None):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--socket", type=_socket_arg, default=_socket_default(),
                       help="daemon socket (default %(default)s)")
        if timeout is not None:
            p.add_argument("--timeout", type=_positive_seconds, default=timeout, metavar="SECONDS",
                           help="how long to wait for the daemon's answer (default %(default)s)")
        p.set_defaults(fn=fn)
        return p

    p = sub.add_parser("serve", help="run the daemon")
    p.add_argument("--config", help="TOML config (default /etc/tierd/tierd.toml when present)")
    p.add_argument("--socket", type=_socket_arg, help="Unix socket path")
    p.add_argument("--host-bytes", type=_size_arg(percent=True, minimum=2 * ALIGN),
                   help="host tier size: 64GiB, 512MiB or 10%% of RAM")
    p.add_argument("--disk-path", help="disk tier directory ('' for no disk tier)")
    p.add_argument("--disk-bytes", type=_size_arg(percent=True, minimum=3 * ALIGN),
                   help="disk tier size cap: 100GiB or 10%% of the filesystem")
    p.add_argument("--metrics-addr", help="Prometheus endpoint HOST:PORT ('' to disable)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(fn=cmd_serve)

    p = client_cmd("stats", "show tiers, namespaces and clients", cmd_stats, timeout=10.0)
    p.add_argument("--json", action="store_true", help="machine-readable output (docs/operations.md)")
    p.add_argument("--watch", type=_positive_seconds, metavar="SECONDS", help="refresh every SECONDS")
    p = client_cmd("flush", "drop blocks", cmd_flush)
    p.add_argument("--tier", default="all", choices=["gpu", "host", "disk", "remote", "all"],
                   help="all: this node's tiers; remote (shared with other nodes) only by name")
    p.add_argument("--namespace", help="only this namespace (name from `tierd stats`)")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p = client_cmd("sync", "write host blocks to disk so a restart keeps them", cmd_sync)
    p.add_argument("--remote", action="store_true",
                   help="also send the remote tier every host block it lacks (before draining a node)")
    client_cmd("ping", "check that the daemon answers", cmd_ping, timeout=5.0)
    p = sub.add_parser("clean", help="remove the host arenas of daemons that are not running")
    p.add_argument("--config", help="TOML config whose arena_dir to look in (default /etc/tierd/tierd.toml "
                   "when present, else the default arena_dir)")
    p.add_argument("--arena-dir", action="append", help="also look in this directory (repeatable)")
    p.add_argument("--list", action="store_true", help="only list what is there")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.set_defaults(fn=cmd_clean)

    p = sub.add_parser("size", help="KV memory planning for a model (no daemon needed)")
    p.add_argument("--model", required=True, help="model directory (config.json)")
    p.add_argument("--max-seq-len", type=_positive_int,
                   help="tokens per request (default: max_position_embeddings)")
    p.add_argument("--batch", type=_positive_int, default=1, help="requests in a batch (default 1)")
    p.add_argument("--kv-dtype", default="auto", help="KV dtype: auto (from config), fp16, bf16, fp8, fp32")
    p.add_argument("--block-tokens", type=_positive_int, default=256,
                   help="tokens per tier block: the vLLM connector's block_tokens (default 256); for SGLang "
                        "its page size (--page-size), which is its tier block")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size: each rank stores its share")
    p.add_argument("--config", help="the daemon's TOML config, for tier sizes (default: what `tierd serve` "
                   "reads: /etc/tierd/tierd.toml when present, TIERD_* variables, its defaults)")
    p.add_argument("--host-bytes", type=_size_arg(percent=True, minimum=2 * ALIGN),
                   help="host tier size (default: the daemon's setting)")
    p.add_argument("--disk-bytes", type=_size_arg(percent=True, minimum=3 * ALIGN),
                   help="disk tier size (default: the daemon's setting)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--remote-bytes", type=_size_arg(percent=False),
                   help="the shared remote tier's maxmemory (e.g. 512GiB)")
    p.set_defaults(fn=cmd_size)
    ap.subcommands = sub.choices   # (main: a command's unknown options are that command's error)
    return ap


class _Output:
    """The command's stdout. Once its reader has gone (`tierd stats | head -3`: EPIPE), what is
    printed goes to /dev/null, quietly, as the Python documentation advises for SIGPIPE, and the
    command's work goes on: a reader that stopped early never cuts a sync, flush or clean short,
    nor changes the exit status (`stats --watch`, whose only work is output, stops)."""

    def __init__(self, out):
        self._out = out
        self.reader_gone = False

    def write(self, text: str) -> int:
        try:
            return self._out.write(text)
        except BrokenPipeError:
            self._gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._out.flush()
        except BrokenPipeError:
            self._gone()

    def _gone(self) -> None:
        self.reader_gone = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._out.fileno())   # (what is still buffered is flushed there)
        finally:
            os.close(devnull)

    def __getattr__(self, name):
        return getattr(self._out, name)


def main(argv: list[str] | None = None) -> int:
    """Run one command. Its errors print one line, `tierd COMMAND: message`, and exit 1 (2 for
    usage errors, argparse's included); a reader of stdout that stops early (`| head`) is no
    error (`_Output`)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.subcommands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")

    def fail(e: BaseException, status: int) -> int:
        msg = str(e)
        # a daemon's message that names the operation already ("flush: unknown namespace ...")
        msg = msg.removeprefix(f"{args.command}: ")
        print(f"tierd {args.command}: {msg}", file=sys.stderr)
        return status

    out = sys.stdout
    if out is not None and not isinstance(out, _Output):
        sys.stdout = _Output(out)
    try:
        status = args.fn(args) or 0
        sys.stdout.flush()   # (a reader gone shows here, not at the interpreter's exit)
        return status
    except KeyboardInterrupt:
        return 130
    except UsageError as e:
        return fail(e, 2)
    except (TierdError, OSError) as e:
        return fail(e, 1)
    finally:
        sys.stdout = out


if __name__ == "__main__":
    sys.exit(main())
