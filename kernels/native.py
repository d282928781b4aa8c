"""The CPU kernels in C (`cpu_copy.c`): what `gather_blocks` / `scatter_blocks` run for CPU
caches, and `paged_attention_decode` for the bundled engine's decode steps on the CPU, once each
has matched its torch reference (`kernels/dispatch.py`).

The reference copies a transposed cache (vLLM's CPU attention keeps K as (head_dim, tokens) per
block and head) through torch's strided copy, one element at a time, at about a fifth of memcpy
here, and a contiguous cache through one ctypes memmove per run, from Python. The C copy
transposes in 8 x 8 tiles (AVX for 4-byte elements, SSE2 for 2-byte ones, where the compiler
targets them) and takes every block of a plane in one call; a transposing load first reads the
block's plane (or each head's part of it) in order into a per-thread buffer that stays in the
core's L2 cache, and tiles out of that, since tiles read straight out of DRAM ran at 0.6-0.75 of
memcpy here against 0.8-1.0 through the buffer. vLLM's "amx" CPU attention layout
(bf16 K in 16-token tiles of head_dim pairs, V in 16-column tiles of token pairs) is copied by
the same tile transposes over 4-byte pairs (K) and by pair interleaves (V). A `CopyPlan` holds
one set of caches' geometry, checked once (kernels/transfer.py keeps one per BlockTransfer), so a
load of a few blocks does not spend more on Python-level checks than on the copy; runs of
consecutive engine blocks go in one memcpy. A copy of over a MiB (`STREAM_MIN_BYTES`) writes
its destination through streaming stores, 16 KiB at a time as four interleaved page streams,
and fences them before it returns: its destination's lines are not read first, which makes a
load out of DRAM about as fast as memcpy's own large copy (1.4x a plain-store copy at 128 MiB).
A copy of 4 MiB or more (`SPLIT_MIN_BYTES`) is also split by plane and layer into items of about
a MiB, which a team of `copy_threads()` threads takes in turn (one C call), since one core does
not reach the memory's bandwidth: on the main thread, the OpenMP team torch computes with
(`omp_team()`: its threads are still spinning after a forward, and a thread of our own would wait
for a core behind them); elsewhere the caller and helper threads of our own. A thread that joins
late takes fewer, and the caller never waits for a share it could have copied itself.

The source is compiled at first use, once per process, by the system C compiler (`$CC`, else
`cc`) for this machine (`-march=native`), in a private temporary directory that is removed once
the library is loaded. Without a compiler, or if the build or the self-check fails, the torch
reference runs: slower, never wrong.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("tierd.kernels")

SOURCE = Path(__file__).resolve().parent / "cpu_copy.c"
ABI = 7
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why: str | None = None        # why there is no library, once a build failed


def _build(flags: tuple[tuple[str, ...], ...] = (("-march=native",), ())) -> ctypes.CDLL:
    """Compile and load the copy with the first of `flags` the compiler takes."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    work = tempfile.mkdtemp(prefix="tierd-cpu-copy-")
    try:
        out = os.path.join(work, "cpu_copy.so")
        errors = ""
        for arch in flags:      # a compiler without -march=native: its default target
            r = subprocess.run([cc, "-O3", *arch, "-fPIC", "-shared", "-pthread", "-o", out, str(SOURCE), "-lm"],
                               capture_output=True, text=True, timeout=120)
            if r.returncode == 0:
                break
            errors = r.stderr.strip()[-500:]
        else:
            raise RuntimeError(f"{cc} failed: {errors}")
        lib = ctypes.CDLL(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)    # the loaded library stays mapped
    if lib.tierd_cpu_copy_abi() != ABI:
        raise RuntimeError("cpu_copy.c does not match this module")
    i64 = ctypes.c_int64
    vp = ctypes.c_void_p
    # (items, how many, the OpenMP runtime's GOMP_parallel or NULL, threads, the ids' addresses
    # per group, the slots' addresses): `CopyPlan.copy`
    lib.tierd_copy_split.argtypes = (vp, i64, vp, ctypes.c_int, vp, vp)
    lib.tierd_copy_split.restype = ctypes.c_int
    lib.tierd_decode_attention.argtypes = (vp, vp, vp, ctypes.c_int, vp, i64, vp, i64, i64, i64, i64, i64, i64,
                                           ctypes.c_float, vp, vp, vp)
    lib.tierd_decode_attention.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled copy (built at the first call in this process), or None if it cannot be."""
    global _lib, _why
    if _lib is not None or _why is not None:
        return _lib
    with _lock:
        if _lib is None and _why is None:
            try:
                _lib = _build()
            except Exception as e:  # noqa: BLE001 - no native copy: the reference runs
                _why = str(e)
                log.info("tierd: the C block copy is not available (%s); the torch reference copies", e)
    return _lib


def available() -> bool:
    return library() is not None


def why_not() -> str | None:
    return _why


def gather_blocks(k_caches, v_caches, block_ids, slots) -> None:
    _copy_blocks(k_caches, v_caches, block_ids, slots, to_slots=True)


def scatter_blocks(k_caches, v_caches, block_ids, slots) -> None:
    _copy_blocks(k_caches, v_caches, block_ids, slots, to_slots=False)


def _plane(caches, k0: torch.Tensor) -> tuple[int, int, int, int]:
    """The strides in elements (block, token, head, dim; or the AMX tiles' eight) shared by every
    view of a plane (of K's shape and element size)."""
    first = caches[0]
    if not all(c.device.type == "cpu" and c.shape == k0.shape and c.stride() == first.stride()
               and c.element_size() == k0.element_size() for c in caches):
        raise ValueError("every view of a plane needs one shape and one layout on the CPU")
    return tuple(first.stride())


def _amx_geometry(k0: torch.Tensor, strides: list, es: int) -> tuple[int, int, int, int]:
    """(N, heads, D, head stride in elements) of K and V views of vLLM's "amx" tiles, as
    `connectors/vllm_layout.py` makes them: (blocks, N / 16, 8, 2, heads, D / 16, 8, 2) with the
    strides of K, then V, of that layout, one head stride for both; ValueError for anything else."""
    if es != 2 or len(strides) != 2:
        raise ValueError("AMX tiles hold K and V of 2-byte elements")
    n, d = k0.shape[1] * 16, k0.shape[5] * 16
    if tuple(k0.shape[2:4]) != (8, 2) or tuple(k0.shape[6:]) != (8, 2):
        raise ValueError(f"a view of shape {tuple(k0.shape)} is not one of AMX tiles")
    (sb, *k), (vb, *v) = strides
    sh = k[3]
    if k != [16 * d, 4, 2, sh, 256, 32, 1] or v != [256, 32, 1, sh, 16 * n, 4, 2] or vb != sb or sh < 2 * n * d:
        raise ValueError(f"strides {strides} are not those of AMX tiles")
    return n, k0.shape[4], d, sh


def _copy_blocks(k_caches, v_caches, block_ids, slots, *, to_slots: bool, lib: ctypes.CDLL | None = None,
                 stream: bool | None = None, threads: int | None = None) -> None:
    """The reference's `_copy_blocks` (same arguments, same result), in C. Raises ValueError for
    inputs it does not take; the reference then runs. (`lib`: another build, `stream` and
    `threads`: forced, for tests.)"""
    CopyPlan(k_caches, v_caches, lib=lib).copy(block_ids, slots, to_slots=to_slots, stream=stream,
                                               threads=threads)


# Copies of at least this many bytes write through streaming stores (the destination's lines not
# read first, not kept in the caches): measured here, a copy out of DRAM ran at 1.2x memcpy's
# speed from 1 MiB and 1.4x at 128 MiB, and reading its destination back right after was no
# slower; below about 1 MiB the two are level and a destination kept in the caches may be read
# again soon (a save's slot by the next load).
STREAM_MIN_BYTES = 1 << 20


class CopyPlan:
    """The C copy between tier slots and one set of CPU caches (every layer's K and V views, or
    latent caches with `v_caches` None), their geometry checked once: a caller that copies
    between the same caches again and again (kernels/transfer.py) keeps one, and each copy then
    costs a few Python operations besides the C loop (what a load of a few blocks would
    otherwise spend mostly on checking caches, cold in the CPU's caches after a forward pass).
    ValueError for caches it does not take. The caches must keep their storage while it is used
    (as an engine's KV caches do); it holds them. `layer_groups`: each layer's KV cache group
    (vLLM's hybrid models: block ids (tiers, groups, ratio), each layer copied through its
    group's; kernels/transfer.py)."""

    def __init__(self, k_caches, v_caches, *, lib: ctypes.CDLL | None = None,
                 layer_groups: list[int] | None = None):
        lib = lib or library()
        if lib is None:
            raise ValueError(f"no C block copy: {_why}")
        k0 = k_caches[0]
        if k0.device.type != "cpu":
            raise ValueError("CPU caches expected")
        es = k0.element_size()
        planes = [list(k_caches)] if v_caches is None else [list(k_caches), list(v_caches)]
        strides = [_plane(p, k0) for p in planes]
        if any(x < 0 for st in strides for x in st):
            raise ValueError("negative strides")
        if len(planes) == 2 and len(planes[1]) != len(planes[0]):
            raise ValueError(f"{len(planes[0])} K caches and {len(planes[1])} V caches")
        self._lib = lib
        # the item's kind (cpu_copy.c: 0 tierd_copy_blocks, 1 tierd_copy_amx) and its layout's arguments
        if k0.dim() == 8:
            n, h, d, sh = _amx_geometry(k0, strides, es)
            self._kind, tails = 1, [(kv, n, h, d, sh) for kv in range(2)]
        elif k0.dim() == 4:
            _, n, h, d = k0.shape
            self._kind, tails = 0, [(es, n, h, d, *st[1:]) for st in strides]
        else:
            raise ValueError("CPU caches of (blocks, block_size, heads, head_dim), or AMX tiles, expected")
        self.layers, self.planes, self.num_blocks = len(k_caches), len(planes), k0.shape[0]
        # Layer groups (kernels/transfer.py: each layer's engine blocks come from its group's ids,
        # block ids (tiers, groups, ratio)): the copy runs per run of consecutive layers of one
        # group, each through its group's ids. None: one group, block ids (tiers, ratio).
        if layer_groups is not None and len(layer_groups) != len(k_caches):
            raise ValueError(f"layer groups for {len(layer_groups)} of {len(k_caches)} layers")
        self.layer_groups = None if layer_groups is None else [int(g) for g in layer_groups]
        runs, lo = [], 0            # (first layer, layers, group)
        groups = self.layer_groups or [0] * self.layers
        for i in range(1, self.layers + 1):
            if i == self.layers or groups[i] != groups[lo]:
                runs.append((lo, i - lo, groups[lo]))
                lo = i
        self._runs = runs
        self.groups = max(groups) + 1
        self._calls: dict[int, list] = {}        # layers per item -> the copy's (plane, first layer, layers, group)
        self._templates: dict[tuple, np.ndarray] = {}   # a shape of copy -> its items, addresses left out
        self.unit = n * h * d * es                          # one engine block of one plane, bytes
        self._caches = planes
        # per plane: its layers' start addresses (a C array, kept alive here), that array's
        # address, its block stride, and its layout's arguments padded to an item's seven
        self._plane_args = []
        for caches, st, tail in zip(planes, strides, tails):
            bases = (ctypes.c_int64 * self.layers)(*(c.data_ptr() for c in caches))
            self._plane_args.append((bases, ctypes.addressof(bases), st[0] * es, (*tail, 0, 0)[:ITEM_WORDS - 13]))

    def copy(self, block_ids, slots, *, to_slots: bool, stream: bool | None = None,
             threads: int | None = None) -> None:
        """Tier block t's part r <-> engine block block_ids[t, r] (negative: not copied), every
        layer and plane; `block_ids` a CPU tensor or a numpy array of integers; `slots[t]` a
        contiguous CPU tensor or numpy array of a whole tier block
        (not a copy of one: the copy goes through its memory). ValueError
        (nothing copied) for anything else, or an engine block id out of range. `stream`:
        whether the destination is written with streaming stores; by default from
        STREAM_MIN_BYTES copied. `threads`: how many threads copy (the caller and helpers, each
        its planes and layers); by default `copy_threads()` from SPLIT_MIN_BYTES copied, else 1.

        In plain numpy and integer work before the C call: on a load it runs with the CPU's
        caches cold after a forward pass, where every torch call costs several microseconds."""
        grouped = self.layer_groups is not None
        if isinstance(block_ids, torch.Tensor):
            if block_ids.device.type != "cpu":
                block_ids = block_ids.cpu()
            block_ids = block_ids.numpy()
        ids = np.ascontiguousarray(block_ids, dtype=np.int64)   # (no copy when it is already)
        if ids.ndim != (3 if grouped else 2) or grouped and ids.shape[1] < self.groups:
            raise ValueError(f"block ids of shape {tuple(ids.shape)}: (tier blocks, "
                             f"{f'{self.groups} groups, ' if grouped else ''}ratio) expected")
        tiers, ratio = ids.shape[0], ids.shape[-1]
        if len(slots) != tiers:
            raise ValueError(f"{len(slots)} slots for {tiers} tier blocks")
        if tiers == 0 or ratio == 0:
            return
        # per group, its (tiers, ratio) ids as one C array (kept alive until the copy is over)
        by_group = [np.ascontiguousarray(ids[:, g]) for g in range(self.groups)] if grouped else [ids]
        part = ratio * self.unit                            # one (layer, plane) of a slot, bytes
        need = self.layers * self.planes * part
        # per tier block, its slot's address; then per group, its ids' address (the C call's
        # two tables, in one array)
        base = np.empty(tiers + len(by_group), dtype=np.int64)
        for t, s in enumerate(slots):
            if isinstance(s, np.ndarray):     # a slot or lease view as the store hands it out
                # (one `__array_interface__`: the address, whether read-only, and strides None
                # for C-contiguous memory; not `.ctypes`: see tierd.transfer.address)
                ai = s.__array_interface__
                addr, readonly = ai["data"]
                if ai["strides"] is not None or s.nbytes < need or (to_slots and readonly):
                    raise ValueError("slots must be contiguous memory of a whole tier block (writable to save)")
                base[t] = addr
            elif isinstance(s, torch.Tensor) and s.device.type == "cpu" and s.is_contiguous() \
                    and s.numel() * s.element_size() >= need:
                base[t] = s.data_ptr()
            else:
                raise ValueError("slots must be contiguous CPU memory of a whole tier block")
        to_cache = 0 if to_slots else 1
        if stream is None:
            stream = need * tiers >= STREAM_MIN_BYTES
        if threads is None:
            threads = copy_threads() if need * tiers >= SPLIT_MIN_BYTES else 1
        slots_at, step = base.__array_interface__["data"][0], self.planes * part
        # the work as (plane, first layer, layers, group) items of about ITEM_BYTES each, every
        # (plane, layer) once, taken in turn by the threads copying
        per_item = max(1, ITEM_BYTES // max(1, tiers * part)) if threads > 1 else self.layers
        calls = self._calls.get(per_item)
        if calls is None:
            calls = self._calls[per_item] = [(kv, lo, min(per_item, first + count - lo), g)
                                             for kv in range(self.planes) for first, count, g in self._runs
                                             for lo in range(first, first + count, per_item)]
        for g, x in enumerate(by_group):
            base[tiers + g] = x.__array_interface__["data"][0]
        ids_tab_at = slots_at + 8 * tiers
        items = self._items(calls, tiers, ratio, part, step, to_cache, stream)
        at, split = items.__array_interface__["data"][0], self._lib.tierd_copy_split
        team = omp_team() if threads > 1 and len(calls) > 1 else None
        if team is not None or threads <= 1:
            # on torch's OpenMP team, or the caller alone
            bad = split(at, len(calls), team, threads, ids_tab_at, slots_at)
        else:
            row = 8 * ITEM_WORDS
            bad = _shared(lambda i: split(at + i * row, 1, None, 1, ids_tab_at, slots_at), range(len(calls)), threads)
        # every item checks every id before it copies: one that refuses them all refuse, nothing copied
        if bad != 0:
            raise ValueError(f"engine block id out of range 0..{self.num_blocks - 1}")  # the reference raises

    def _items(self, calls: list, tiers: int, ratio: int, part: int, step: int, to_cache: int,
               stream: bool) -> np.ndarray:
        """The items of `tierd_copy_split` (cpu_copy.c), a row of ITEM_WORDS per (plane, first
        layer, layers, group) of `calls`: the arguments of one copy call over those layers, less
        the ids' and the slots' addresses (arguments of the C call). Made once per shape of copy
        (a few, for an engine's loads and saves) and kept."""
        key = (id(calls), tiers, ratio, to_cache, bool(stream))
        rows = self._templates.get(key)
        if rows is None:
            args, kind, s = self._plane_args, self._kind, int(stream)
            rows = np.array([(kind, n, args[kv][1] + 8 * lo, args[kv][2], self.num_blocks, tiers, ratio, g,
                              0, kv * part + lo * step, step, to_cache, s, *args[kv][3])
                             for kv, lo, n, g in calls], dtype=np.int64)
            if len(self._templates) >= 64:
                self._templates.clear()
            self._templates[key] = rows
        return rows


# Copies of at least this many bytes are split across the caller and helper threads (by plane and
# layer, `copy_threads()` in all): one core does not reach the memory's bandwidth, and a load or
# a save is what the engine waits for. Measured here (two threads, vLLM's CPU layout, caches
# flushed): 32 MiB loads 1.7x and saves 1.8x faster than on one thread, 4 MiB 1.2x; at 2 MiB
# level, at 1 MiB slower (waking a helper costs about 0.15 ms on this virtual machine).
SPLIT_MIN_BYTES = 4 << 20


def copy_threads() -> int:
    """Threads for one large copy: the caller's and torch's other intra-op threads (what an
    engine computes with, idle while it waits for a load or a save), at most 4."""
    return max(1, min(torch.get_num_threads(), 4))


# int64 words of one item of `tierd_copy_split` (cpu_copy.c): a kind, then the call's arguments
ITEM_WORDS = 20

_team: tuple[int | None] | None = None     # (GOMP_parallel's address or None,) once looked up


def omp_team() -> int | None:
    """The address of `GOMP_parallel` in the OpenMP runtime torch computes with, where a split
    copy runs on torch's own team: on the process's main thread (the one engines compute on).
    None on other threads, in a forked child of a process that used it (the parent's team is
    not there), and where torch's runtime exports no such entry; the copy's items then go to
    `_workers()`.

    Why: after a forward, the team's threads spin for a while waiting for more work (OpenMP's
    default). On a machine with as many cores as threads, a helper of our own waits until the
    scheduler takes a core from a spinning thread. Measured here (2 vCPUs, 8 MiB in 1 MiB items,
    right after a matmul): helpers of our own 0.90-1.0 ms, one thread alone 0.76-1.0 ms, the
    team 0.52-0.7 ms. After an idle spell of 100 ms or more, the team's threads are asleep, and
    on this VM about half the copies then waited 4-8 ms at the region's end for a thread to
    wake; the forward that follows the load would wait for the same threads at its own first
    region, so the wait moves, it is not added (copy and a matmul after it: the same totals
    either way, side by side). A background thread does not use it: that would give the thread
    a team of its own, whose threads then spin beside the engine's compute."""
    global _team
    if threading.get_ident() != _MAIN_THREAD:
        return None
    if _team is None:
        _team = (_find_omp_parallel(),)
    return _team[0]


_MAIN_THREAD = threading.main_thread().ident


def _forget_team() -> None:
    global _team
    if _team is not None:
        _team = (None,)   # the parent used it: its team's threads are not in this child


os.register_at_fork(after_in_child=_forget_team)


def _find_omp_parallel() -> int | None:
    """GOMP_parallel's address in an OpenMP runtime torch loaded (GNU's libgomp, or a runtime
    that exports GNU's entry points, as Intel's and LLVM's do), or None."""
    if not getattr(torch._C, "has_openmp", False):
        return None
    torch_dir = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    try:
        with open("/proc/self/maps") as f:
            paths = {fields[5].strip() for fields in (line.split(None, 5) for line in f) if len(fields) == 6}
    except OSError:
        return None
    for path in sorted(paths):
        name = os.path.basename(path)
        if path.startswith(torch_dir) and name.startswith(("libgomp", "libiomp5", "libomp")) and ".so" in name:
            try:
                runtime = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)   # the one already loaded
                return ctypes.cast(runtime.GOMP_parallel, ctypes.c_void_p).value
            except (OSError, AttributeError):
                continue
    return None


# One item of a split copy: small enough that a helper woken late (about 0.15 ms here) finds
# work left, large enough that each C call's Python overhead (a few microseconds) is small.
ITEM_BYTES = 1 << 20


def _shared(fn, items: list, threads: int) -> int:
    """fn(item) for every item, each once, by the caller and up to `threads - 1` of `_workers()`,
    each taking the next item not yet taken (a helper that wakes late finds less or nothing left,
    instead of the caller waiting for its share). Returns the OR of the results once every item
    is done — not once every helper has woken: one that wakes after the end takes nothing.
    Raises what an item raised."""
    pool = _workers()[0] if threads > 1 and len(items) > 1 else None
    if pool is None:
        bad = 0
        for item in items:
            bad |= fn(item)
        return bad
    todo = iter(items)          # next() on it is atomic under the GIL: each item is taken once
    state = {"left": len(items), "bad": 0, "error": None}
    done = threading.Condition(threading.Lock())

    def work() -> None:
        for item in todo:
            try:
                r, e = fn(item), None
            except BaseException as x:  # noqa: BLE001 - handed to the caller
                r, e = 0, x
            with done:
                state["bad"] |= r
                state["error"] = state["error"] or e
                state["left"] -= 1
                if state["left"] == 0:
                    done.notify_all()
    for _ in range(min(threads, len(items)) - 1):
        pool.submit(work)
    work()
    with done:
        while state["left"]:
            done.wait()
    if state["error"] is not None:
        raise state["error"]
    return state["bad"]


_pool = None
_pool_pid = 0
_pool_lock = threading.Lock()


def _workers():
    """Threads beside the caller for one attention call or large copy: as many as torch's
    intra-op threads, less the caller's own (the C calls let go of the GIL); placed like
    tierd's other helper threads (off an engine's compute cores where it keeps helpers off
    them), and made again in a forked child (which has none of its parent's threads)."""
    global _pool, _pool_pid
    n = torch.get_num_threads() - 1
    if n < 1:
        return None, 1
    with _pool_lock:
        if _pool is None or _pool._max_workers != n or _pool_pid != os.getpid():
            from concurrent.futures import ThreadPoolExecutor

            from tierd import threads
            if _pool is not None and _pool_pid == os.getpid():
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(n, thread_name_prefix="tierd-cpu", initializer=threads.enter_helper)
            _pool_pid = os.getpid()
        return _pool, n + 1


def paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=1.0, v_scale=1.0, *,
                           version=None, max_seq_len=None):
    """`reference.paged_attention_decode` in C: each sequence's cache read where it lies (no
    gathered copy, no padding to the longest), float32 throughout, the batch split across
    torch's intra-op threads. float32 and bfloat16 caches; ValueError for anything else (the
    reference runs)."""
    lib = library()
    if lib is None:
        raise ValueError(f"no C kernels: {_why}")
    if k_cache.dtype not in (torch.float32, torch.bfloat16) or v_cache.dtype != k_cache.dtype:
        raise ValueError("float32 or bfloat16 caches only")
    if not (q.device.type == k_cache.device.type == v_cache.device.type == "cpu"):
        raise ValueError("CPU tensors only")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape != v_cache.shape:
        raise ValueError("contiguous caches of one shape only")
    num_blocks, bs, kvh, d = k_cache.shape
    B, heads, qd = q.shape
    if qd != d or heads % kvh:
        raise ValueError(f"q of {heads} heads x {qd} for a cache of {kvh} heads x {d}")
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    if B == 0:
        return torch.empty_like(q)
    n_max = int(lens.max())
    need = (lens.long() + bs - 1) // bs
    if int(lens.min()) < 0 or int(need.max()) > tables.shape[1]:
        raise ValueError("a length past its block table")
    used = torch.arange(tables.shape[1]).unsqueeze(0) < need.unsqueeze(1)
    if used.any():
        ids = tables[used]
        if int(ids.min()) < 0 or int(ids.max()) >= num_blocks:
            raise ValueError(f"block id out of range 0..{num_blocks - 1}")   # the reference raises
    qf = q.to(torch.float32).contiguous()
    out = torch.empty((B, heads, d), dtype=torch.float32)
    pool, parts = _workers()
    parts = max(1, min(parts, B))
    group = heads // kvh
    work = torch.empty((parts, group * max(n_max, 1)), dtype=torch.float32)
    kbuf = torch.empty((parts, d), dtype=torch.float32)
    es = k_cache.element_size()
    bounds = [B * i // parts for i in range(parts + 1)]

    def run(i):
        return lib.tierd_decode_attention(qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), es,
                                          tables.data_ptr(), tables.shape[1], lens.data_ptr(), bounds[i],
                                          bounds[i + 1], heads, kvh, d, bs, float(scale), out.data_ptr(),
                                          work[i].data_ptr(), kbuf[i].data_ptr())
    futures = [pool.submit(run, i) for i in range(1, parts)] if parts > 1 else []
    run(0)
    for f in futures:
        f.result()
    return out.to(q.dtype)
