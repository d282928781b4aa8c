"""Prometheus metrics of the daemon (`tierd_*`), served on --metrics-addr.

Gauges and counters are read from `TieredStore.stats()` at scrape time, so they can never
drift from what `tierd stats` shows; only per-op latency is recorded as it happens. This module
never changes the store.
"""

from __future__ import annotations

from collections.abc import Callable

import bisect
import errno
import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app

from .errors import ConfigError
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def gauge_family(name, doc, labels, rows):
    g = GaugeMetricFamily(name, doc, labels=labels)
    for lv, v in rows:
        g.add_metric(lv, v)
    return g


def counter_family(name, doc, labels, rows):
    c = CounterMetricFamily(name, doc, labels=labels)
    for lv, v in rows:
        c.add_metric(lv, v)
    return c


def _namespace_info(name: str, ns: dict) -> list[str]:
    d = ns.get("description") or {}
    return [name, ns.get("label", ""), str(d.get("model", ""))[:16],
            str(d.get("cache_salt", "")).removeprefix("digest:"), str(d.get("kv_dtype", "")),
            f"{d.get('tp_rank', 0)}/{d.get('tp_size', 1)}"]


class _StoreCollector:
    def __init__(self, stats: Callable[[], dict]):
        self._stats = stats

    def collect(self):
        st = self._stats()
        tiers = {k: v for k, v in st["tiers"].items() if k != "remote"}   # the slot tiers
        remote = st["tiers"].get("remote")
        if remote:
            yield gauge_family("tierd_remote_degraded", "1 while the remote tier is failing.", [],
                               [([], 1 if remote["degraded"] else 0)])
            for name, doc in (("hits", "Blocks loaded from the remote tier."),
                              ("misses", "Blocks the remote tier no longer had."),
                              ("writes", "Blocks written to the remote tier."),
                              ("write_dropped", "Blocks not written to the remote tier (queue full, degraded)."),
                              ("errors", "Failed remote calls."),
                              ("corrupt_dropped", "Remote values that failed verification.")):
                yield counter_family(f"tierd_remote_{name}", doc, [], [([], remote[name])])
            yield gauge_family("tierd_remote_latency_seconds", "Moving average of one remote call.", [],
                               [([], remote["latency_ms"] / 1e3)])

        gauge, counter = gauge_family, counter_family

        yield gauge("tierd_tier_capacity_bytes", "Capacity of each tier.", ["tier"],
                    [([t], v["capacity_bytes"]) for t, v in tiers.items()])
        yield gauge("tierd_tier_used_bytes", "Slot bytes in use in each tier.", ["tier"],
                    [([t], v["used_bytes"]) for t, v in tiers.items()])
        yield gauge("tierd_tier_blocks", "Blocks held by each tier.", ["tier"],
                    [([t], v["blocks"]) for t, v in tiers.items()])
        yield gauge("tierd_tier_waste_ratio", "Bytes of a tier that can hold no block, over its capacity.",
                    ["tier"], [([t], v["waste_ratio"]) for t, v in tiers.items()])
        yield counter("tierd_evictions", "Blocks removed from a tier under pressure.", ["tier"],
                      [([t], v["evictions"]) for t, v in tiers.items()])
        disk = tiers.get("disk")
        moves = []
        if disk:
            moves = [(["host", "disk"], disk["demotions"]), (["disk", "host"], disk["promotions"])]
        if tiers.get("gpu"):
            moves.append((["host", "gpu"], tiers["gpu"]["promotions"]))
        yield counter("tierd_block_moves", "Blocks copied between tiers (demotion, promotion).",
                      ["from_tier", "to_tier"], moves)
        yield counter("tierd_transfer_bytes", "Payload bytes written into / read out of each tier.",
                      ["tier", "direction"],
                      [([t, d], v[f"bytes_{d}"]) for t, v in tiers.items() for d in ("in", "out")])
        yield counter("tierd_corrupt_blocks", "Disk slots that failed verification and were dropped.",
                      ["tier"], [(["disk"], disk["corrupt_dropped"])] if disk else [])
        yield counter("tierd_disk_io_errors", "Failed disk reads or writes.", [],
                      [([], disk["io_errors"])] if disk else [])
        yield gauge("tierd_disk_degraded", "1 while the disk tier is failing (serving from host RAM only).", [],
                    [([], 1 if disk["degraded"] else 0)] if disk else [])
        yield counter("tierd_disk_degraded_episodes", "Times the disk tier became degraded.", [],
                      [([], disk["degraded_episodes"])] if disk else [])
        yield gauge("tierd_disk_io_buffer_bytes", "Memory the disk tier holds in I/O buffers (kept for reuse, "
                    "given back after a while unused).", [], [([], disk["io_buffer_bytes"])] if disk else [])
        host = tiers.get("host", {})
        if "dirty_bytes" in host:
            yield gauge("tierd_host_dirty_bytes", "Host RAM holding blocks with no disk copy yet (evicting "
                        "them needs a write first).", [], [([], host["dirty_bytes"])])
            yield gauge("tierd_host_clean_bytes", "Host RAM holding blocks that also have a disk copy "
                        "(dropped with no I/O when the room is needed).", [], [([], host["clean_bytes"])])
        if "adopted_blocks" in host:   # the host tier keeps its blocks across restarts
            yield gauge("tierd_host_adopted_blocks", "Host blocks re-adopted (re-verified) at the last start.", [],
                        [([], host["adopted_blocks"])])
            yield gauge("tierd_host_adopt_dropped", "Host blocks of the last run dropped at start (torn, failed "
                        "their checksum, or no room).", [], [([], host["adopt_dropped"])])
            yield gauge("tierd_host_unrecorded_pending", "Host blocks whose records are not written yet (they "
                        "would not survive a crash now).", [], [([], host["keep_pending"])])
            yield counter("tierd_host_unrecorded", "Host blocks that could not be recorded (no room for "
                          "their records).", [], [([], host["unrecorded"])])
        ns = st["namespaces"]
        # one series per namespace whose labels say what it is; join it onto the per-namespace
        # series: `tierd_hits_total * on (namespace) group_left (model) tierd_namespace_info`
        yield gauge("tierd_namespace_info", "What each namespace is: its model's name, fingerprint, "
                    "cache-salt digest, KV dtype and tensor-parallel rank (value 1).",
                    ["namespace", "model", "fingerprint", "salt", "kv_dtype", "tp"],
                    [(_namespace_info(n, v), 1) for n, v in ns.items()])
        yield counter("tierd_hits", "Blocks served.", ["namespace"], [([n], v["hits"]) for n, v in ns.items()])
        yield counter("tierd_misses", "Blocks asked for and not served.", ["namespace"],
                      [([n], v["misses"]) for n, v in ns.items()])
        yield counter("tierd_puts", "Blocks newly stored.", ["namespace"],
                      [([n], v["puts"]) for n, v in ns.items()])
        yield counter("tierd_puts_dropped", "Blocks not stored for lack of room.", ["namespace"],
                      [([n], v["put_dropped"]) for n, v in ns.items()])
        daemon = st.get("daemon", {})
        yield gauge("tierd_clients_connected", "Connected clients.", [],
                    [([], daemon.get("clients", 0))])
        yield gauge("tierd_leases", "Open leases.", [], [([], st["leases"])])
        yield gauge("tierd_reservations", "Open reservations.", [], [([], st["reservations"])])
        yield gauge("tierd_staged_slots", "Free host slots held by clients ahead of their writes.", [],
                    [([], st.get("staged_slots", 0))])
        yield counter("tierd_reclaimed", "Leases and reservations reclaimed from disconnected clients.",
                      ["kind"], [(["lease"], daemon.get("reclaimed_leases", 0)),
                                 (["reservation"], daemon.get("reclaimed_reservations", 0))])
        if "costs" in st:    # (stats of a store without a cost model have none)
            yield from _cost_families(st["costs"], st["tiers"])


def _cost_families(costs: dict, tiers: dict):
    """The cost model (tierd/costs.py): its ledger, transfer and recompute estimates. A tier
    is shown when the daemon has it, or when engines measured or counted anything in it."""
    ledger = costs.get("ledger", {})
    transfers = {tuple(k.split("/", 1)): v for k, v in costs.get("transfers", {}).items() if "/" in k}
    shown = set(tiers) | {t for t, row in ledger.items() if any(row.values())} \
        | {t for (t, _), v in transfers.items() if v.get("measured")}
    ledger = {t: row for t, row in ledger.items() if t in shown}
    transfers = {k: v for k, v in transfers.items() if k[0] in shown}
    for name, key, doc in (
            ("tierd_loads", "loads", "Loads by engines that read blocks from each tier."),
            ("tierd_load_tokens", "loaded_tokens", "Tokens engines loaded from each tier."),
            ("tierd_load_declined_tokens", "declined_tokens", "Tokens found in each tier but computed, "
             "because the cost model predicted computing them cheaper than loading them."),
            ("tierd_load_abandoned_tokens", "abandoned_tokens", "Tokens of loads from each tier abandoned "
             "past their deadline (computed instead)."),
            ("tierd_slow_hits", "slow_hits", "Loads that took longer than computing their tokens was "
             "estimated to (by the tier of their last block).")):
        yield counter_family(name, doc, ["tier"], [([t], row.get(key, 0)) for t, row in ledger.items()])
    rows = sorted(transfers.items())
    yield gauge_family("tierd_transfer_latency_seconds", "The cost model's fixed seconds of one transfer "
                       "between an engine and a tier (direction load: into the engine; store: out of it).",
                       ["tier", "direction"], [(list(k), v["latency_s"]) for k, v in rows])
    yield gauge_family("tierd_transfer_bandwidth_bytes_per_second", "The cost model's bandwidth of "
                       "transfers between an engine and a tier.", ["tier", "direction"],
                       [(list(k), v["bandwidth_bytes_s"]) for k, v in rows])
    yield gauge_family("tierd_transfer_measured", "1 where the transfer estimate is fitted from measured "
                       "transfers, 0 where it is the conservative seed.", ["tier", "direction"],
                       [(list(k), 1 if v.get("measured") else 0) for k, v in rows])
    fits = sorted((ns, v) for ns, v in costs.get("recompute", {}).items() if v.get("measured"))
    for name, key, doc in (
            ("tierd_recompute_fixed_seconds", "fixed_s", "The cost model's fixed seconds of one forward "
             "pass, per engine (namespace)."),
            ("tierd_recompute_seconds_per_token", "per_token_s", "The cost model's seconds per token "
             "computed, per engine (namespace)."),
            ("tierd_recompute_seconds_per_token_context", "per_token_context_s", "The cost model's "
             "seconds per token computed and per token of context before it (attention), per engine "
             "(namespace).")):
        yield gauge_family(name, doc, ["namespace"], [([ns], v[key]) for ns, v in fits])


class OpLatency:
    """Per-op latency histogram, recorded on the daemon's hot path: one bisect and one short
    lock per request (cheaper than a labelled client-library histogram), exported as
    `tierd_op_duration_seconds` at scrape time."""

    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = tuple(buckets)
        self._lock = threading.Lock()
        self._ops: dict[str, list] = {}     # op -> [count per bucket (+Inf last), sum]

    def observe(self, op: str, seconds: float) -> None:
        i = bisect.bisect_left(self.buckets, seconds)
        with self._lock:
            row = self._ops.get(op)
            if row is None:
                row = self._ops[op] = [[0] * (len(self.buckets) + 1), 0.0]
            row[0][i] += 1
            row[1] += seconds

    def collect(self):
        h = HistogramMetricFamily("tierd_op_duration_seconds", "Time to serve one request, by op.",
                                  labels=["op"])
        with self._lock:
            rows = [(op, list(c), total) for op, (c, total) in self._ops.items()]
        for op, counts, total in rows:
            cum, acc = [], 0
            for bound, n in zip((*map(str, self.buckets), "+Inf"), counts):
                acc += n
                cum.append((bound, acc))
            h.add_metric([op], cum, total)
        yield h


class _BuildInfo:
    """tierd_build_info{version, commit} 1: what runs (a fleet mid-rollout shows both)."""

    def collect(self):
        from . import __version__
        from .version import commit
        g = GaugeMetricFamily("tierd_build_info", "The running tierd: its version and the commit it was built "
                              "from (empty where unknown).", labels=["version", "commit"])
        g.add_metric([__version__, commit() or ""], 1)
        yield g


class Metrics:
    """The daemon's registry: store gauges/counters plus an op latency histogram."""

    def __init__(self, stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        self.registry.register(_StoreCollector(stats))
        self.op_seconds = OpLatency()
        self.registry.register(self.op_seconds)
        self.registry.register(_BuildInfo())
        ProcessCollector(registry=self.registry)   # process_*: CPU, memory, open files, start time
        self._server = None
        self._thread = None

    def listen(self, addr: str) -> tuple[str, int]:
        """Bind and listen on HOST:PORT (port 0: any free port), serving nothing yet (`start`);
        returns the bound address. The daemon listens before it opens any tier, so a port it
        cannot have fails the start before anything is made."""
        host, _, port = addr.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE)[0]

            class _Server(ThreadingMixIn, WSGIServer):
                daemon_threads = True
                address_family = family

            self._server = make_server(sockaddr[0], int(port), make_wsgi_app(self.registry), _Server,
                                       handler_class=_QuietHandler)
        except OSError as e:
            hint = ("another process listens there (a daemon on another socket?)" if e.errno == errno.EADDRINUSE
                    else "no interface of this machine has that address" if e.errno == errno.EADDRNOTAVAIL
                    else "a port below 1024 needs privileges" if e.errno == errno.EACCES
                    else "no such host" if isinstance(e, socket.gaierror) else None)
            reason = f"{e.strerror or e}: {hint}" if hint else f"{e.strerror or e}"
            raise ConfigError(f"metrics_addr {addr}: cannot listen ({reason}); set metrics_addr "
                              "(--metrics-addr, TIERD_METRICS_ADDR) to a free HOST:PORT, or \"\" to turn "
                              "metrics off") from None
        self._host = host
        return host, self._server.server_port

    def start(self) -> tuple[str, int]:
        """Serve scrapes on the address `listen` bound, on a thread of its own."""
        self._thread = threading.Thread(target=self._server.serve_forever, name="tierd-metrics", daemon=True)
        self._thread.start()
        return self._host, self._server.server_port

    def serve(self, addr: str) -> tuple[str, int]:
        """Listen on HOST:PORT and serve at once; returns the bound address."""
        self.listen(addr)
        return self.start()

    def close(self) -> None:
        if self._server is not None:
            if self._thread is not None:   # (shutdown waits for serve_forever: only once it ran)
                self._server.shutdown()
                self._thread = None
            self._server.server_close()
            self._server = None


class _QuietHandler(WSGIRequestHandler):
    """Logs no request (a scrape every few seconds would fill the daemon's log)."""

    def log_message(self, format, *args):  # noqa: A002 -- the base class's signature
        pass
