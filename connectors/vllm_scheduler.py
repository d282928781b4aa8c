"""The vLLM connector's scheduler half: each request's tier keys, the lookups that decide how
many prompt tokens load from tierd, and the per-step metadata telling the workers what to load
and save (`TierdConnector` in connectors/vllm.py combines it with the worker half).

Block ids are per KV cache group (connectors/vllm_groups.py); models with recurrent state
(Mamba, linear attention) also save that state where a step ends on a tier-block boundary, in a
state namespace beside the KV one, and load it with the KV of a hit. The table a step saves from is
vLLM's live one (`scheduler_output.kv_connector_block_state`) where vLLM offers it: a sliding
window frees blocks that leave it without telling connectors, and a freed block may already be
another request's. Without it (vLLM versions or drivers that do not offer it) the table is kept
from the step outputs, and a model with sliding windows saves nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from tierd.errors import TierdError
from tierd.keys import extend_keys

from .link import STORE_ERRORS
from .vllm_base import CacheHitSource, timed
from .vllm_keys import block_extra
from .vllm_meta import LoadSpec, SaveSpec, TierdConnectorMetadata

log = logging.getLogger("tierd.connectors.vllm")

MAX_LOAD_ATTEMPTS = 2   # a request whose load failed twice is not offered tier hits again


@dataclass
class _Req:
    """Scheduler-side state of one request."""

    request: Any
    salt: str
    keys: list[list[bytes]]              # per rank
    state_keys: list[list[bytes]] = field(default_factory=list)   # per rank: the state namespace's
    extra: Any = None                    # block -> extra key bytes (LoRA, images, embeddings)
    table: list[list[int]] = field(default_factory=list)   # vLLM block ids per KV cache group
    saved: int = 0            # leading tier blocks every rank holds or has been sent
    hit: int = 0              # tier blocks the last lookup found on every rank
    hit_host: int | None = None   # of those, the leading ones in host RAM (None: not asked)
    local: int = 0            # tokens vLLM's own prefix cache had at that lookup
    load_async: bool = False  # how the load of that lookup goes
    load_attempts: int = 0
    plan: Any = None          # the cost model's plan at that lookup (tierd/costs.py)
    declined_counted: bool = False
    load: bool = True         # the request's own say (`kv_transfer_params`): look up and load,
    store: bool = True        # and store its blocks


def tier_use(params: Any) -> tuple[bool, bool]:
    """What a request lets the tier do, from its `kv_transfer_params`: (load, store). Its
    "tierd" entry is `false` (neither), `true` (both, the default) or {"load": bool, "store":
    bool} (a missing one: true). Anything else raises TierdError: a request whose wish cannot be
    read is not cached at all (a mistyped "store": false must not store a private prompt)."""
    if params is None:
        return True, True
    if not isinstance(params, dict):
        raise TierdError(f"kv_transfer_params must be a dict, not {type(params).__name__}")
    use = params.get("tierd", True)
    if isinstance(use, bool):
        return use, use
    if isinstance(use, dict) and set(use) <= {"load", "store"} and all(isinstance(v, bool) for v in use.values()):
        return use.get("load", True), use.get("store", True)
    raise TierdError(f'kv_transfer_params["tierd"]={use!r}: use true, false or {{"load": bool, "store": bool}}')


class SchedulerHalf:
    """Part of `TierdConnector`: the methods vLLM calls on the scheduler's connector."""

    def _state(self, request) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            salt = getattr(request, "cache_salt", None) or ""
            load, store = tier_use(getattr(request, "kv_transfer_params", None))
            st = _Req(request, salt, [[] for _ in range(self.key_ranks)],
                      [[] for _ in range(self.key_ranks)] if self.groups.has_state else [],
                      extra=block_extra(request, self.block_tokens), load=load, store=store)
            if not (load and store):
                self.stats["requests_opted_out"] += 1
            self._reqs[request.request_id] = st
        st.request = request
        return st

    def _extend(self, st: _Req, n_blocks: int) -> None:
        tokens = st.request.all_token_ids
        for rank in range(self.key_ranks):
            extend_keys(st.keys[rank], self.namespace(st.salt, rank).root_key, tokens, self.block_tokens,
                        n_blocks, st.extra)
            if st.state_keys:
                extend_keys(st.state_keys[rank], self.state_namespace(st.salt, rank).root_key, tokens,
                            self.block_tokens, n_blocks, st.extra)

    # -- lookups --------------------------------------------------------------------------------
    @timed("sched_s")
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.disabled:
            return 0, False
        tokens = request.all_token_ids
        n_full = len(tokens) // self.block_tokens
        if n_full * self.block_tokens <= num_computed_tokens:
            return 0, False
        try:
            st = self._state(request)
        except (TierdError, OSError) as e:   # something that changes KV and cannot be keyed (an adapter
            self._not_keyed(request, e)      # being replaced, say): that request only, no tier at all
            return 0, False
        if st.load_attempts >= MAX_LOAD_ATTEMPTS or not st.load:
            return 0, False
        store = self.link.get()
        if store is None:
            return 0, False
        self._extend(st, n_full)
        self.stats["lookups"] += 1
        auto = self.load_mode == "auto"
        decide = self.load_policy == "decide"
        try:
            if self.key_ranks == 1 and not auto and not decide:
                n = n_host = store.lookup(self.namespace(st.salt, 0), st.keys[0][:n_full])
            else:   # one round trip for every stage and rank; the hit is what all of them hold
                found = store.lookup_all([(self.namespace(st.salt, r), st.keys[r][:n_full])
                                          for r in range(self.key_ranks)], host=auto or decide)
                if auto or decide:
                    n, n_host = min(f[0] for f in found), min(f[1] for f in found)
                else:
                    n = n_host = min(found)
            if decide and n > num_computed_tokens // self.block_tokens:
                n = self._decide(st, n, n_host, num_computed_tokens, len(tokens))
            if st.state_keys and n:
                n = self._state_hit(store, st, min(n, (len(tokens) - 1) // self.block_tokens),
                                    num_computed_tokens // self.block_tokens)
        except STORE_ERRORS as e:
            if isinstance(e, TimeoutError) or "timed out" in str(e):
                self.stats["lookup_timeouts"] += 1
            self.link.failed(e, "lookup")
            return 0, False
        self.link.ok()
        st.hit, st.local = n, num_computed_tokens
        st.hit_host = min(n_host, n) if auto or decide else None
        # Every stored tier block carries what every KV cache group needs for a hit ending at
        # it (a sliding window's tail included: vllm_groups), so the hit is the stored prefix
        # (with recurrent state: the longest one whose end has a stored state, `_state_hit`).
        hit = min(n * self.block_tokens, len(tokens) - 1)   # the last token is always computed
        ext = max(0, hit - num_computed_tokens)
        st.load_async = bool(ext) and self._load_async(num_computed_tokens, ext, n_host, st.salt)
        return ext, st.load_async

    # -- what vLLM reports of hits and preemptions ----------------------------------------------
    @property
    def requires_kv_delivery(self) -> bool:
        """False: tierd is a best-effort cache. vLLM then lets a request preempted while its
        blocks are still being saved keep its output (a save it drops is a later miss), where
        a connector that must deliver KV has the request recomputed."""
        return False

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        """The tokens this connector loads for `request`, by tier, for vLLM's metrics: those in
        blocks the lookup found in host RAM under HOST; the rest (disk or the remote tier, which
        a lookup does not tell apart) unspecified. With a fixed load mode the lookup asks no
        tier (`load_mode` "auto" asks, and so does `load_policy` "decide"), so all of them are
        unspecified."""
        if num_external_tokens <= 0:
            return {}
        st = self._reqs.get(request.request_id)
        if st is None or st.hit_host is None:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        host = min(num_external_tokens, max(0, st.hit_host * self.block_tokens - st.local))
        out = {CacheHitSource.HOST: host} if host else {}
        if num_external_tokens > host:
            out[CacheHitSource.EXTERNAL_UNSPECIFIED] = num_external_tokens - host
        return out

    def _state_hit(self, store, st: _Req, most: int, local: int) -> int:
        """The most tier blocks (≤ `most`, > `local`) whose end has a stored recurrent state on
        every rank (states are kept only where a step ended: not every block has one); 0 if
        none. One round trip."""
        cands = list(range(most, local, -1))
        if not cands:
            return 0
        found = store.lookup_all([(self.state_namespace(st.salt, r), [st.state_keys[r][k - 1]])
                                  for k in cands for r in range(self.key_ranks)])
        for i, k in enumerate(cands):
            if all(found[i * self.key_ranks:(i + 1) * self.key_ranks]):
                return k
        self.stats["state_misses"] += 1
        return 0

    def _decide(self, st: _Req, n: int, n_host: int, computed: int, n_tokens: int) -> int:
        """Of the `n` tier blocks found (the first `n_host` in host RAM, the rest below it), the
        leading ones worth loading by the node's cost model (tierd/costs.py): the others are
        computed, which the model predicts to be faster. Tokens declined go in its ledger once
        per request."""
        model = self.link.cost_model()
        if model is None:
            return n
        bt, local = self.block_tokens, computed // self.block_tokens
        ns = self.namespace(st.salt, 0)
        tiers = ["host" if i < n_host else "disk" for i in range(local, n)]
        plan = model.plan(self.engine_key, tiers, ns.block_bytes, bt, first_tokens=local * bt,
                          usable_tokens=n_tokens - 1 - local * bt)
        st.plan = plan
        if not st.declined_counted:
            st.declined_counted = True
            for tier, blocks in plan.declined().items():
                model.count(tier, declined_tokens=blocks * bt)
                self.stats["declined_tokens"] += blocks * bt
        tier, run = plan.probe_run(st.keys[0][local:n])
        if run:
            self.link.probe(ns, run, tier, model)
        return local + plan.blocks

    def _load_async(self, start: int, ext: int, n_host: int, salt: str) -> bool:
        """Whether a load goes through vLLM's asynchronous path: always, never, or ("auto") when
        it needs a promotion from disk or is large — a small load from host RAM is a memcpy,
        cheaper done before the step than one engine step of waiting."""
        if self.load_mode != "auto":
            return bool(self.load_mode)
        last_tier = -(-(start + ext) // self.block_tokens)
        nbytes = (last_tier - start // self.block_tokens) * self.namespace(salt, 0).block_bytes
        return last_tier > n_host or nbytes > self.async_min_bytes

    def _not_keyed(self, request, e: Exception) -> None:
        self.stats["requests_not_keyed"] += 1
        self._unkeyable.add(request.request_id)
        log.warning("request %s is not cached in tierd: %s", request.request_id, e)

    # -- loads ----------------------------------------------------------------------------------
    @timed("sched_s")
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if self.disabled or request.request_id in self._unkeyable:
            return
        try:
            st = self._state(request)
        except (TierdError, OSError) as e:
            self._not_keyed(request, e)
            return
        st.saved = max(st.saved, st.hit)
        if num_external_tokens <= 0:
            return
        bt, bs = self.block_tokens, self.block_size
        start, end = st.local, st.local + num_external_tokens
        first_tier, last_tier = start // bt, -(-end // bt)
        first_block, last_block = start // bs, -(-end // bs)
        table = self._groups_of(blocks.get_block_ids() if blocks is not None else ())
        if table is None or any(len(row) < last_block for row in table):
            log.warning("request %s: the blocks allocated do not cover %d tokens in every KV cache group; "
                        "not loading", request.request_id, end)
            return
        self._extend(st, last_tier)
        state_keys, state_ids = [], []
        if st.state_keys:
            # the state after the hit's last token, into the group's block there: before the step
            # that computes on it (these loads are asynchronous, `fail_whole`), at whose start vLLM
            # copies it into the request's running state block
            ids = self.groups.state_ids(table, end // bs - 1)
            if end % bt or ids is None:
                log.warning("request %s: no state block for a %d-token hit; not loading", request.request_id, end)
                return
            state_keys, state_ids = [k[last_tier - 1] for k in st.state_keys], [[b] for b in ids]
        st.load_attempts += 1
        deadline = st.plan.deadline_s if st.plan is not None and not state_keys else float("inf")
        self._loads.append(LoadSpec(request.request_id, st.salt,
                                    [k[first_tier:last_tier] for k in st.keys], first_tier, first_block,
                                    self.groups.ids(table, first_block, last_block), st.load_async,
                                    state_keys, state_ids, deadline))
        self.stats["hit_blocks"] += last_tier - first_tier
        self.stats["loaded_tokens"] += num_external_tokens
        if st.load_async:
            self.stats["loads_async"] += 1

    def _groups_of(self, table) -> list[list[int]] | None:
        """vLLM's block ids (a list per KV cache group) as lists; None if they are not one per
        group of this model."""
        table = [list(row) for row in (table or ())]
        return table if len(table) == len(self.groups) else None

    # -- per-step metadata and saves --------------------------------------------------------------
    @timed("sched_s")
    def build_connector_meta(self, scheduler_output) -> TierdConnectorMetadata:
        meta = TierdConnectorMetadata()
        if self.disabled:
            return meta
        spent = self.stats.get("sched_s", 0.0)     # (this call's own time goes with the next)
        meta.sched_s, self._sched_sent = spent - self._sched_sent, spent
        meta.loads, self._loads = self._loads, []
        self.link.cost_model()     # the node's measurements come in when due, off this thread
        scheduled = scheduler_output.num_scheduled_tokens
        live = getattr(scheduler_output, "kv_connector_block_state", None)
        # (what this step's forward computes, per request: the workers time it for the cost model)
        cached = scheduler_output.scheduled_cached_reqs
        meta.forward = [(scheduled.get(nr.req_id, 0), nr.num_computed_tokens)
                        for nr in scheduler_output.scheduled_new_reqs]
        meta.forward += [(scheduled.get(r, 0), cached.num_computed_tokens[i]) for i, r in enumerate(cached.req_ids)]
        for nr in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(nr.req_id)
            if st is None:
                continue
            st.table = self._groups_of(nr.block_ids) or []
            self._plan(meta, st, live, nr.num_computed_tokens, scheduled.get(nr.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = self._groups_of(cached.new_block_ids[i])
            if req_id in (getattr(cached, "resumed_req_ids", None) or ()):
                st.table = new_ids or []
            elif new_ids:
                st.table = [old + new for old, new in zip(st.table, new_ids)] if st.table else new_ids
            self._plan(meta, st, live, cached.num_computed_tokens[i], scheduled.get(req_id, 0))
        for req_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
            self._reqs.pop(req_id, None)
            self._unkeyable.discard(req_id)
        return meta

    def _plan(self, meta: TierdConnectorMetadata, st: _Req, live, computed: int, scheduled: int) -> None:
        """Save the tier blocks that this step completes."""
        bt = self.block_tokens
        full = min(computed + scheduled, len(st.request.all_token_ids)) // bt
        if full <= st.saved:
            return
        if not st.store or self.link.backing_off:   # the request said no, or tierd is down
            st.saved = full
            return
        table = self._groups_of(live.get_block_ids(st.request.request_id)) if live is not None else None
        if table is not None:
            st.table = table               # vLLM's own, with the blocks a window has freed nulled
        elif self.groups.sliding:          # a kept table may name blocks a window has freed
            self.stats["stores_skipped"] += full - st.saved
            st.saved = full
            return
        is_live = table is not None
        table = st.table
        if not table:
            return
        full = min(full, min(len(row) for row in table) // self.ratio)
        if full <= st.saved:
            return
        self._extend(st, full)
        j0 = j1 = st.saved
        while j1 < full and self.groups.complete(table, j1 * bt, (j1 + 1) * bt, self.block_size):
            j1 += 1
        if j1 < full:     # a window's tail already gone (saved late): those blocks are not stored
            self.stats["stores_skipped"] += full - j1
        state_keys, state_ids = self._state_save(st, table if is_live else None, computed + scheduled, j1)
        if j1 > j0 or state_keys:
            meta.saves.append(SaveSpec(st.salt, [k[j0:j1] for k in st.keys],
                                       [k[j0 - 1] if j0 else None for k in st.keys],
                                       self.groups.ids(table, j0 * self.ratio, j1 * self.ratio),
                                       list(st.request.all_token_ids[j0 * bt:j1 * bt]), state_keys, state_ids))
        st.saved = full

    def _state_save(self, st: _Req, table, end: int, stored: int) -> tuple[list[bytes], list[int]]:
        """The recurrent state this step leaves at a tier-block boundary, to save beside the
        blocks (keys per rank, vLLM block per state group), or nothing: vLLM holds the state
        after token `end` in the group's block `end / block_size - 1` only when the step ends
        exactly there, and only the live table says the block is still the request's. Saved
        only once the KV up to `end` is stored (`stored` tier blocks) or being stored."""
        if not st.state_keys or end % self.block_tokens or end > len(st.request.all_token_ids):
            return [], []
        if table is None:
            self.stats["stores_skipped"] += 1
            return [], []
        j = end // self.block_tokens - 1
        ids = self.groups.state_ids(table, j) if 0 <= j < stored else None
        if ids is None:
            return [], []
        return [k[j] for k in st.state_keys], ids

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saved blocks were copied out during the steps that filled them, and vLLM itself keeps
        # the blocks of a request whose load is still running: vLLM may free them now.
        self._reqs.pop(request.request_id, None)
        self._unkeyable.discard(request.request_id)
        return False, None

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """What vLLM calls instead of `request_finished` on a `SupportsHMA` connector."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])
