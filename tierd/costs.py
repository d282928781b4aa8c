"""What a load costs against recomputing it, measured; and the decision between them.

A hit is worth loading only while copying its blocks in is faster than computing their tokens
again. Both sides change while a node runs: a disk slows under another job's I/O or fails, a
remote tier congests, an engine's prefill speeds up with batch size or slows with context. So
nothing here is configured; everything is fitted from what the node measures.

- **Transfers**, per tier ("gpu", "host", "disk", "remote") and direction ("load": tier to
  engine, "store": engine to tier): seconds ≈ latency + bytes / bandwidth, a least-squares fit
  over recent transfers in which every new one weighs as much as all the older ones together
  (`TRANSFER_DECAY`), and one `REGIME_FACTOR` off the estimate starts the fit again from itself:
  a tier that slows down or stalls shows in its estimate after one request, and so does one that
  heals. Before a tier's first measured transfer its estimate is
  a conservative placeholder (`SEED`), shown as such.
- **Recompute**, per engine (its namespace): one forward pass that computes n_i new tokens
  after k_i cached ones, for each sequence i of its batch, takes
  a + b·Σn_i + c·Σn_i·(k_i + n_i/2) seconds (the linear layers cost per token, attention per
  token and context). Fitted from the engine's own forward passes; an engine seeds it at start
  with a short probe (a few forwards of its own model) so that its first requests are decided.
  Loading the L tokens after `first` saves b·L + c·L·(first + L/2): what computing them costs,
  less nothing (the tokens after them cost the same either way).
- **The decision** (`CostModel.plan`): of the blocks found for a prompt, in the tiers they are
  in, load the prefix whose predicted saving over its predicted load time is greatest (the
  longest such prefix on a tie), none when no prefix wins. A head in host RAM and a tail on a
  slow disk: the head is loaded, the tail computed. Without a recompute estimate every found
  block is loaded (what tierd did before it measured). A load that runs past its prediction by
  `ABANDON_FACTOR` (and `ABANDON_SLACK_S`) is abandoned where the engine can recompute instead.
  Deciding never changes a byte: a prefix is loaded whole, block by block, or computed.
- **The ledger**, per tier: tokens loaded, tokens declined (found but computed because that was
  predicted cheaper), tokens of loads abandoned past their deadline, and "slow hits": loads that
  took longer than recomputing their tokens was estimated to.

A `TieredStore` owns the node's model (the daemon's, or an embedded store's); a daemon's client
keeps a replica that it updates with its own measurements at once and exchanges with the
daemon's (`Client.costs`) at most every `SYNC_S`: the daemon's model is the sum of what every
engine on the node measured, and `tierd stats` and the metrics show it.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, field

from .errors import ConfigError

TIERS = ("gpu", "host", "disk", "remote")
DIRECTIONS = ("load", "store")
# (latency s, bandwidth bytes/s) before a tier's first measured transfer: a slow NVMe's and a
# congested network's, so that an unmeasured tier is not trusted to beat an engine
SEED = {"gpu": (20e-6, 100e9), "host": (50e-6, 4e9), "disk": (500e-6, 1e9), "remote": (2e-3, 0.25e9)}
TRANSFER_DECAY = 0.5     # weight of earlier transfers against a new one (0.5: the new one is half)
REGIME_FACTOR = 4.0      # a transfer this far off its estimate starts the fit afresh
RECOMPUTE_DECAY = 0.95   # forwards change slowly; ~20 of them make the estimate
ABANDON_FACTOR = 1.5     # a load past 1.5x its prediction ...
ABANDON_SLACK_S = 2e-3   # ... and 2 ms over it is abandoned where the engine can recompute
PROBE_S = 1.0            # a declined tier is re-measured (off the request's path) this often,
PROBE_BLOCKS = 8         # by loading at most this many of its blocks
SYNC_S = 0.5             # a client exchanges its measurements with the daemon's model this often
LEDGER_KEYS = ("loads", "loaded_tokens", "declined_tokens", "abandoned_tokens", "slow_hits")
# How connectors use the decision: "decide" (the default) loads what wins; "always" loads every
# block found, as a cache that does not measure would (a benchmark's baseline, tests of the load
# path with models so small that computing always wins). A connector's own setting, else this
# variable.
LOAD_POLICIES = ("decide", "always")
LOAD_POLICY_ENV = "TIERD_LOAD_POLICY"


def load_policy(setting: str | None = None) -> str:
    """The load policy: `setting`, else $TIERD_LOAD_POLICY, else "decide"."""
    value = setting if setting not in (None, "") else os.environ.get(LOAD_POLICY_ENV, "") or "decide"
    if value not in LOAD_POLICIES:
        raise ConfigError(f"load policy {value!r}: use one of {', '.join(LOAD_POLICIES)}")
    return value


class TransferFit:
    """seconds ≈ latency + bytes / bandwidth, fitted by exponentially weighted least squares."""

    __slots__ = ("seed", "sw", "sx", "sy", "sxx", "sxy", "n", "last", "updated")

    def __init__(self, seed: tuple[float, float]):
        self.seed = seed
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.n = 0             # transfers measured
        self.last = None       # (bytes, seconds) of the latest
        self.updated = 0.0     # time.time() of the latest

    def add(self, nbytes: float, seconds: float, decay: float = TRANSFER_DECAY) -> None:
        if not (nbytes > 0 and seconds >= 0 and math.isfinite(seconds)):
            return
        x, y = float(nbytes), float(seconds)
        if self.n:
            # A transfer 4x off the estimate either way is a tier that changed (a disk slowed
            # or stalled, or healed), not noise: the fit starts again from it (a lone outlier is
            # undone as fast, by the next transfer, 4x off it)
            expected = self.predict(x)
            if y > REGIME_FACTOR * expected or y * REGIME_FACTOR < expected:
                decay = 0.0
        self.sw = self.sw * decay + 1.0
        self.sx = self.sx * decay + x
        self.sy = self.sy * decay + y
        self.sxx = self.sxx * decay + x * x
        self.sxy = self.sxy * decay + x * y
        self.n += 1
        self.last = (x, y)
        self.updated = time.time()

    def coef(self) -> tuple[float, float]:
        """(latency s, seconds per byte)."""
        lat0, bw0 = self.seed
        if self.n == 0:
            return lat0, 1.0 / bw0
        w = self.sw
        mx, my = self.sx / w, self.sy / w
        var = self.sxx / w - mx * mx
        if var > (0.05 * mx) ** 2:
            b = (self.sxy / w - mx * my) / var
            a = my - b * mx
            if b > 0 and a >= 0:
                return a, b
            if b > 0:                       # through the origin: no fixed latency
                return 0.0, self.sxy / self.sxx
        # one size only (or a fit that makes no sense): the seed's share of latency, the rest
        # per byte
        a = min(lat0, my / 2)
        return a, max(0.0, (my - a) / mx) if mx > 0 else 0.0

    def predict(self, nbytes: float, runs: int = 1) -> float:
        a, b = self.coef()
        return a * runs + b * nbytes

    def state(self) -> list:
        return [self.sw, self.sx, self.sy, self.sxx, self.sxy, self.n, self.updated]

    def set_state(self, st: list) -> None:
        self.sw, self.sx, self.sy, self.sxx, self.sxy = (float(v) for v in st[:5])
        self.n, self.updated = int(st[5]), float(st[6])

    def describe(self) -> dict:
        a, b = self.coef()
        return {"latency_s": a, "bandwidth_bytes_s": 1.0 / b if b > 0 else 0.0, "measured": self.n,
                "source": "measured" if self.n else "seed",
                "age_s": time.time() - self.updated if self.n else -1.0}


class RecomputeFit:
    """One forward's seconds ≈ a + b·N + c·Q (N: new tokens, Q: Σ n·(k + n/2)), fitted by
    exponentially weighted least squares with every coefficient ≥ 0.

    In plain Python floats: the systems are at most 3 x 3, and an engine refits after every
    forward it measures (`CostModel.observe_forward`; numpy's per-call overhead made the fit a
    third of a 512-token host hit's load when the next load's plan refitted)."""

    __slots__ = ("xtx", "xty", "yty", "n", "updated", "_coef")

    def __init__(self):
        self.xtx = [[0.0] * 3 for _ in range(3)]
        self.xty = [0.0] * 3
        self.yty = 0.0
        self.n = 0
        self.updated = 0.0
        self._coef: tuple[float, float, float] | None = None

    def add(self, tokens: float, quad: float, seconds: float, decay: float = RECOMPUTE_DECAY) -> None:
        if not (tokens > 0 and quad >= 0 and seconds > 0 and math.isfinite(seconds)):
            return
        x = (1.0, float(tokens), float(quad))
        for i in range(3):
            row = self.xtx[i]
            for j in range(3):
                row[j] = row[j] * decay + x[i] * x[j]
            self.xty[i] = self.xty[i] * decay + x[i] * seconds
        self.yty = self.yty * decay + seconds * seconds
        self.n += 1
        self.updated = time.time()
        self._coef = None

    def coef(self) -> tuple[float, float, float] | None:
        """(a, b, c), or None before any forward was measured."""
        if self.n == 0:
            return None
        if self._coef is None:
            self._coef = self._fit()
        return self._coef

    def _fit(self) -> tuple[float, float, float]:
        # the least-squares fit over every subset of the terms that holds N; of those whose
        # coefficients are all ≥ 0, the one with the least residual
        best, best_res = (0.0, 0.0, 0.0), math.inf
        xtx, xty = self.xtx, self.xty
        scale = [math.sqrt(max(xtx[i][i], 1e-300)) for i in range(3)]   # (columns of very unequal size)
        for cols in ((0, 1, 2), (1, 2), (0, 1), (1,)):
            a = [[xtx[i][j] / (scale[i] * scale[j]) + (1e-9 if i == j else 0.0) for j in cols] for i in cols]
            rhs = [xty[i] / scale[i] for i in cols]
            beta = _solve(a, rhs)
            if beta is None:
                continue
            beta = [b / scale[i] for b, i in zip(beta, cols)]
            if any(b < 0 for b in beta):
                continue
            quad = sum(beta[p] * xtx[i][j] * beta[q] for p, i in enumerate(cols) for q, j in enumerate(cols))
            res = self.yty - 2 * sum(b * xty[i] for b, i in zip(beta, cols)) + quad
            if res < best_res - 1e-15:
                full = [0.0, 0.0, 0.0]
                for i, v in zip(cols, beta):
                    full[i] = float(v)
                best, best_res = tuple(full), res
            if len(cols) == 3:
                break       # all three terms ≥ 0: no subset fits better (least squares on fewer terms)
        return best

    def saving(self, first: float, tokens: float) -> float | None:
        """Seconds that loading `tokens` tokens after `first` cached ones saves over computing
        them; None before any forward was measured."""
        c = self.coef()
        if c is None:
            return None
        return c[1] * tokens + c[2] * tokens * (first + tokens / 2)

    def state(self) -> list:
        return [[v for row in self.xtx for v in row], list(self.xty), self.yty, self.n, self.updated]

    def set_state(self, st: list) -> None:
        flat = [float(v) for v in st[0]]
        if len(flat) != 9 or len(st[1]) != 3:
            raise ValueError("a recompute fit's state is 9 + 3 numbers")
        self.xtx = [flat[0:3], flat[3:6], flat[6:9]]
        self.xty = [float(v) for v in st[1]]
        self.yty, self.n, self.updated = float(st[2]), int(st[3]), float(st[4])
        self._coef = None

    def describe(self) -> dict:
        c = self.coef()
        if c is None:
            return {"measured": 0}
        return {"fixed_s": c[0], "per_token_s": c[1], "per_token_context_s": c[2], "measured": self.n,
                "age_s": time.time() - self.updated}


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a·x = b (n ≤ 3) by Gaussian elimination with partial pivoting; None if a is
    singular or the result is not finite."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if not abs(m[p][c]) > 1e-300:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            if f:
                for k in range(c, n + 1):
                    m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x if all(math.isfinite(v) for v in x) else None


def forward_terms(batch) -> tuple[int, float]:
    """(N, Q) of one forward from (new tokens, cached tokens before them) per sequence."""
    n_sum, q = 0, 0.0
    for n, k in batch:
        n_sum += n
        q += n * (k + n / 2)
    return n_sum, q


@dataclass
class Plan:
    """What to load of the blocks found for one prompt (`CostModel.plan`)."""

    found: int                    # blocks found (a prefix of those asked for)
    blocks: int                   # of them, the prefix to load
    tiers: list[str]              # per found block, the tier it would load from
    load_s: float = 0.0           # predicted seconds to load `blocks`
    recompute_s: float = 0.0      # predicted seconds to compute their tokens instead
    reason: str = "model"         # "model": decided; "unmeasured": no recompute estimate, loads
    #                               all; "always": the load policy loads all
    probe: int = -1               # a declined block to re-measure its tier with, off the path
    deadline_s: float = field(default=math.inf)

    def runs(self) -> list[tuple[str, int, int]]:
        """(tier, start, end) of the runs of one tier among the blocks to load."""
        out: list[tuple[str, int, int]] = []
        for i, t in enumerate(self.tiers[:self.blocks]):
            if out and out[-1][0] == t:
                out[-1] = (t, out[-1][1], i + 1)
            else:
                out.append((t, i, i + 1))
        return out

    def declined(self) -> dict[str, int]:
        """Blocks found but not to be loaded, per tier."""
        out: dict[str, int] = {}
        for t in self.tiers[self.blocks:self.found]:
            out[t] = out.get(t, 0) + 1
        return out

    def probe_run(self, keys: list, most: int = PROBE_BLOCKS) -> tuple[str, list]:
        """(tier, keys) to re-measure a declined tier with: the run of at most `most` blocks of
        one tier from `probe` on (`keys` as the plan's blocks); ("", []) when none is due."""
        if self.probe < 0:
            return "", []
        tier, i = self.tiers[self.probe], self.probe
        end = i
        while end < min(self.found, i + most) and self.tiers[end] == tier:
            end += 1
        return tier, list(keys[i:end])


def slowest_tier(tiers) -> str:
    """Of the tiers a load read from (per block), the slowest: what its time is charged to."""
    return max((t for t in tiers if t in TIERS), key=TIERS.index, default="host")


def primary_tier(where: str) -> str:
    """The tier a block loads from, of `Store.where`'s "host+disk" etc.: the fastest copy."""
    for t in TIERS:
        if t in where.split("+"):
            return t
    return ""


class CostModel:
    """The node's (or a client's replica of the node's) transfer and recompute estimates, the
    decision, and the ledger. Thread-safe."""

    def __init__(self, *, replica: bool = False):
        """`replica`: a client's copy of the daemon's model, which keeps what it measures for the
        daemon (`take_outbox`); the node's own model (a store's) keeps nothing to send."""
        self._lock = threading.Lock()
        self.transfers = {(t, d): TransferFit(SEED[t]) for t in TIERS for d in DIRECTIONS}
        self.recompute: dict[str, RecomputeFit] = {}
        self.ledger = {t: dict.fromkeys(LEDGER_KEYS, 0) for t in TIERS}
        self._probed: dict[str, float] = {}
        # a replica's measurements and ledger counts not yet sent to the daemon's model
        self._outbox: dict | None = {"transfers": [], "forwards": [], "ledger": {}} if replica else None
        self.synced_at = 0.0

    # -- measurements --------------------------------------------------------------------------
    def observe_transfer(self, tier: str, direction: str, nbytes: int, seconds: float) -> None:
        if (tier, direction) not in self.transfers or nbytes <= 0:
            return
        with self._lock:
            self.transfers[(tier, direction)].add(nbytes, seconds)
            if self._outbox is not None:
                self._outbox["transfers"].append([tier, direction, int(nbytes), float(seconds)])

    def observe_forward(self, engine: str, batch, seconds: float) -> None:
        """One forward pass of `engine` (a namespace name): `batch` is (new tokens, cached
        tokens before them) per sequence."""
        n, q = forward_terms(batch)
        if n <= 0:
            return
        with self._lock:
            fit = self.recompute.setdefault(engine, RecomputeFit())
            fit.add(n, q, seconds)
            # refitted now, after the forward it measures, not by the next load's plan: a host
            # hit's load is the path whose every 10 µs shows, a forward's is not
            fit.coef()
            if self._outbox is not None:
                self._outbox["forwards"].append([engine, n, q, float(seconds)])

    def count(self, tier: str, **deltas: int) -> None:
        """Add to `tier`'s ledger: loads, loaded_tokens, declined_tokens, abandoned_tokens,
        slow_hits."""
        if tier not in self.ledger:
            return
        with self._lock:
            row = self.ledger[tier]
            out = self._outbox["ledger"].setdefault(tier, {}) if self._outbox is not None else None
            for k, v in deltas.items():
                if k in row and v:
                    row[k] += int(v)
                    if out is not None:
                        out[k] = out.get(k, 0) + int(v)

    def record_load(self, engine: str, tiers, nbytes: int, tokens: int, seconds: float, *,
                    first_tokens: int = 0, ledger: bool = True) -> bool:
        """A load of `tokens` tokens (`nbytes`, from `tiers` per block) after `first_tokens`
        cached ones took `seconds`: the transfer estimate of the slowest tier it read from and,
        with `ledger` (one rank of an engine counts), that tier's loads and tokens loaded, and a
        slow hit where it took longer than computing the tokens was estimated to. Returns
        whether it was slow."""
        tier = slowest_tier(tiers)
        self.observe_transfer(tier, "load", nbytes, seconds)
        fit = self.recompute.get(engine)
        saving = fit.saving(first_tokens, tokens) if fit is not None else None
        slow = saving is not None and seconds > saving
        if ledger:
            self.count(tier, loads=1, loaded_tokens=tokens, slow_hits=int(slow))
        return slow

    def has_recompute(self, engine: str) -> bool:
        fit = self.recompute.get(engine)
        return fit is not None and fit.n > 0

    # -- the decision --------------------------------------------------------------------------
    def plan(self, engine: str, tiers: list[str], block_bytes: int, block_tokens: int, *,
             first_tokens: int = 0, usable_tokens: int | None = None) -> Plan:
        """Which prefix of the found blocks (`tiers`: per block the tier it loads from, "" where
        none: the found prefix ends there) to load for `engine`. The blocks start after
        `first_tokens` tokens the engine holds; of their tokens at most `usable_tokens` count
        (the last prompt token is always computed)."""
        found = next((i for i, t in enumerate(tiers) if t not in TIERS), len(tiers))
        tiers = list(tiers[:found])
        plan = Plan(found=found, blocks=found, tiers=tiers)
        if not found:
            return plan
        cap = found * block_tokens if usable_tokens is None else max(0, usable_tokens)
        with self._lock:
            fit = self.recompute.get(engine)
            costs = {t: self.transfers[(t, "load")].coef() for t in set(tiers)}
            best, best_gain, best_load, best_save = 0, 0.0, 0.0, 0.0
            load, prev = 0.0, None
            for j, t in enumerate(tiers, 1):
                lat, per_byte = costs[t]
                load += per_byte * block_bytes + (lat if t != prev else 0.0)
                prev = t
                tokens = min(j * block_tokens, cap)
                save = fit.saving(first_tokens, tokens) if fit is not None else None
                if save is None:
                    plan.reason = "unmeasured"
                    best, best_load, best_save = j, load, 0.0
                    continue
                gain = save - load
                if gain >= best_gain and gain > 0:
                    best, best_gain, best_load, best_save = j, gain, load, save
            plan.blocks, plan.load_s, plan.recompute_s = best, best_load, best_save
            if plan.reason == "model" and best:
                plan.deadline_s = max(best_load * ABANDON_FACTOR, best_load + ABANDON_SLACK_S)
            if best < found:
                t = tiers[best]
                now = time.monotonic()
                if now - self._probed.get(t, -math.inf) >= PROBE_S:
                    self._probed[t] = now
                    plan.probe = best
        return plan

    # -- exchange with the daemon's model --------------------------------------------------------
    def take_outbox(self) -> dict:
        with self._lock:
            empty = {"transfers": [], "forwards": [], "ledger": {}}
            if self._outbox is None:
                return empty    # the node's own model: nothing is kept to send
            out, self._outbox = self._outbox, empty
            return out

    def merge_report(self, report: dict) -> None:
        """(The daemon's model.) A client's measurements and ledger counts; rows that are not
        what a client sends are skipped."""
        with self._lock:
            for row in report.get("transfers", ())[:4096]:
                try:
                    tier, direction, nbytes, seconds = row
                    fit = self.transfers.get((str(tier), str(direction)))
                    if fit is not None:
                        fit.add(float(nbytes), float(seconds))
                except (TypeError, ValueError):
                    continue
            for row in report.get("forwards", ())[:4096]:
                try:
                    engine, n, q, seconds = row
                    n, q, seconds = float(n), float(q), float(seconds)
                except (TypeError, ValueError):
                    continue
                if isinstance(engine, str) and len(engine) <= 128 and (
                        engine in self.recompute or len(self.recompute) < 4096):
                    self.recompute.setdefault(engine, RecomputeFit()).add(n, q, seconds)
            for tier, deltas in (report.get("ledger") or {}).items():
                row = self.ledger.get(tier)
                if row is None or not isinstance(deltas, dict):
                    continue
                for k, v in deltas.items():
                    if k in row and isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 40:
                        row[k] += v

    def state(self) -> dict:
        """Everything a replica needs: the fits' sums and the ledger."""
        with self._lock:
            return {"transfers": {f"{t}/{d}": fit.state() for (t, d), fit in self.transfers.items() if fit.n},
                    "recompute": {e: fit.state() for e, fit in self.recompute.items()},
                    "ledger": {t: dict(row) for t, row in self.ledger.items()}}

    def adopt(self, state: dict) -> None:
        """(A replica.) Take the daemon's model, which holds this replica's measurements too (but
        those made since the report went, which count again on top of it)."""
        with self._lock:
            for key, st in (state.get("transfers") or {}).items():
                t, _, d = key.partition("/")
                fit = self.transfers.get((t, d))
                if fit is not None:
                    fit.set_state(st)
            for engine, st in (state.get("recompute") or {}).items():
                self.recompute.setdefault(engine, RecomputeFit()).set_state(st)
            for t, row in (state.get("ledger") or {}).items():
                if t in self.ledger:
                    self.ledger[t].update({k: int(v) for k, v in row.items() if k in self.ledger[t]})
            # what this replica measured while the exchange was under way is not in the
            # daemon's state yet (it goes with the next report): measured here, it counts here
            # from now on, not only a period later
            pending = self._outbox or {}
            for tier, direction, nbytes, seconds in pending.get("transfers", ()):
                self.transfers[(tier, direction)].add(nbytes, seconds)
            for engine, n, q, seconds in pending.get("forwards", ()):
                self.recompute.setdefault(engine, RecomputeFit()).add(n, q, seconds)
            for t, deltas in pending.get("ledger", {}).items():
                for k, v in deltas.items():
                    self.ledger[t][k] += v
            self.synced_at = time.monotonic()

    def describe(self) -> dict:
        """For `tierd stats` and the metrics: the estimates and the ledger."""
        with self._lock:
            return {"transfers": {f"{t}/{d}": fit.describe() for (t, d), fit in self.transfers.items()},
                    "recompute": {e: fit.describe() for e, fit in self.recompute.items()},
                    "ledger": {t: dict(row) for t, row in self.ledger.items()}}
