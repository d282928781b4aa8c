"""Crash consistency harness: SIGKILL the daemon at random points of store, sync and demotion
bursts, restart it, and check what it serves.

    python -m tests.crash_harness [--kills N] [--seed S] [--json PATH] [--dir D]

Each round starts `tierd serve` on the same disk directory (timing the recovery), checks every
chain acknowledged durable so far (`tests.crash_worker` logs a range only after its sync
returned) is served bit-exact, checks that every block served at all is bit-exact, then runs a
writer against it and SIGKILLs the daemon after a random delay. The host tier is small, so
demotion runs all the time; the writer syncs every 4 chains. Every third round also damages the
slab files before the restart (random bytes at random offsets, or a file truncated at a random
length): blocks hit by that damage may be lost - they must then be missing, never wrong - and
are reported. Every third round, offset by one, damages the host arena instead (random bytes in a
re-adoptable block or anywhere, or a torn block record): the restarted daemon re-adopts the host
blocks it can verify and must drop the rest, never serve them wrong. When the durable set nears the disk tier's capacity the harness flushes
everything (and checks that flushed blocks stay gone), so eviction never explains a loss.

CI runs 5 kills (tests/test_crash.py); `--kills 200` is the soak.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tierd

from .daemon import ROOT, DaemonProc
from .helpers import block_for, chain, make_ns

CHAINS_PER_ROUND = 60
DISK_BYTES = 64 << 20


def check(url: str, durable: set[int], attempted: set[int], gone: set[int]) -> dict:
    """Served bytes exact; durable chains complete; flushed chains absent. Returns counts."""
    ns = make_ns()
    out = {"durable_checked": 0, "served_extra": 0, "lost_durable": [], "wrong": 0, "flushed_back": 0}
    with tierd.connect(url) as c:
        for seed in sorted(attempted | gone):
            keys = chain(ns, seed, 4)
            blocks = c.get(ns, keys)
            for blk, k in zip(blocks, keys):
                if blk.tobytes() != block_for(ns, k).tobytes():
                    out["wrong"] += 1
            if seed in durable:
                out["durable_checked"] += 1
                if len(blocks) != 4:
                    out["lost_durable"].append(seed)
            elif seed in gone:
                out["flushed_back"] += len(blocks)
            else:
                out["served_extra"] += bool(blocks)
        st = c.stats()["tiers"]
        out["disk_blocks"] = st["disk"]["blocks"]
        out["host_adopted"] = st["host"]["adopted_blocks"]
        out["host_dropped"] = st["host"]["adopt_dropped"]
    return out


def damage(disk: Path, rng: random.Random, used_bytes: int) -> str:
    """Random bytes at a random offset, or a truncation, aimed at the first `used_bytes` of the
    first slab file (where the blocks are) most of the time."""
    files = sorted(disk.glob("slab-*.tds"))
    f = files[0] if rng.random() < 0.8 else rng.choice(files)
    size = f.stat().st_size
    span = min(size, max(8192, used_bytes))
    if rng.random() < 0.5:
        off = rng.randrange(4096, span)
        n = rng.randrange(64, 8192)
        with open(f, "r+b") as fh:
            fh.seek(off)
            fh.write(os.urandom(n))
        return f"{n} random bytes at {f.name}+{off}"
    cut = rng.randrange(4096, span)
    os.truncate(f, cut)
    return f"{f.name} truncated to {cut}"


def damage_host(arena_dir: Path, rng: random.Random) -> str:
    """Random bytes in a re-adoptable host block (most of the time) or anywhere in the arena, or
    a torn block record: what a stray write or a torn record looks like to the next daemon."""
    from tierd.tiers.host_records import _DATA_OFF, REC_BYTES, read_records
    (arena,) = [p for p in arena_dir.iterdir() if p.name.endswith(".host")]
    rec = arena.with_name(arena.name + ".rec")
    fd = os.open(arena, os.O_RDWR)
    try:
        try:
            records = read_records(str(rec), fd)[0]
        except FileNotFoundError:
            records = []
        size = os.fstat(fd).st_size
        if records and rng.random() < 0.3:
            r = rng.choice(records)
            with open(rec, "r+b") as f:
                at = _DATA_OFF + r.offset // 4096 * REC_BYTES + rng.randrange(REC_BYTES)
                f.seek(at)
                f.write(os.urandom(1 + rng.randrange(16)))
            return f"host record of the block at {r.offset} torn"
        if records and rng.random() < 0.8:
            r = rng.choice(records)
            off = r.offset + rng.randrange(r.length)
        else:
            off = rng.randrange(size - 64)
        n = rng.randrange(1, 64)
        os.pwrite(fd, os.urandom(n), off)
        return f"{n} random bytes at host arena+{off}"
    finally:
        os.close(fd)


def run(kills: int, seed: int, workdir: Path, log=print) -> dict:
    rng = random.Random(seed)
    d = DaemonProc(workdir, host_bytes="4MiB", disk_bytes=f"{DISK_BYTES >> 20}MiB")
    durable: set[int] = set()
    attempted: set[int] = set()
    gone: set[int] = set()
    ns = make_ns()
    capacity_chains = DISK_BYTES // (4 * ns.block_bytes)
    rounds, next_seed = [], 0
    damaged_lost: list[int] = []
    for k in range(kills + 1):
        t0 = time.monotonic()
        d.start(timeout_s=120)
        recovery_s = time.monotonic() - t0
        res = check(d.url, durable, attempted, gone)
        r = {"round": k, "recovery_s": round(recovery_s, 3), "disk_blocks": res["disk_blocks"],
             "host_adopted": res["host_adopted"], "host_dropped": res["host_dropped"],
             "durable_checked": res["durable_checked"], "wrong": res["wrong"],
             "lost_durable": len(res["lost_durable"]), "flushed_back": res["flushed_back"]}
        damaged_round = bool(rounds) and rounds[-1].get("damage")
        if res["wrong"] or res["flushed_back"] or (res["lost_durable"] and not damaged_round):
            d.kill()
            r["verdict"] = "FAIL"
            rounds.append(r)
            log(json.dumps(r))
            raise AssertionError(f"round {k}: {r}; lost durable chains {res['lost_durable'][:10]}")
        if res["lost_durable"]:          # destroyed by the injected damage: missing, not wrong
            damaged_lost += res["lost_durable"]
            durable -= set(res["lost_durable"])
        if k == kills:
            d.stop()
            rounds.append(r)
            log(json.dumps(r))
            break
        if len(durable) + CHAINS_PER_ROUND > 0.6 * capacity_chains:
            with tierd.connect(d.url) as c:
                c.flush("all")
            gone |= durable | attempted
            durable.clear()
            attempted.clear()
            r["flushed"] = True
        # a writer, and a kill at a random point of its bursts
        first = next_seed
        next_seed += CHAINS_PER_ROUND
        attempted |= set(range(first, first + CHAINS_PER_ROUND))
        dlog = workdir / f"durable-{k}.log"
        w = subprocess.Popen([sys.executable, "-m", "tests.crash_worker", d.socket, str(first),
                              str(CHAINS_PER_ROUND), str(dlog)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        delay = rng.uniform(0.2, 2.0)
        time.sleep(delay)
        d.kill()
        out, _ = w.communicate(timeout=60)
        if "WRONG" in out:
            raise AssertionError(f"round {k}: the writer read wrong content: {out}")
        if dlog.exists():
            for line in dlog.read_text().split("\n"):
                if line:
                    lo, hi = map(int, line.split())
                    durable |= set(range(lo, hi + 1))
        r["kill_after_s"] = round(delay, 2)
        r["disk_bytes_on_disk"] = sum(f.stat().st_blocks * 512 for f in Path(d.disk).iterdir() if f.is_file())
        if r["disk_bytes_on_disk"] > DISK_BYTES + (1 << 20):
            raise AssertionError(f"round {k}: the disk tier uses {r['disk_bytes_on_disk']} bytes, over its cap")
        if k % 3 == 2:
            r["damage"] = damage(Path(d.disk), rng, used_bytes=(res["disk_blocks"] + 4 * CHAINS_PER_ROUND) * 20480)
        elif k % 3 == 1:
            r["host_damage"] = damage_host(Path(d.env["TIERD_ARENA_DIR"]), rng)
        rounds.append(r)
        log(json.dumps(r))
    return {"kills": kills, "seed": seed, "rounds": rounds, "lost_to_injected_damage": len(damaged_lost),
            "durable_at_end": len(durable),
            "recovery_s_max": max(x["recovery_s"] for x in rounds),
            "host_adopted": sum(x["host_adopted"] for x in rounds),
            "host_dropped": sum(x["host_dropped"] for x in rounds),
            "disk_blocks_max": max(x["disk_blocks"] for x in rounds)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=int(os.environ.get("CRASH_KILLS", "200")))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--dir", metavar="D", help="work directory (default: a temporary one)")
    args = ap.parse_args()
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="tierd-crash-"))
    (workdir / "arena").mkdir(parents=True, exist_ok=True)
    try:
        summary = run(args.kills, args.seed, workdir)
    finally:
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
