"""A client process for daemon tests: `python -m tests.client_worker SOCKET MODE SEED N`.

  mixed  N random put/get/acquire/lookup/reserve-abort ops over a shared key space, every
         block served checked bit-exact; prints `OK <ops> <blocks verified> <gets served without a
         lease>` or exits 1
  read   N gets of random chains of 256 KiB blocks from two sets that the test flushes and
         puts in turn (their blocks take each other's slots), every block served checked
         bit-exact; prints `OK <gets> <blocks verified> <gets without a lease> <copies
         discarded>` or exits 1
  lease  as read, through pipelined leases (`acquire(..., pipelined=True)`, each copied out,
         then released with confirm): every block of a confirmed lease checked bit-exact;
         prints `OK <leases> <blocks verified> <pipelined leases> <leases lost> <leases that
         sent nothing>` or exits 1. Reader 0 pins every lease (`pin_after_eviction_s=inf`);
         reader 1 pins only after the host tier evicted (the default: nearly never here)
  hold   put a chain, take a lease on it and a reservation of N more keys, print HOLDING,
         then wait to be killed
"""

import sys
import time

import numpy as np

import tierd
from tierd.client import Client
from tierd.errors import LeaseError

from .helpers import block_for, chain, first_wrong, make_ns

FLIP_NS = make_ns(model="flip", block_tokens=256)   # 256 KiB blocks
FLIP_CHAINS = 4                                      # chains of 4 blocks per set: 4 MiB a set


def flip_chain(which: int, i: int) -> list[bytes]:
    """Chain `i` of set `which` (0 or 1) of the `read` mode's key space."""
    return chain(FLIP_NS, 5000 + 100 * which + i, 4)


def run_flips(tmp_path, mode: str, n: int) -> tuple[int, list[list[int]]]:
    """Two reader processes in `mode` ("read" or "lease", `n` reads each) against a daemon while
    this process flushes the host tier and puts one set of FLIP_NS chains, then the other, in
    turn (each set's blocks take the slots the other's just left). Asserts that both readers
    found every block they kept exact, and that no lease or reservation is left; returns the
    flips made and each reader's printed numbers."""
    import subprocess

    from .daemon import ROOT, DaemonProc
    d = DaemonProc(tmp_path, host_bytes="32MiB", toml='[host]\nslab_bytes = "4MiB"\n').start()
    try:
        readers = [subprocess.Popen([sys.executable, "-m", "tests.client_worker", d.socket, mode, str(i), str(n)],
                                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for i in range(2)]
        sets = [[k for i in range(FLIP_CHAINS) for k in flip_chain(w, i)] for w in (0, 1)]
        blocks = [[block_for(FLIP_NS, k) for k in keys] for keys in sets]
        flips = 0
        with Client(d.socket) as c:
            while any(p.poll() is None for p in readers):
                c.flush(tier="host")
                for i in range(0, len(sets[flips % 2]), 4):
                    c.put(FLIP_NS, sets[flips % 2][i:i + 4], blocks[flips % 2][i:i + 4])
                flips += 1
        outs = [p.communicate(timeout=600) for p in readers]
        for p, (out, err) in zip(readers, outs):
            assert p.returncode == 0, out + err
            assert out.startswith("OK")
        with Client(d.socket) as c:
            st = c.stats()
            assert st["leases"] == 0 and st["reservations"] == 0
        return flips, [list(map(int, out.split()[1:])) for out, _ in outs]
    finally:
        d.stop()


def main() -> int:
    sock, mode, seed, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    # hold: a reservation the daemon keeps (the reserve path; staged slots have a test of their own)
    c = (Client(sock, stage_bytes=0) if mode == "hold"
         else tierd.connect(f"unix://{sock}" + ("?pin_after_eviction_s=inf" if mode == "lease" and seed == 0 else "")))
    spaces = [make_ns(), make_ns(model="second", kv_dtype="bfloat16")]
    if mode == "hold":
        ns = spaces[0]
        keys = chain(ns, 10_000 + seed, 4)
        c.put(ns, keys, [block_for(ns, k) for k in keys])
        c.acquire(ns, keys)
        c.reserve(ns, chain(ns, 20_000 + seed, n))
        print("HOLDING", flush=True)
        time.sleep(3600)
        return 0
    rng = np.random.default_rng(seed)
    verified = 0
    if mode == "read":
        ns = FLIP_NS
        for i in range(n):
            keys = flip_chain(int(rng.integers(0, 2)), int(rng.integers(0, FLIP_CHAINS)))
            got = c.get(ns, keys)
            if (wrong := first_wrong(ns, keys, got)) is not None:
                print(f"MISMATCH {wrong.hex()} in get {i}", flush=True)
                return 1
            verified += len(got)
        print(f"OK {n} {verified} {c.unleased_reads} {c.unleased_discarded}", flush=True)
        c.close()
        return 0
    if mode == "lease":
        ns = FLIP_NS
        lost = 0
        for i in range(n):
            keys = flip_chain(int(rng.integers(0, 2)), int(rng.integers(0, FLIP_CHAINS)))
            lease = c.acquire(ns, keys, pipelined=True)
            copies = [np.array(b) for b in lease.buffers]
            try:
                lease.release(confirm=True)
            except LeaseError:
                lost += 1
                continue
            if (wrong := first_wrong(ns, lease.keys, copies)) is not None:
                print(f"MISMATCH {wrong.hex()} in lease {i}", flush=True)
                return 1
            verified += len(copies)
        print(f"OK {n} {verified} {c.pipelined_leases} {lost} {c.unpinned_leases}", flush=True)
        c.close()
        return 0
    for _ in range(n):
        ns = spaces[int(rng.integers(0, 2))]
        keys = chain(ns, int(rng.integers(0, 40)), int(rng.integers(1, 5)))
        op = rng.random()
        if op < 0.35:
            c.put(ns, keys, [block_for(ns, k) for k in keys])
        elif op < 0.65:
            for k, b in zip(keys, c.get(ns, keys)):
                if not np.array_equal(b, block_for(ns, k)):
                    print(f"MISMATCH {k.hex()}", flush=True)
                    return 1
                verified += 1
        elif op < 0.8:
            with c.acquire(ns, keys) as lease:
                for k, buf in zip(lease.keys, lease.buffers):
                    if not np.array_equal(buf, block_for(ns, k)):
                        print(f"MISMATCH {k.hex()}", flush=True)
                        return 1
                    verified += 1
        elif op < 0.95:
            n_present = c.lookup(ns, keys)
            assert 0 <= n_present <= len(keys)
        else:
            c.abort(c.reserve(ns, keys))
    print(f"OK {n} {verified} {getattr(c, 'unleased_reads', 0)}", flush=True)
    c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
