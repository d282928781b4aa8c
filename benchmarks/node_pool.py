"""One KV pool for every engine on a node, against a pool per engine of the same total memory:
real vLLM engines (its CPU build, small random-weight models) serve one multi-tenant trace.

Configurations, in one run, on the same seeded trace, with the same total pool memory B:
`shared tierd daemon` (one `tierd serve` of B shared by every engine), `tierd per engine`
(embedded, B/n each), `vLLM CPU offloading per engine` (B/n each) and `no offloading` (the
reference of TTFT, of throughput and of every request's greedy tokens). n engines (3; --quick 2)
behind a round-robin balancer. Needs vLLM's environment (`make vllm-env`).

Figures: the shared daemon's pool hit rate beside each per-engine pool's (goal >= 2x); each
configuration's prefix hit rate beside the trace's ceiling; TTFT p50 beside the per-engine pools'
(goal <= 0.7x) and no offloading's; throughput; and an engine restarted mid-trace, its hit rate
after it is back beside before (goal with the shared daemon: >= 0.9x). Exits non-zero if any
configuration's greedy tokens differ from no offloading's.

Method (the engines, the trace, how B is sized, the restart, why it is fair):
docs/benchmarks.md#node_pool.

    python -m benchmarks.node_pool [--json PATH] [--quick] [--engines N] [--requests N]
                                   [--pool-bytes B] [--seed S] [--only shared,tierd-each,vllm-each] [--keep]
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

BLOCK_TOKENS = 256        # tier block (tierd's connector; vLLM offloading's chunk)
ENGINE_BLOCK = 128        # vLLM's CPU block size
MAX_MODEL_LEN = 1536
ENGINE_CACHE_BLOCKS = 14   # each engine's own KV cache: 1,792 tokens, about one prompt
MAX_TOKENS = 8            # greedy tokens generated per request (compared with recompute's)

ENGINES_QUICK, ENGINES_FULL = 2, 3
RESTART_WINDOW_S = 60.0   # the restarted engine's hit rate over its requests in this many seconds
RESTART_WINDOW_QUICK = 5  # --quick: over its next (and last) this many requests
RESTART_WINDOW_REQUESTS = 10   # full: also over its next 10 (the 60 s can span what is left of the trace)
# trace shapes: tenants, documents and users per tenant, lengths in tokens
TRACE_QUICK = dict(requests=40, tenants=4, docs_per_tenant=3, users_per_tenant=2, sys_tokens=512,
                   doc_tokens=512, max_turns=4, rag_share=0.5, msg_tokens=(16, 120), tenant_skew=0.5,
                   doc_skew=1.0)
TRACE_FULL = dict(requests=160, tenants=6, docs_per_tenant=6, users_per_tenant=4, sys_tokens=512,
                  doc_tokens=768, max_turns=4, rag_share=0.5, msg_tokens=(16, 120), tenant_skew=0.5,
                  doc_skew=1.0)


# the full run's model: small enough that 4 configurations x 3 engines fit the machine at once,
# large enough that a prompt's prefill (~1.4 s for 1,300 tokens on one core here) dominates the noise
NODE_MODEL = dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096)


def node_model(work: Path) -> Path:
    from tierd.engine.random_model import write_random_model
    return write_random_model(Path(work) / "model", seed=5, **NODE_MODEL)


# -- the trace ------------------------------------------------------------------------------------

@dataclass
class Request:
    idx: int
    tenant: int
    kind: str                 # "rag" or "chat"
    tokens: list[int]
    who: str = ""             # the document or the user


def make_trace(*, seed: int, vocab: int, requests: int, tenants: int, docs_per_tenant: int, users_per_tenant: int,
               sys_tokens: int, doc_tokens: int, max_turns: int, rag_share: float, msg_tokens: tuple[int, int],
               tenant_skew: float, doc_skew: float) -> list[Request]:
    """The multi-tenant trace (module docstring), fully determined by its arguments."""
    assert sys_tokens % BLOCK_TOKENS == 0 and doc_tokens % BLOCK_TOKENS == 0
    assert msg_tokens[1] < ENGINE_BLOCK, "messages shorter than a vLLM block: shared prefixes end on tier blocks"
    rng = np.random.default_rng(seed)
    tok = lambda n: rng.integers(1, vocab, int(n)).tolist()  # noqa: E731
    systems = [tok(sys_tokens) for _ in range(tenants)]
    docs = [[tok(doc_tokens) for _ in range(docs_per_tenant)] for _ in range(tenants)]
    tw = np.array([1 / (t + 1) ** tenant_skew for t in range(tenants)])
    dw = np.array([1 / (d + 1) ** doc_skew for d in range(docs_per_tenant)])
    history = [[[] for _ in range(users_per_tenant)] for _ in range(tenants)]
    turns = [[0] * users_per_tenant for _ in range(tenants)]
    out = []
    for i in range(requests):
        t = int(rng.choice(tenants, p=tw / tw.sum()))
        msg = tok(rng.integers(msg_tokens[0], msg_tokens[1] + 1))
        if rng.random() < rag_share:
            d = int(rng.choice(docs_per_tenant, p=dw / dw.sum()))
            out.append(Request(i, t, "rag", systems[t] + docs[t][d] + msg, f"doc{d}"))
            continue
        u = int(rng.integers(users_per_tenant))
        if turns[t][u] >= max_turns:               # a new conversation
            history[t][u], turns[t][u] = [], 0
        out.append(Request(i, t, "chat", systems[t] + history[t][u] + msg, f"user{u}"))
        history[t][u] = history[t][u] + msg + tok(BLOCK_TOKENS - len(msg))   # the answer fills the block
        turns[t][u] += 1
    assert all(len(r.tokens) + MAX_TOKENS <= MAX_MODEL_LEN for r in out)
    return out


def block_keys(tokens: list[int]) -> list[bytes]:
    """Chained keys of the prompt's full 256-token blocks (each names its whole prefix)."""
    keys, prev = [], b""
    for b in range(len(tokens) // BLOCK_TOKENS):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(np.asarray(tokens[b * BLOCK_TOKENS:(b + 1) * BLOCK_TOKENS], dtype="<i4").tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys


def claimable(tokens: list[int]) -> int:
    """Blocks of a prompt a cache may serve: its last token is always computed (its logits)."""
    return (len(tokens) - 1) // BLOCK_TOKENS


def ceilings(trace: list[Request]) -> list[int]:
    """Per request, the prompt tokens any cache with unbounded memory could serve: the leading
    blocks some earlier request's prompt held (on any engine)."""
    seen: set[bytes] = set()
    out = []
    for r in trace:
        keys = block_keys(r.tokens)
        n = 0
        while n < min(len(keys), claimable(r.tokens)) and keys[n] in seen:
            n += 1
        out.append(n * BLOCK_TOKENS)
        seen.update(keys)
    return out


def trace_shape(trace: list[Request]) -> dict:
    """What the trace is, measured: lengths, reuse distances (requests since a hit prefix was last
    in a prompt), footprint."""
    lengths = [len(r.tokens) for r in trace]
    ceil = ceilings(trace)
    last: dict[bytes, int] = {}
    dist = []
    for r, c in zip(trace, ceil):
        keys = block_keys(r.tokens)
        if c:
            dist.append(r.idx - last[keys[c // BLOCK_TOKENS - 1]])
        for k in keys:
            last[k] = r.idx
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else 0.0  # noqa: E731
    return {"requests": len(trace), "tenants": len({r.tenant for r in trace}),
            "rag_requests": sum(r.kind == "rag" for r in trace), "chat_requests": sum(r.kind == "chat" for r in trace),
            "users": len({(r.tenant, r.who) for r in trace if r.kind == "chat"}),
            "documents": len({(r.tenant, r.who) for r in trace if r.kind == "rag"}),
            "prompt_tokens_p50": pct(lengths, 50), "prompt_tokens_min": min(lengths),
            "prompt_tokens_max": max(lengths), "prompt_tokens_total": sum(lengths),
            "reuse_distance_requests_p50": pct(dist, 50), "reuse_distance_requests_p90": pct(dist, 90),
            "unique_blocks": len(last), "ceiling_hit_rate": sum(ceil) / sum(lengths)}


def simulate_lru(trace: list[Request], route: list[int], pool_blocks: int, shared: bool, n: int,
                 local_blocks: int = 0, restart_at: int | None = None) -> list[int]:
    """Per request, the prompt tokens LRU caches would serve (a planning aid, not a figure): a pool
    of `pool_blocks` tier blocks (one shared, or one per engine of pool_blocks // n), beside each
    engine's own cache of `local_blocks`; at `restart_at` engine 0 loses its own cache, and its
    pool unless shared."""
    pools = [OrderedDict() for _ in range(1 if shared else n)]
    cap = pool_blocks if shared else pool_blocks // n
    local = [OrderedDict() for _ in range(n)]
    out = []

    def prefix(cache, keys, most):
        k = 0
        while k < most and keys[k] in cache:
            k += 1
        return k

    def put(cache, keys, size):
        for k in keys:
            cache[k] = True
            cache.move_to_end(k)
        while len(cache) > size:
            cache.popitem(last=False)

    for r, e in zip(trace, route):
        if r.idx == restart_at:
            local[0].clear()
            if not shared:
                pools[0].clear()
        pool = pools[0 if shared else e]
        keys = block_keys(r.tokens)
        most = min(len(keys), claimable(r.tokens))
        out.append(max(prefix(pool, keys, most) if cap else 0, prefix(local[e], keys, most)) * BLOCK_TOKENS)
        if cap:
            put(pool, keys, cap)
        put(local[e], keys, local_blocks)
    return out


# -- engines --------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
WARMUP_TOKENS = BLOCK_TOKENS - 1      # a warm-up prompt with no full tier block: nothing reaches a pool


class Engine:
    """One vLLM engine process (tests/vllm_engine.py) that serves its requests one at a time when
    told to: each request is a batch of its own that waits for a go file (the harness's
    "pause"), so the balancer here decides when each runs."""

    def __init__(self, py: str, work: Path, name: str, spec: dict, env: dict):
        self.name, self.out = name, work / f"{name}.json"
        path = work / f"{name}.spec.json"
        path.write_text(json.dumps({**spec, "out": str(self.out)}))
        self.log_path = work / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([py, "-m", "tests.vllm_engine", str(path)], cwd=ROOT,
                                     env=dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(work), **env),
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def _check(self, what: str, since: float, timeout: float) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"engine {self.name} exited ({self.proc.returncode}) while {what}:\n"
                               f"{self.log_path.read_text(errors='replace')[-3000:]}")
        if time.perf_counter() - since > timeout:
            raise RuntimeError(f"engine {self.name}: no answer in {timeout:.0f} s while {what}:\n"
                               f"{self.log_path.read_text(errors='replace')[-3000:]}")

    def ready(self, batch: str, timeout: float = 900) -> float:
        """Wait until the engine waits for `batch` (start-up included); returns when it did."""
        t0 = time.perf_counter()
        flag = Path(f"{self.out}.ready-{batch}")
        while not flag.exists():
            self._check(f"starting / reaching {batch}", t0, timeout)
            time.sleep(0.02)
        return time.perf_counter()

    def serve(self, batch: str, timeout: float = 600) -> dict:
        """Let `batch` run and return what the engine wrote for it."""
        self.ready(batch)
        Path(f"{self.out}.go-{batch}").write_text("")
        t0, seen = time.perf_counter(), None
        while True:
            try:
                st = self.out.stat()
                if (st.st_mtime_ns, st.st_size) != seen:   # the harness rewrites it after each batch
                    seen = (st.st_mtime_ns, st.st_size)
                    mine = [b for b in json.loads(self.out.read_text())["batches"] if b["name"] == batch]
                    if mine:
                        return mine[0]
            except (OSError, ValueError, KeyError):   # not written yet, or being written
                seen = None
            self._check(f"serving {batch}", t0, timeout)
            time.sleep(0.01)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> None:
        """Stop the engine (SIGTERM: as an upgrade's drain would) and anything left in its process
        group."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)   # the group (this engine's own session)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(timeout)
        self._log.close()


@dataclass
class Config:
    key: str
    label: str
    connector: dict | None = None
    offload: dict | None = None
    daemon_bytes: int = 0          # > 0: a `tierd serve` with a host tier of this size
    unavailable: str = ""          # why it could not run here ("" ran)
    records: list = field(default_factory=list)
    restart: dict = field(default_factory=dict)
    pool_stats: dict = field(default_factory=dict)


class Node:
    """One configuration's node: n engines (and a daemon for the shared pool) serving the trace
    request by request. `clock` is the node's own serving time (the sum of its requests' wall
    times): the time the trace would have taken on this node alone."""

    ENV = {"VLLM_LOGGING_LEVEL": "WARNING", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

    def __init__(self, py: str, work: Path, cfg: Config, model: Path, trace: list[Request], route: list[int], n: int,
                 engine_kw: dict, warmup: list[int], slab_bytes: int):
        self.py, self.work, self.cfg, self.model, self.trace, self.route, self.n = py, work, cfg, model, trace, route, n
        self.engine_kw, self.warmup = engine_kw, warmup
        self.engines: list[Engine | None] = [None] * n
        self.daemon = None
        self.clock = 0.0
        self.connector = cfg.connector
        if cfg.daemon_bytes:
            from .common import DaemonUnderTest
            (work / cfg.key).mkdir()
            self.daemon = DaemonUnderTest(str(work / cfg.key), host_bytes=str(cfg.daemon_bytes), disk_path="",
                                          toml=f'[host]\nslab_bytes = "{slab_bytes}"\n')
            self.connector = dict(cfg.connector, url=f"unix://{self.daemon.socket}")

    def _spec(self, e: int, first: int) -> dict:
        batches = [{"name": "warmup", "prompts": [{"tokens": self.warmup, "max_tokens": 2}]}]
        batches += [{"name": f"r{r.idx}", "pause": True, "prompts": [{"tokens": r.tokens, "max_tokens": MAX_TOKENS}]}
                    for r in self.trace[first:] if self.route[r.idx] == e]
        return {"model": str(self.model), "connector": self.connector, "offload": self.cfg.offload,
                "engine": self.engine_kw, "batches": batches, "connector_stats": self.connector is not None}

    def _first(self, e: int, since: int) -> str:
        return f"r{next(r.idx for r in self.trace[since:] if self.route[r.idx] == e)}"

    def start(self) -> None:
        for e in range(self.n):
            self.engines[e] = Engine(self.py, self.work, f"{self.cfg.key}-e{e}", self._spec(e, 0), self.ENV)

    def ready(self) -> None:
        for e in range(self.n):
            self.engines[e].ready(self._first(e, 0))

    def stop_engine0(self, since: int) -> None:
        """Engine 0 goes down (SIGTERM, as an upgrade's drain) and a new one starts; its requests
        wait at the balancer meanwhile."""
        self.cfg.restart = {"stopped_at_s": self.clock, "t": time.perf_counter()}
        self.engines[0].stop(signal.SIGTERM)
        self.engines[0] = Engine(self.py, self.work, f"{self.cfg.key}-e0-restarted", self._spec(0, since), self.ENV)

    def engine0_back(self, since: int) -> None:
        self.engines[0].ready(self._first(0, since))
        self.cfg.restart.update(back_at_s=self.clock, restart_s=time.perf_counter() - self.cfg.restart.pop("t"))

    def serve(self, r: Request) -> None:
        e = self.route[r.idx]
        b = self.engines[e].serve(f"r{r.idx}")
        o, c = b["outputs"][0], b["counters"]
        self.cfg.records.append({"idx": r.idx, "engine": e, "at_s": self.clock, "ttft_s": o["ttft_s"],
                                 "tokens": o["tokens"], "cached": o["num_cached_tokens"],
                                 "external": c.get("external_prefix_cache_hits", 0),
                                 "local": c.get("prefix_cache_hits", 0), "wall_s": b["wall_s"],
                                 "prompt_tokens": len(r.tokens), "connector": b.get("connector", {})})
        self.clock += b["wall_s"]

    def close(self) -> None:
        """Stop every engine and the daemon (its stats taken first, engines still connected)."""
        if self.daemon is not None and not self.cfg.pool_stats:
            try:
                import tierd
                with tierd.connect(f"unix://{self.daemon.socket}") as s:
                    st = s.stats()
                host = st.get("tiers", {}).get("host", {})
                self.cfg.pool_stats = {**{k: host.get(k) for k in ("capacity_bytes", "used_bytes", "blocks",
                                                                     "evictions")},
                                       "staged_slots": st.get("staged_slots")}
            except Exception:   # noqa: BLE001 -- stats are a detail; the daemon is stopped regardless
                pass
        for eng in self.engines:
            if eng is not None:
                eng.stop()
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None


def run_nodes(nodes: list[Node], trace: list[Request], restart_at: int) -> None:
    """Every configuration serves the trace, interleaved request by request (the configurations
    take turns going first), so the machine's drift over the run falls on all of them alike.
    A configuration whose engines fail is marked unavailable and the others go on."""
    def guard(node: Node, fn, *a) -> None:
        if node.cfg.unavailable:
            return
        try:
            fn(*a)
        except RuntimeError as e:
            if node.cfg.key == "none":
                raise
            node.cfg.unavailable = str(e).strip().splitlines()[0]
            print(f"  {node.cfg.label}: could not run here: {e}")
            node.close()

    for node in nodes:
        guard(node, node.start)
    for node in nodes:
        guard(node, node.ready)
    print(f"  engines up; serving {len(trace)} requests on {len(nodes)} nodes in turn")
    for r in trace:
        if r.idx == restart_at:
            for node in nodes:
                guard(node, node.stop_engine0, restart_at)
            for node in nodes:
                guard(node, node.engine0_back, restart_at)
            print(f"  engine 0 of each node restarted; {len(trace) - restart_at} requests to go")
        k = r.idx % len(nodes)
        for node in nodes[k:] + nodes[:k]:
            guard(node, node.serve, r)


# -- figures --------------------------------------------------------------------------------------

def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q))


def hit_rate(records: list[dict]) -> float:
    return sum(r["cached"] for r in records) / sum(r["prompt_tokens"] for r in records)


def restart_windows(cfg: Config, k: int | None, span_s: float) -> tuple[list[dict], list[dict], str]:
    """Engine 0's requests just before it was stopped and just after it was back: its last `k`
    requests before and its next `k` after, or (k None) those within `span_s` seconds of its
    node's serving time."""
    mine = [r for r in cfg.records if r["engine"] == 0]
    stop, back = cfg.restart["stopped_at_s"], cfg.restart["back_at_s"]
    before = [r for r in mine if r["at_s"] < stop]
    after = [r for r in mine if r["at_s"] >= back]
    if k:
        return before[-k:], after[:k], f"its {k} requests"
    return ([r for r in before if r["at_s"] >= stop - span_s], [r for r in after if r["at_s"] < back + span_s],
            f"{span_s:.0f} s of serving")


def daemon_note(cfg: Config, block_bytes: int) -> str:
    """What the shared daemon's host tier held at the end of the trace (engines still connected)."""
    st = cfg.pool_stats
    if not st or not st.get("capacity_bytes"):
        return ""
    cap = st["capacity_bytes"] // block_bytes
    staged = st.get("staged_slots") or 0
    return (f"at the end the daemon held {st['blocks']} blocks in its {cap} slots ({st['blocks'] / cap:.0%}), "
            f"{staged} staged (slots for its clients' next writes, at most 1/16 of the arena in all, "
            f"tierd/server.py)")


def main() -> None:
    from .common import Result, engine_python, parse_args, quick_model, report

    def extra(ap):
        ap.add_argument("--engines", type=int, default=None, help="engines on the node (default 2)")
        ap.add_argument("--requests", type=int, default=None, help="requests in the trace")
        ap.add_argument("--pool-bytes", type=int, default=None,
                        help="total pool memory B (default: what an LRU pool needs to serve 90%% of the "
                             "trace's ceiling, over 0.85)")
        ap.add_argument("--seed", type=int, default=45)
        ap.add_argument("--only", default="", help="comma-separated configurations to run besides none "
                        "(shared, tierd-each, vllm-each)")
        ap.add_argument("--keep", action="store_true", help="keep the work directory (engines' logs, records)")
    args = parse_args(__doc__.splitlines()[0], extra)
    py = engine_python(".venv-vllm", "TEST_VLLM_PYTHON", "vllm-env")

    n = args.engines or (ENGINES_QUICK if args.quick else ENGINES_FULL)
    shape_args = dict(TRACE_QUICK if args.quick else TRACE_FULL)
    if args.requests:
        shape_args["requests"] = args.requests
    work = Path(tempfile.mkdtemp(prefix="tierd-node-pool-"))
    if args.quick:
        model, vocab = quick_model(work), 500
    else:
        model, vocab = node_model(work), NODE_MODEL["vocab_size"] - 1
    mcfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = mcfg.get("head_dim") or mcfg["hidden_size"] // mcfg["num_attention_heads"]
    block_bytes = mcfg["num_hidden_layers"] * 2 * BLOCK_TOKENS * mcfg["num_key_value_heads"] * head_dim * 4   # fp32

    trace = make_trace(seed=args.seed, vocab=vocab, **shape_args)
    shape = trace_shape(trace)
    ceil = ceilings(trace)
    route = [i % n for i in range(len(trace))]            # round-robin, no cache affinity
    restart_at = len(trace) // 2
    local_blocks = ENGINE_CACHE_BLOCKS * ENGINE_BLOCK // BLOCK_TOKENS

    def lru(blocks: int, shared: bool) -> float:
        served = simulate_lru(trace, route, blocks, shared, n, local_blocks, restart_at)
        return sum(served) / shape["prompt_tokens_total"]
    # B: the smallest LRU pool that serves 90% of the ceiling when shared ("holds the hot set"),
    # over 0.85 (the headroom once left for tierd's eviction watermarks; kept so that runs compare)
    hot = next((b for b in range(n, 4 * shape["unique_blocks"], n)
                if lru(b, True) >= 0.9 * shape["ceiling_hit_rate"]), shape["unique_blocks"])
    pool_bytes = args.pool_bytes or -(-hot * block_bytes * 100 // 85 // (n * block_bytes)) * n * block_bytes
    per_engine = pool_bytes // n // block_bytes * block_bytes
    planned = {"shared": lru(pool_bytes // block_bytes, True), "per_engine": lru(pool_bytes // block_bytes, False),
               "none": lru(0, True)}
    print(f"model {model} ({'quick' if args.quick else 'node'}), {n} engines, requests round-robin, one at a time")
    print("trace: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in shape.items()))
    print(f"pool memory B = {pool_bytes / 2**20:.1f} MiB ({pool_bytes // block_bytes} blocks of "
          f"{block_bytes / 2**10:.0f} KiB; per engine {per_engine / 2**20:.1f} MiB). LRU caches of these sizes "
          f"would hit {planned['shared']:.2f} shared, {planned['per_engine']:.2f} per engine, {planned['none']:.2f} "
          f"with the engines' own caches alone (ceiling {shape['ceiling_hit_rate']:.2f})")

    conn = {"block_tokens": BLOCK_TOKENS}
    configs = [
        Config("none", "no offloading"),
        Config("shared", "shared tierd daemon", connector=conn, daemon_bytes=pool_bytes),
        Config("tierd-each", "tierd per engine (embedded)",
               connector=dict(conn, url=f"embedded://?host={per_engine}&host_slab={block_bytes}")),
        Config("vllm-each", "vLLM CPU offloading per engine",
               offload={"spec_name": "HostCPUOffloadingSpec", "spec_module_path": "tierd.connectors.vllm_tier",
                        "cpu_bytes_to_use": per_engine, "block_size": BLOCK_TOKENS}),
    ]
    engine_kw = {"max_num_batched_tokens": 2048, "enable_prefix_caching": True, "max_model_len": MAX_MODEL_LEN,
                 "num_gpu_blocks_override": ENGINE_CACHE_BLOCKS}
    warmup = np.random.default_rng(args.seed + 1).integers(1, vocab, WARMUP_TOKENS).tolist()
    if args.only:
        configs = [c for c in configs if c.key == "none" or c.key in args.only.split(",")]
    t0 = time.perf_counter()
    nodes: list[Node] = []
    try:
        for cfg in configs:
            nodes.append(Node(py, work, cfg, Path(model), trace, route, n, engine_kw, warmup, block_bytes))
        run_nodes(nodes, trace, restart_at)
    finally:
        for node in nodes:
            node.close()
    print(f"all configurations in {time.perf_counter() - t0:.0f} s")
    (work / "records.json").write_text(json.dumps({c.key: c.records for c in configs}))   # kept if the report fails

    ref = configs[0]
    ref_tokens = [r["tokens"] for r in ref.records]
    total = sum(len(r.tokens) for r in trace)
    ceiling = sum(ceil) / total
    ttft = {c.key: [r["ttft_s"] for r in c.records] for c in configs if not c.unavailable}
    thr = {c.key: total / sum(r["wall_s"] for r in c.records) for c in configs if not c.unavailable}
    hits = {c.key: hit_rate(c.records) for c in configs if not c.unavailable}
    pools = {c.key: sum(r["external"] for r in c.records) / total for c in configs if not c.unavailable}
    results, bad = [], []
    common = {"engines": n, "pool_bytes": pool_bytes, "per_engine_pool_bytes": per_engine}
    brief = {"requests": len(trace), "tenants": shape["tenants"], "prompt_tokens_p50": shape["prompt_tokens_p50"],
             "reuse_distance_p50": shape["reuse_distance_requests_p50"],
             "reuse_distance_p90": shape["reuse_distance_requests_p90"], "unique_blocks": shape["unique_blocks"]}
    for c in configs:
        if c.unavailable:
            results.append(Result(f"{c.label}: could not run on this machine", {**common, "reason": c.unavailable},
                                  0.0, "fraction", "trace ceiling (unbounded memory)", ceiling))
            continue
        same = sum(r["tokens"] == t for r, t in zip(c.records, ref_tokens))
        if same != len(trace):
            bad.append(c.label)
        results.append(Result(f"{c.label}: prefix hit rate (engine cache + pool)", {
            **common, "pool_hit_rate": round(pools[c.key], 4),
            "engine_cache_hit_rate": round(hits[c.key] - pools[c.key], 4),
            **(brief if c is ref else {}), **({"daemon": c.pool_stats} if c.pool_stats else {})},
            hits[c.key], "fraction", "trace ceiling (unbounded memory)", ceiling, note=daemon_note(c, block_bytes)))
        for q in (50, 90):
            results.append(Result(f"{c.label}: TTFT p{q}", {"requests": len(trace)}, pct(ttft[c.key], q), "s",
                                  f"no offloading TTFT p{q}", pct(ttft["none"], q), higher_is_better=False))
        results.append(Result(f"{c.label}: throughput", {"requests_per_s": round(len(trace) / (total / thr[c.key]), 3)},
                              thr[c.key], "prompt tok/s", "no offloading prompt tok/s", thr["none"]))
        if c is not ref:
            results.append(Result(f"{c.label}: greedy tokens equal recompute's", {"requests": len(trace)},
                                  same / len(trace), "fraction of requests", "no offloading (all equal)", 1.0,
                                  note="" if same == len(trace) else f"{len(trace) - same} requests differ"))
    ran = {c.key: c for c in configs if not c.unavailable}
    for other in ("tierd-each", "vllm-each"):
        if other not in ran or "shared" not in ran:
            continue
        o = ran[other]
        results.append(Result(f"shared tierd daemon vs {o.label}: pool hit rate", {"goal": ">= 2x"},
                              pools["shared"], "fraction", o.label, pools[other]))
        results.append(Result(f"shared tierd daemon vs {o.label}: prefix hit rate (engine cache + pool)", {},
                              hits["shared"], "fraction", o.label, hits[other]))
        results.append(Result(f"shared tierd daemon vs {o.label}: TTFT p50", {"goal": "<= 0.7x (ratio >= 1.43)"},
                              pct(ttft["shared"], 50), "s", o.label, pct(ttft[other], 50), higher_is_better=False))
    for c in configs:
        if c.unavailable or not c.restart:
            continue
        windows = [RESTART_WINDOW_QUICK] if args.quick else [None, RESTART_WINDOW_REQUESTS]
        for k in windows:
            before, after, span = restart_windows(c, k, RESTART_WINDOW_S)
            share = lambda rs, key: sum(r[key] for r in rs) / max(1, sum(r["prompt_tokens"] for r in rs))  # noqa: E731
            cb = sum(ceil[r["idx"]] for r in before) / max(1, sum(r["prompt_tokens"] for r in before))
            ca = sum(ceil[r["idx"]] for r in after) / max(1, sum(r["prompt_tokens"] for r in after))
            hb, ha = share(before, "cached"), share(after, "cached")
            results.append(Result(f"{c.label}: restarted engine's hit rate, {span} after it is back",
                                  {"requests_before": len(before), "requests_after": len(after),
                                   "restart_s": round(c.restart["restart_s"], 1),
                                   "of_ceiling_before": round(hb / cb, 3) if cb else None,
                                   "of_ceiling_after": round(ha / ca, 3) if ca else None,
                                   "pool_hit_rate_before": round(share(before, "external"), 3),
                                   "pool_hit_rate_after": round(share(after, "external"), 3),
                                   **({"goal": ">= 0.9x"} if c.key == "shared" and k != RESTART_WINDOW_REQUESTS
                                      else {})},
                                  ha, "fraction", f"the same engine's, {span} before it was stopped", hb))
    report("node_pool", results, args.json)
    if bad:
        raise SystemExit(f"greedy tokens differ from recompute's in: {', '.join(bad)} (logs in {work})")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)   # kept after a failure: the engines' logs are there


if __name__ == "__main__":
    main()
