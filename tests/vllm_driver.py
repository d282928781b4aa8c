"""Plays vLLM's call sequence against `tierd.connectors.vllm.TierdConnector`.

`Objects` builds the objects vLLM hands a connector (requests, scheduler outputs, configs);
`tests/test_vllm_connector.py` gives it plain stand-ins, `tests/vllm_check.py` gives it vLLM's
own classes (in an environment where vLLM is installed). The scenarios assert what a user
relies on: bytes loaded into the paged cache equal the bytes stored, blocks vLLM already has are
never written, another cache_salt never hits, and a tier block gone between lookup and load is
reported so vLLM recomputes it.
"""

from __future__ import annotations

import time

import torch

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_TOKENS, NUM_BLOCKS = 4, 2, 8, 16, 32, 64


def extra_config(url: str, model: str = "vllm-driver-model") -> dict:
    # saves wait up to 5 s for their slots: the scenarios count exact stores, and a loaded machine
    # can take longer than the 50 ms default for a save thread's first reservation (that drop is
    # tested on its own, with save_wait_ms set). Lookups likewise wait up to 2 s: a first lookup
    # registers its namespaces, which on a loaded 2-core machine can outlast the 50 ms default,
    # and a (correctly) missed deadline makes the request recompute and store nothing (the bound
    # is tested on its own: test_lookups_keep_their_deadline_on_a_stalled_daemon_and_recover)
    return {"url": url, "block_tokens": BLOCK_TOKENS, "save_wait_ms": 5000, "lookup_deadline_ms": 2000,
            "namespace": {"model": model, "num_layers": LAYERS, "num_kv_heads": KV_HEADS,
                          "head_dim": HEAD_DIM, "kv_dtype": "float16"}}


# vLLM hands connectors every layer as its logical view (blocks, kv_heads, block_size, 2 * head_dim);
# the physical order is in the strides (vLLM's kv_cache_layout). Each test layout: the backend
# that reads it, and the physical order of the buffer behind the view.
LAYOUTS = {
    "BHN2D": ("FLASH_ATTN", None, (0, 1, 2, 3)),    # LBHNC: contiguous
    "BNH2D": ("FLASH_ATTN", None, (0, 2, 1, 3)),    # LBNHC: token-major (NHD)
    "HBN2D": ("TRITON_ATTN", None, (1, 0, 2, 3)),   # LHBNC: heads outermost
    "CPU": ("CPU_ATTN", "vec", (0, 1, 2, 3)),        # vLLM's CPU backend: K transposed per (block, head)
}


def layer_names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def paged_caches(layout: str = "BHN2D", seed: int = 0) -> dict[str, torch.Tensor]:
    """Per-layer paged caches as vLLM hands them to connectors, filled with random values."""
    g = torch.Generator().manual_seed(seed)
    order = LAYOUTS[layout][2]
    logical = (NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    physical = tuple(logical[i] for i in order)
    inverse = tuple(order.index(i) for i in range(4))
    return {name: torch.randn(physical, generator=g).half().permute(*inverse) for name in layer_names()}


def backend_class(name: str) -> type:
    """vLLM's attention backend class of `name` where vLLM is installed, else a stand-in with its
    name and module (what the connector identifies a backend by)."""
    from tierd.connectors.vllm_layout import KNOWN_BACKENDS
    module = KNOWN_BACKENDS[name]
    try:
        import importlib
        mod = importlib.import_module(module)
        for obj in vars(mod).values():
            if isinstance(obj, type) and obj.__module__ == module and callable(getattr(obj, "get_name", None)):
                try:
                    if obj.get_name() == name:
                        return obj
                except Exception:  # noqa: BLE001 - an abstract or odd class: not this one
                    continue
    except Exception:  # noqa: BLE001 - no vLLM, or a backend whose module needs a GPU library
        pass
    return type(f"StandIn{name.title().replace('_', '')}Backend", (),
                {"get_name": staticmethod(lambda: name), "__module__": module})


def forward_context(layout: str = "BHN2D", names: list[str] | None = None) -> dict:
    """vLLM's `compilation_config.static_forward_context` as the connector reads it: per layer its
    attention backend (and the CPU backend's ISA)."""
    from types import SimpleNamespace
    backend, isa = LAYOUTS[layout][:2]
    cls = backend_class(backend)
    return {n: SimpleNamespace(attn_backend=cls, isa=isa) for n in (names or layer_names())}


def block_kv(conn, block_id: int) -> torch.Tensor:
    """(layers, 2, block_size, kv_heads, head_dim) copy of one vLLM block, via the worker's views."""
    return torch.stack([torch.stack([k[block_id], v[block_id]]) for k, v in conn._layers]).clone()


class Objects:
    """Stand-ins; vllm_check.py subclasses this with vLLM's real classes."""

    def request(self, req_id: str, tokens: list[int], salt: str | None = None):
        from types import SimpleNamespace
        return SimpleNamespace(request_id=req_id, prompt_token_ids=list(tokens), all_token_ids=list(tokens),
                               cache_salt=salt, num_computed_tokens=0)

    load_errors: set

    def blocks(self, block_ids: list[int]):
        from types import SimpleNamespace
        return SimpleNamespace(get_block_ids=lambda: (list(block_ids),))

    def take_errors(self) -> set[int]:
        errors, self.load_errors = getattr(self, "load_errors", set()), set()
        return errors

    def append_token(self, request, token: int) -> None:
        request.all_token_ids.append(token)

    def output(self, new: list[tuple], cached: list[tuple] = (), finished: set[str] = frozenset()):
        """new: (request, block_ids, num_computed, num_scheduled); cached: (req_id, new_block_ids,
        num_computed, num_scheduled)."""
        from types import SimpleNamespace
        new_reqs = [SimpleNamespace(req_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                                    block_ids=(list(b),), num_computed_tokens=c) for r, b, c, _ in new]
        cached_reqs = SimpleNamespace(req_ids=[c[0] for c in cached], resumed_req_ids=set(),
                                      new_block_ids=[(list(c[1]),) if c[1] else None for c in cached],
                                      num_computed_tokens=[c[2] for c in cached])
        sched = {r.request_id: s for r, _, _, s in new} | {c[0]: c[3] for c in cached}
        return SimpleNamespace(scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs,
                               num_scheduled_tokens=sched, finished_req_ids=set(finished))


def step(sched, worker, objs, out=None, finished: set[str] = frozenset()) -> set[str]:
    """One engine step as vLLM's worker runs it: the scheduler builds metadata; the worker binds
    it, loads, 'runs', saves, and reports finished asynchronous loads and load errors (kept in
    `objs.load_errors`). Returns the requests whose asynchronous load finished."""
    if out is None:
        out, objs = objs, None
    meta = sched.build_connector_meta(out)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    for name in range(LAYERS):
        worker.wait_for_layer_load(f"model.layers.{name}.self_attn.attn")
    worker.wait_for_save()
    _, recving = worker.get_finished(set(finished))
    errors = worker.get_block_ids_with_load_errors()
    if objs is not None:
        objs.load_errors = getattr(objs, "load_errors", set()) | errors
    else:
        assert not errors, errors
    worker.clear_connector_metadata()
    return set(recving or ())


def admit(sched, objs, request, num_local: int, block_ids: list[int], worker=None, before_load=None) -> int:
    """vLLM admitting a waiting request: the lookup, the allocation, and for an asynchronous
    load the steps until the worker reports it (then the request is allocated again, with no
    external tokens, and scheduled by the caller)."""
    ext, is_async = sched.get_num_new_matched_tokens(request, num_local)
    assert ext or not is_async, (ext, is_async)
    sched.update_state_after_alloc(request, objs.blocks(block_ids), ext)
    if before_load is not None:
        before_load()
    if is_async:
        assert worker is not None, "an asynchronous load needs the worker to run"
        done, deadline = set(), time.monotonic() + 30
        while request.request_id not in done:
            assert time.monotonic() < deadline, "the asynchronous load was never reported"
            done |= step(sched, worker, objs, objs.output([]))
            time.sleep(0.001)
        sched.update_state_after_alloc(request, objs.blocks(block_ids), 0)
    return ext


def run_roundtrip(sched, worker, objs: Objects, store) -> None:
    """Store a prompt's blocks, then load them into other blocks for a second request."""
    torch.manual_seed(1)
    prompt = torch.randint(0, 32000, (100,)).tolist()
    # request A: nothing cached; 100 tokens in blocks 0..6; one prefill step fills tier blocks 0-2
    a = objs.request("A", prompt)
    assert admit(sched, objs, a, 0, list(range(7)), worker) == 0
    step(sched, worker, objs, objs.output([(a, range(7), 0, 100)]))
    assert worker.flush(30)
    assert worker.stats["stored_blocks"] == 3, worker.stats
    sched.request_finished(a, list(range(7)))
    stored = {b: block_kv(worker, b) for b in range(7)}

    # request B: same 96-token prefix, new tail; loads 3 tier blocks into blocks 10..15
    b = objs.request("B", prompt[:96] + [7] * 24)
    ext = admit(sched, objs, b, 0, list(range(10, 18)), worker)
    assert ext == 96
    before = block_kv(worker, 16)
    step(sched, worker, objs, objs.output([(b, range(10, 18), 96, 24)]))
    for i in range(6):
        assert torch.equal(block_kv(worker, 10 + i), stored[i]), f"block {10 + i} != stored block {i}"
    assert torch.equal(block_kv(worker, 16), before), "a block past the hit was written"
    assert objs.take_errors() == set()
    sched.request_finished(b, list(range(10, 18)))

    # request C: vLLM's own prefix cache holds 32 tokens (blocks 0, 1): only the rest is loaded,
    # and blocks 0 and 1 (shared with other requests in vLLM) are never written
    c = objs.request("C", prompt + [5, 6, 7])
    for k, v in worker._layers:
        k[0].fill_(3.0)
        v[1].fill_(-3.0)
    sentinel = {0: block_kv(worker, 0), 1: block_kv(worker, 1)}
    ext = admit(sched, objs, c, 32, [0, 1, 20, 21, 22, 23, 24], worker)
    assert ext == 64
    step(sched, worker, objs, objs.output([(c, [0, 1, 20, 21, 22, 23, 24], 96, 7)]))
    assert torch.equal(block_kv(worker, 0), sentinel[0]) and torch.equal(block_kv(worker, 1), sentinel[1])
    for i in range(2, 6):
        assert torch.equal(block_kv(worker, 18 + i), stored[i])
    sched.request_finished(c, [0, 1, 20, 21, 22, 23, 24])

    # the last prompt token is always computed: a prompt of exactly 3 tier blocks loads 95 tokens
    d = objs.request("D", prompt[:96])
    assert admit(sched, objs, d, 0, list(range(30, 36)), worker) == 95
    step(sched, worker, objs, objs.output([(d, range(30, 36), 95, 1)]))
    for i in range(6):
        assert torch.equal(block_kv(worker, 30 + i), stored[i])
    sched.request_finished(d, list(range(30, 36)))

    # another cache_salt never hits
    e = objs.request("E", prompt, salt="tenant-2")
    assert admit(sched, objs, e, 0, list(range(40, 47)), worker) == 0
    sched.request_finished(e, list(range(40, 47)))

    # decode steps fill more tier blocks: A's continuation stores tier block 3 once 128 tokens exist
    f = objs.request("F", prompt + list(range(1000, 1027)))     # 127 tokens
    assert admit(sched, objs, f, 0, list(range(48, 56)), worker) == 96
    stored_before = worker.stats["stored_blocks"]
    step(sched, worker, objs, objs.output([(f, range(48, 56), 96, 31)]))
    objs.append_token(f, 9)                                       # the sampled token
    step(sched, worker, objs, objs.output([], cached=[("F", [], 127, 1)]))
    assert worker.flush(30)
    assert worker.stats["stored_blocks"] == stored_before + 1, worker.stats
    sched.request_finished(f, list(range(48, 56)))


def run_load_error(sched, worker, objs: Objects, store) -> None:
    """Blocks evicted between the scheduler's lookup and the worker's load are reported."""
    torch.manual_seed(2)
    prompt = torch.randint(0, 32000, (70,)).tolist()
    a = objs.request("G", prompt)
    admit(sched, objs, a, 0, list(range(5)), worker)
    step(sched, worker, objs, objs.output([(a, range(5), 0, 70)]))
    assert worker.flush(30)
    sched.request_finished(a, list(range(5)))
    b = objs.request("H", prompt)
    # every block gone after the lookup, before the worker loads
    assert admit(sched, objs, b, 0, list(range(50, 55)), worker, before_load=store.flush) == 64
    step(sched, worker, objs, objs.output([(b, range(50, 55), 64, 6)]))
    assert objs.take_errors() == {50, 51, 52, 53}
    step(sched, worker, objs, objs.output([]))
    assert objs.take_errors() == set()                        # reported once
    sched.request_finished(b, list(range(50, 55)))


# -- hybrid models: a sliding-window group and a full-attention group (vLLM's hybrid manager) -----
WINDOW = 8                      # tokens of the sliding window (less than a tier block: parts go)
SLIDING_LAYERS, FULL_LAYERS = (0, 2), (1, 3)


def hybrid_kv_cache_config():
    """Groups as vLLM's hybrid manager makes them for a model of window and full layers
    (stand-ins of its spec classes; tests/vllm_check.py uses vLLM's own)."""
    from types import SimpleNamespace
    names = layer_names()
    sliding = type("SlidingWindowSpec", (), {"block_size": BLOCK_SIZE, "sliding_window": WINDOW})()
    full = type("FullAttentionSpec", (), {"block_size": BLOCK_SIZE})()
    return SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=sliding, layer_names=[names[i] for i in SLIDING_LAYERS]),
        SimpleNamespace(kv_cache_spec=full, layer_names=[names[i] for i in FULL_LAYERS])])


def hybrid_paged_caches(seed: int = 0) -> dict[str, torch.Tensor]:
    """Layers 0 and 1 share one allocation, layers 2 and 3 another, as vLLM lays out a hybrid
    model: a block id is one group's at a time, and the other group's layer aliases its bytes."""
    one, two = paged_caches("BHN2D", seed)["model.layers.0.self_attn.attn"], \
        paged_caches("BHN2D", seed + 1)["model.layers.0.self_attn.attn"]
    names = layer_names()
    return {names[0]: one, names[1]: one, names[2]: two, names[3]: two}


def layer_block(conn, layer: int, block_id: int) -> torch.Tensor:
    k, v = conn._layers[layer]
    return torch.stack([k[block_id], v[block_id]]).clone()


class GroupObjects(Objects):
    """Block tables per KV cache group, and vLLM's live table in the scheduler output."""

    def blocks(self, table):
        from types import SimpleNamespace
        return SimpleNamespace(get_block_ids=lambda: tuple(list(r) for r in table))

    def live_output(self, new, cached=(), live=None):
        """new: (request, table, num_computed, num_scheduled); cached: (req_id, new_table or None,
        num_computed, num_scheduled); live: {req_id: table} as vLLM's manager holds it now."""
        from types import SimpleNamespace
        live = dict(live or {})
        new_reqs = [SimpleNamespace(req_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                                    block_ids=tuple(list(x) for x in t), num_computed_tokens=c) for r, t, c, _ in new]
        cached_reqs = SimpleNamespace(req_ids=[c[0] for c in cached], resumed_req_ids=set(),
                                      new_block_ids=[tuple(list(x) for x in c[1]) if c[1] else None for c in cached],
                                      num_computed_tokens=[c[2] for c in cached])
        sched = {r.request_id: s for r, _, _, s in new} | {c[0]: c[3] for c in cached}
        state = SimpleNamespace(get_block_ids=lambda rid: tuple(list(x) for x in live[rid]) if rid in live else None)
        return SimpleNamespace(scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs,
                               num_scheduled_tokens=sched, finished_req_ids=set(),
                               kv_connector_block_state=state)


def run_hybrid(sched, worker, objs: GroupObjects, store) -> None:
    """A sliding-window group (layers 0, 2; window 8) beside a full-attention group (1, 3), block
    ids per group from one pool, the groups' layers aliasing each other's memory.

    A stores 100 tokens in two chunks (56, then 44 tokens): by the second step the window has
    freed A's sliding blocks 0-2, and block 3 already holds another request's bytes. A fresh
    request B loads the prefix: each layer is written only through its group's ids, the sliding
    layers only into the window's tail, and nothing of another group or request changes."""
    torch.manual_seed(3)
    prompt = torch.randint(0, 32000, (100,)).tolist()
    a = objs.request("HA", prompt)
    slide, full = [1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]
    assert admit(sched, objs, a, 0, (slide[:4], full[:4]), worker) == 0
    step(sched, worker, objs.live_output([(a, (slide[:4], full[:4]), 0, 56)], live={"HA": (slide[:4], full[:4])}))
    assert worker.flush(30)
    assert worker.stats["stored_blocks"] == 1            # tier block 0 (tokens 0-31)
    kept = {(layer, b): layer_block(worker, layer, b) for layer in range(LAYERS) for b in range(NUM_BLOCKS)}
    # step 2 (C = 56): vLLM freed the sliding blocks wholly before token 56 - 8 + 1 (ids 1, 2, 3)
    # and gave block 3 to another request, which wrote it
    for k, v in (worker._layers[i] for i in SLIDING_LAYERS):
        k[3].fill_(9.0)
        v[3].fill_(-9.0)
    live = ([0, 0, 0] + slide[3:], full)
    step(sched, worker, objs.live_output([], cached=[("HA", (slide[4:], full[4:]), 56, 44)], live={"HA": live}))
    assert worker.flush(30)
    assert worker.stats["stored_blocks"] == 3            # tier blocks 1 and 2
    sched.request_finished_all_groups(a, live)
    # tier block 1 (tokens 32-63): its sliding layers hold zeros for tokens 32-47 (gone by
    # then), A's bytes for 48-63 (the window of any hit ending at 64 or later)
    ns = worker.namespace("")
    assert ns.attention.startswith("vllm-groups-v1/"), ns.attention
    keys = ns.block_keys(prompt[:96])
    got = torch.from_numpy(store.get(ns, keys[1:2])[0]).view(torch.float16).view(
        LAYERS, 2, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    for layer in SLIDING_LAYERS:
        assert not got[layer, :, 0].any(), "a freed block's (another request's) bytes were stored"
        assert torch.equal(got[layer, 0, 1], kept[(layer, 4)][0]) and torch.equal(got[layer, 1, 1], kept[(layer, 4)][1])
    for layer in FULL_LAYERS:
        assert torch.equal(got[layer, 0, 0], kept[(layer, 10)][0]) and torch.equal(got[layer, 1, 1], kept[(layer, 11)][1])
    stored_a = {(layer, b): layer_block(worker, layer, b) for layer in range(LAYERS) for b in range(NUM_BLOCKS)}

    # B: the same 100 tokens, fresh; the hit is 96 tokens (3 tier blocks); vLLM's table for the
    # sliding group has nulls for blocks 0-4 (before token 96 - 8 + 1) and blocks 21, 22
    b = objs.request("HB", prompt)
    table = ([0, 0, 0, 0, 0, 21, 22], [30, 31, 32, 33, 34, 35, 36])
    before = {(layer, blk): layer_block(worker, layer, blk) for layer in range(LAYERS) for blk in range(NUM_BLOCKS)}
    assert admit(sched, objs, b, 0, table, worker) == 96
    step(sched, worker, objs.live_output([(b, table, 96, 4)], live={"HB": table}))
    assert objs.take_errors() == set()
    written = {(layer, blk) for layer in SLIDING_LAYERS for blk in (21,)} | \
              {(layer, blk) for layer in FULL_LAYERS for blk in range(30, 36)}
    for layer in SLIDING_LAYERS:                      # the window's tail: A's block of tokens 80-95
        assert torch.equal(layer_block(worker, layer, 21), stored_a[(layer, 6)])
    for layer in FULL_LAYERS:
        for i in range(6):
            assert torch.equal(layer_block(worker, layer, 30 + i), stored_a[(layer, full[i])])
    # the aliasing: layer 0 is layer 1's memory (2 is 3's); a block is one group's at a time
    for layer in range(LAYERS):
        alias = layer ^ 1
        for blk in range(NUM_BLOCKS):
            if (layer, blk) not in written and (alias, blk) not in written:
                assert torch.equal(layer_block(worker, layer, blk), before[(layer, blk)]), (layer, blk)
    sched.request_finished_all_groups(b, table)


# -- recurrent state (Mamba / linear attention) beside attention (vLLM's hybrid manager) ----------
STATE_LAYERS, ATTN_LAYER = (0, 1, 2), 3
STATE_SHAPES, STATE_DTYPES = ((3, 8), (2, 4, 4)), (torch.bfloat16, torch.float32)
STATE_BYTES = 3 * 8 * 2 + 2 * 4 * 4 * 4        # conv state, then the recurrent state
STATE_PAGE = 256                               # vLLM pads each layer's page (to the attention page)


def state_kv_cache_config(mode: str = "align"):
    """Groups as vLLM makes them for a model of three linear-attention layers and one attention
    layer (Qwen3-Next-like): a state group per state layer, and one attention group."""
    from types import SimpleNamespace
    names = layer_names()
    state = type("MambaSpec", (), {"block_size": BLOCK_SIZE, "shapes": STATE_SHAPES, "dtypes": STATE_DTYPES,
                                   "mamba_cache_mode": mode, "mamba_type": "gdn_attention"})()
    full = type("FullAttentionSpec", (), {"block_size": BLOCK_SIZE})()
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=state, layer_names=[names[i]])
                                            for i in STATE_LAYERS] +
                           [SimpleNamespace(kv_cache_spec=full, layer_names=[names[ATTN_LAYER]])])


def state_paged_caches(seed: int = 0) -> dict[str, torch.Tensor]:
    """The attention layer's paged cache, and each state layer's raw pages as vLLM hands them
    over: (blocks, 1, 1, bytes of its states), views into pages of STATE_PAGE bytes."""
    names = layer_names()
    out = {names[ATTN_LAYER]: paged_caches("BHN2D", seed)[names[ATTN_LAYER]]}
    g = torch.Generator().manual_seed(seed + 1)
    for i in STATE_LAYERS:
        raw = torch.randint(-128, 128, (NUM_BLOCKS, STATE_PAGE), generator=g, dtype=torch.int8)
        out[names[i]] = raw[:, :STATE_BYTES].view(NUM_BLOCKS, 1, 1, STATE_BYTES)
    return out


def state_page(conn, layer: int, block_id: int) -> torch.Tensor:
    return conn._state_pages[STATE_LAYERS.index(layer)][block_id].clone()


def run_state(sched, worker, objs: "GroupObjects", store) -> None:
    """A stores 40 tokens in two steps (32, then 8): the first ends on a block boundary, so vLLM
    holds the state after token 32 in each state group's block 1; the second ends mid-block
    (no state saved). A fresh B loads 32 tokens: the attention blocks and that state, into B's
    state blocks at index 1; nothing else changes. C shares A's first 16 tokens only: their KV
    is stored but no state after token 16 is, so C gets no hit. D's load finds the tier
    flushed after its lookup: vLLM is told the request failed (it recomputes it whole; block
    ids would be ambiguous across groups), never given block ids."""
    torch.manual_seed(4)
    prompt = torch.randint(0, 32000, (40,)).tolist()
    a = objs.request("SA", prompt)
    states = [[0, 5, 6] for _ in STATE_LAYERS]          # vLLM's state blocks (block 0 nulled)
    attn = [1, 2, 3]
    table = (*states, attn)
    assert admit(sched, objs, a, 0, table, worker) == 0
    step(sched, worker, objs.live_output([(a, table, 0, 32)], live={"SA": table}))
    assert worker.flush(30)
    saved = {(layer, b): state_page(worker, layer, b) for layer in STATE_LAYERS for b in (5, 6)}
    kv_saved = {b: layer_block(worker, 0, b) for b in attn}    # (the tier block's one layer)
    step(sched, worker, objs.live_output([], cached=[("SA", None, 32, 8)], live={"SA": table}))
    assert worker.flush(30)
    assert worker.stats["stored_blocks"] == 2 + 1, worker.stats   # 2 KV blocks (tokens 0-31), 1 state
    sched.request_finished_all_groups(a, table)
    sns = worker.state_namespace("")
    assert sns.state and sns.block_bytes == len(STATE_LAYERS) * STATE_BYTES
    got = store.get(sns, sns.block_keys(prompt[:32])[1:2])[0]
    assert bytes(got) == b"".join(bytes(saved[(layer, 5)].numpy()) for layer in STATE_LAYERS)

    b = objs.request("SB", prompt)
    states_b = [[0, 20, 21] for _ in STATE_LAYERS]
    table_b = (*states_b, [30, 31, 32])
    before = {(layer, blk): state_page(worker, layer, blk) for layer in STATE_LAYERS for blk in range(NUM_BLOCKS)}
    assert admit(sched, objs, b, 0, table_b, worker) == 32
    assert objs.take_errors() == set()
    for layer in STATE_LAYERS:
        assert torch.equal(state_page(worker, layer, 20), saved[(layer, 5)]), layer
        for blk in range(NUM_BLOCKS):
            if blk != 20:
                assert torch.equal(state_page(worker, layer, blk), before[(layer, blk)]), (layer, blk)
    for i in range(2):
        assert torch.equal(layer_block(worker, 0, 30 + i), kv_saved[attn[i]])
    assert worker.get_transfer_results(set()).failed_recving == set()
    sched.request_finished_all_groups(b, table_b)

    c = objs.request("SC", prompt[:16] + [7] * 24)
    misses = sched.stats["state_misses"]
    assert sched.get_num_new_matched_tokens(c, 0) == (0, False)
    assert sched.stats["state_misses"] == misses + 1

    d = objs.request("SD", prompt)
    table_d = (*[[0, 40, 41] for _ in STATE_LAYERS], [42, 43, 44])
    ext, is_async = sched.get_num_new_matched_tokens(d, 0)
    assert (ext, is_async) == (32, True)
    sched.update_state_after_alloc(d, objs.blocks(table_d), ext)
    store.flush()
    failed, done, deadline = set(), set(), time.monotonic() + 30
    while "SD" not in done:
        assert time.monotonic() < deadline
        done |= step(sched, worker, objs, objs.live_output([]))
        # (what vLLM asks instead of get_finished: a load that ends in between is reported here)
        results = worker.get_transfer_results(set())
        done |= results.finished_recving
        failed |= results.failed_recving
        time.sleep(0.001)
    failed |= worker.get_transfer_results(set()).failed_recving
    assert failed == {"SD"} and objs.take_errors() == set()
