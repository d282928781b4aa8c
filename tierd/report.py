"""Human-readable rendering of `TieredStore.stats()`: aligned tables an operator can read at
3 a.m. Pure formatting; never queries a store."""

from __future__ import annotations

from .config import format_size


def table(rows: list[list[str]], header: list[str]) -> str:
    cols = [header] + rows
    widths = [max(len(str(r[i])) for r in cols) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) if i else str(c).ljust(w)  # noqa: E731
                               for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def format_stats(stats: dict) -> str:
    tiers = stats["tiers"]
    rows = []
    for name, t in tiers.items():
        if name == "remote":   # no slots: its own lines below
            continue
        rows.append([name, format_size(t["capacity_bytes"]), format_size(t["used_bytes"]),
                     f"{100 * t['used_bytes'] / max(1, t['capacity_bytes']):.1f}%", str(t["blocks"]),
                     str(t["evictions"]), str(t["demotions"]), str(t["promotions"]),
                     f"{100 * t['waste_ratio']:.1f}%", str(t["corrupt_dropped"])])
    out = [table(rows, ["tier", "capacity", "used", "used%", "blocks", "evicted", "demoted",
                        "promoted", "waste", "corrupt"])]
    ns_rows = []
    for name, n in stats["namespaces"].items():
        d = n.get("description") or {}
        layout = (f"{d.get('kv_dtype', '?')} L{d.get('num_layers', '?')} H{d.get('num_kv_heads', '?')} "
                  f"D{d.get('head_dim', '?')} T{d.get('block_tokens', '?')}") if d else "(unregistered)"
        model = n.get("label") or (f"model {d['model'][:12]}" if d.get("model") else "?")
        if d.get("cache_salt"):
            model += f" (salt {d['cache_salt'].removeprefix('digest:')})"
        if d.get("tp_size", 1) > 1:
            model += f" tp{d.get('tp_rank', 0)}/{d['tp_size']}"
        ns_rows.append([name, model, layout, format_size(n["block_bytes"]), str(n["host_blocks"]),
                        str(n["disk_blocks"]), str(n["hits"]), str(n["misses"]),
                        f"{100 * n['hit_rate']:.1f}%", str(n["puts"]), str(n["put_dropped"])])
    if ns_rows:
        out.append(table(ns_rows, ["namespace", "model", "layout", "block", "host", "disk", "hits", "misses",
                                   "hit rate", "puts", "dropped"]))
    if "costs" in stats:
        out.extend(format_costs(stats["costs"], tiers))
    remote = tiers.get("remote")
    disk = tiers.get("disk")
    extra = [f"policy {stats['policy']}", f"leases {stats['leases']}",
             f"reservations {stats['reservations']}"]
    host = tiers.get("host", {})
    if "adopted_blocks" in host:
        extra.append(f"host blocks kept across restarts: {host['adopted_blocks']} re-adopted at start "
                     f"({format_size(host['adopted_bytes'])} in {host['adopt_seconds']:.2f}s, "
                     f"{host['adopt_dropped']} dropped), {host['keep_pending']} not yet recorded")
    if disk:
        extra += [f"disk {disk['path']} ({'O_DIRECT' if disk['direct_io'] else 'buffered'}, "
                  f"codec {disk['codec']}, index from {disk['recovered_from']}, "
                  f"{format_size(disk.get('io_buffer_bytes', 0))} of I/O buffers)",
                  f"ssd admission rejected {disk['admission_rejected']}, io errors {disk['io_errors']}"]
        if disk.get("degraded"):
            extra.append(f"DISK TIER DEGRADED for {disk['degraded_seconds']:.0f}s: {disk['degraded']} "
                         "(serving from host RAM only)")
    if remote:
        extra += [f"remote {remote['url']}{' (cluster)' if remote['cluster'] else ''}: "
                  f"{format_size(remote['used_bytes'])} used of {format_size(remote['capacity_bytes'])}, "
                  f"hits {remote['hits']}, misses {remote['misses']}, writes {remote['writes']} "
                  f"(dropped {remote['write_dropped']}, queued {remote['queue']}), "
                  f"corrupt {remote['corrupt_dropped']}, errors {remote['errors']}, "
                  f"{remote['latency_ms']:.2f} ms per call"]
        if remote.get("degraded"):
            extra.append(f"REMOTE TIER DEGRADED for {remote['degraded_seconds']:.0f}s: {remote['degraded']} "
                         "(serving from this node's tiers)")
    out.append("  ".join(extra[:3]) + ("\n" + "\n".join(extra[3:]) if extra[3:] else ""))
    return "\n\n".join(out)


def _seconds(v: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
        if v >= scale or unit == "ns":
            return f"{v / scale:.3g} {unit}"
    return f"{v:.3g} s"


def format_costs(costs: dict, tiers: dict) -> list[str]:
    """The cost model (tierd/costs.py): per tier its load estimate and its ledger; per engine
    its recompute estimate. A tier is shown when the store has it or anything was measured or
    counted in it."""
    ledger, transfers = costs.get("ledger", {}), costs.get("transfers", {})
    shown = [t for t in ledger if t in tiers or any(ledger[t].values())
             or transfers.get(f"{t}/load", {}).get("measured") or transfers.get(f"{t}/store", {}).get("measured")]
    rows = []
    for t in shown:
        est = []
        for d in ("load", "store"):
            e = transfers.get(f"{t}/{d}")
            if e:
                how = "seed" if not e["measured"] else f"{e['measured']} measured"
                est.append(f"{_seconds(e['latency_s'])} + {format_size(int(e['bandwidth_bytes_s']))}/s ({how})")
            else:
                est.append("")
        r = ledger[t]
        rows.append([t, *est, str(r["loads"]), str(r["loaded_tokens"]), str(r["declined_tokens"]),
                     str(r["abandoned_tokens"]), str(r["slow_hits"])])
    out = [table(rows, ["tier", "load estimate", "store estimate", "loads", "loaded tok", "declined tok",
                        "abandoned tok", "slow hits"])] if rows else []
    engines = []
    for name, e in sorted(costs.get("recompute", {}).items()):
        if e.get("measured"):
            engines.append(f"recompute {name}: {_seconds(e['fixed_s'])} per forward + {_seconds(e['per_token_s'])} "
                           f"per token + {_seconds(e['per_token_context_s'])} per token and token of context "
                           f"({e['measured']} forwards measured, the latest {e['age_s']:.0f}s ago)")
        else:
            engines.append(f"recompute {name}: not measured yet (every block found is loaded)")
    if engines:
        out.append("\n".join(engines))
    return out
