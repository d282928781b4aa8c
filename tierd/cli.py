"""The `tierd` command: serve, stats, flush, sync, ping, size.

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

from . import __version__
from .config import default_socket_path, format_size, parse_size, total_ram_bytes
from .errors import TierdError
from .report import format_stats, table


def _socket_default() -> str:
    return os.environ.get("TIERD_SOCKET") or default_socket_path()


def _client(args):
    from .client import Client
    return Client(args.socket, name="tierd-cli")


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
            time.sleep(args.watch)


def cmd_flush(args) -> int:
    what = f"tier {args.tier}" + (f", namespace {args.namespace}" if args.namespace else ", all namespaces")
    if not args.yes and sys.stdin.isatty():
        answer = input(f"Drop every block of {what} from the daemon at {args.socket}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing dropped")
            return 1
    with _client(args) as c:
        n = c.flush(tier=args.tier, namespace=args.namespace)
    print(f"dropped {n} blocks ({what})")
    return 0


def cmd_sync(args) -> int:
    tty = sys.stdout.isatty()
    total_written = 0
    with _client(args) as c:
        if not tty:
            total_written = c.sync()
        else:
            remaining = None
            while True:
                written, remaining = c.sync_step(256)
                total_written += written
                done = total_written / max(1, total_written + remaining)
                bar = "#" * int(30 * done)
                print(f"\rsync [{bar:<30}] {total_written} written, {remaining} to go", end="", flush=True)
                if remaining == 0 or written == 0:
                    break
            print()
    print(f"synced: {total_written} blocks written to disk durably")
    if args.remote:
        with _client(args) as c:
            pushed, pending = c.push_remote()
        print(f"remote: {pushed} blocks sent to the shared tier" + (f", {pending} still queued" if pending else ""))
    return 0


def cmd_ping(args) -> int:
    with _client(args) as c:
        r = c.ping()
    print(f"tierd {r['version']} at {args.socket}: {r['rtt_s'] * 1e6:.0f} us")
    return 0


def cmd_size(args) -> int:
    """KV memory planning for a model directory; needs no daemon."""
    from .arena import plan_slabs, slot_bytes_for
    from .namespace import Namespace, read_model_config
    cfg = read_model_config(args.model)
    ns = Namespace.from_model_dir(args.model, kv_dtype=args.kv_dtype, block_tokens=args.block_tokens,
                                  revision="size-only", tp_size=args.tp)
    max_len = args.max_seq_len or int(cfg.get("max_position_embeddings") or 4096)
    per_token = ns.bytes_per_token
    heads = int(cfg.get("num_attention_heads", ns.num_kv_heads))
    print(f"model {args.model}: {ns.num_layers} layers, {heads} query heads, "
          f"{ns.num_kv_heads * args.tp} KV heads ({'GQA' if ns.num_kv_heads * args.tp < heads else 'MHA'}), "
          f"head_dim {ns.head_dim}, KV dtype {ns.kv_dtype}" + (f", per TP rank of {args.tp}" if args.tp > 1 else ""))
    print(f"KV bytes per token = layers x 2 x kv_heads x head_dim x bytes = {ns.num_layers} x 2 x "
          f"{ns.num_kv_heads} x {ns.head_dim} x {ns.dtype_bytes} = {per_token} ({format_size(per_token)})")
    rows = [["per token", "1", format_size(per_token)],
            ["per request", f"{max_len} tokens", format_size(per_token * max_len)],
            ["per batch", f"{args.batch} x {max_len} tokens", format_size(per_token * max_len * args.batch)],
            [f"tier block ({ns.block_tokens} tokens)", "", format_size(ns.block_bytes)]]
    print(table(rows, ["", "size", "KV bytes"]))
    tiers = []
    for name, size, slab in (("host", args.host_bytes, 64 << 20), ("disk", args.disk_bytes, 256 << 20)):
        total = parse_size(size, total=total_ram_bytes() if name == "host" else None, what=f"{name} bytes")
        slot = slot_bytes_for(ns.block_bytes) + (4096 if name == "disk" else 0)
        slab = max(slab, slot + 4096)
        n_slabs, slab = plan_slabs(total, slab, name)
        usable = slab - (4096 if name == "disk" else 0)
        blocks = n_slabs * (usable // slot) if slot <= usable else 0
        tokens = blocks * ns.block_tokens
        tiers.append([name, format_size(total), str(blocks), f"{tokens:,}", f"{tokens / max_len:,.1f}"])
    if args.remote_bytes:
        # a value is a hash of the slot header and the payload; Redis adds its own per-key overhead
        total = parse_size(args.remote_bytes, what="remote bytes")
        per_value = ns.block_bytes + 112 + REDIS_VALUE_OVERHEAD
        blocks = total // per_value
        tokens = blocks * ns.block_tokens
        tiers.append(["remote (shared)", format_size(total), str(blocks), f"{tokens:,}", f"{tokens / max_len:,.1f}"])
    print(table(tiers, ["tier", "capacity", "blocks", "tokens", "full requests"]))
    return 0


REDIS_VALUE_OVERHEAD = 256   # bytes per value besides header and payload: key, hash, allocator (estimate)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tierd", description="Tiered KV-cache daemon for LLM inference.")
    ap.add_argument("--version", action="version", version=f"tierd {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    def client_cmd(name, help_, fn):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--socket", default=_socket_default(), help="daemon socket (default %(default)s)")
        p.set_defaults(fn=fn)
        return p

    p = sub.add_parser("serve", help="run the daemon")
    p.add_argument("--config", help="TOML config (default /etc/tierd/tierd.toml when present)")
    p.add_argument("--socket", help="Unix socket path")
    p.add_argument("--host-bytes", help="host tier size: 64GiB, 512MiB or 10%% of RAM")
    p.add_argument("--disk-path", help="disk tier directory")
    p.add_argument("--disk-bytes", help="disk tier size cap: 100GiB or 10%% of the filesystem")
    p.add_argument("--metrics-addr", help="Prometheus endpoint HOST:PORT ('' to disable)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(fn=cmd_serve)

    p = client_cmd("stats", "show tiers, namespaces and clients", cmd_stats)
    p.add_argument("--json", action="store_true", help="machine-readable output (docs/operations.md)")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS")
    p = client_cmd("flush", "drop blocks", cmd_flush)
    p.add_argument("--tier", default="all", choices=["gpu", "host", "disk", "remote", "all"],
                   help="all: this node's tiers; remote (shared with other nodes) only by name")
    p.add_argument("--namespace", help="only this namespace (name from `tierd stats`)")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p = client_cmd("sync", "write host blocks to disk so a restart keeps them", cmd_sync)
    p.add_argument("--remote", action="store_true",
                   help="also send the remote tier every host block it lacks (before draining a node)")
    client_cmd("ping", "check that the daemon answers", cmd_ping)

    p = sub.add_parser("size", help="KV memory planning for a model (no daemon needed)")
    p.add_argument("--model", required=True, help="model directory (config.json)")
    p.add_argument("--max-seq-len", type=int, help="tokens per request (default: max_position_embeddings)")
    p.add_argument("--batch", type=int, default=1, help="requests in a batch (default 1)")
    p.add_argument("--kv-dtype", default="auto", help="KV dtype: auto (from config), fp16, bf16, fp8, fp32")
    p.add_argument("--block-tokens", type=int, default=256, help="tokens per tier block (default 256)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (per-rank figures)")
    p.add_argument("--host-bytes", default="10%", help="host tier size (default 10%% of RAM)")
    p.add_argument("--disk-bytes", default="4GiB", help="disk tier size (default 4GiB)")
    p.add_argument("--remote-bytes", default="", help="the shared remote tier's maxmemory (e.g. 512GiB)")
    p.set_defaults(fn=cmd_size)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args) or 0
    except KeyboardInterrupt:
        return 130
    except (TierdError, OSError) as e:
        print(f"tierd {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
