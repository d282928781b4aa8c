"""The client side of the crash harness: `python -m tests.crash_worker SOCKET FIRST N LOG`.

Stores chains FIRST .. FIRST+N-1 (4 blocks each, contents derived from their keys) as fast as
it can; after every 4 chains it calls sync and, once sync has returned, appends the synced range
to LOG and fsyncs it: LOG lists exactly what the daemon acknowledged durable. Reads back a chain
now and then (checked bit-exact). Exits quietly when the daemon dies under it.
"""

import os
import sys

import tierd
from tierd.client import DaemonUnavailableError
from tierd.errors import TierdError

from .helpers import block_for, chain, make_ns

CHAIN_BLOCKS = 4
SYNC_EVERY = 4


def main() -> int:
    sock, first, n, log_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    ns = make_ns()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        c = tierd.connect(f"unix://{sock}")
        unsynced_from = first
        for seed in range(first, first + n):
            keys = chain(ns, seed, CHAIN_BLOCKS)
            c.put(ns, keys, [block_for(ns, k) for k in keys])
            if seed % 7 == 0:
                for blk, k in zip(c.get(ns, keys), keys):
                    if blk.tobytes() != block_for(ns, k).tobytes():
                        print(f"WRONG CONTENT for chain {seed}", flush=True)
                        return 1
            if (seed - first) % SYNC_EVERY == SYNC_EVERY - 1:
                c.sync()
                os.write(log, f"{unsynced_from} {seed}\n".encode())
                os.fsync(log)
                unsynced_from = seed + 1
        print("DONE", flush=True)
    except (DaemonUnavailableError, ConnectionError, TierdError, OSError):
        pass   # the daemon was killed: what the log says is what counts
    finally:
        os.close(log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
