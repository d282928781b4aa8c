"""A store-writing process for crash and restart tests: `python -m tests.writer_proc DIR MODE N`.

Modes:
  sync-close   put chains 0..N-1, sync, close cleanly (writes a checkpoint), print DONE
  sync-kill    put chains 0..N-1, sync, print SYNCED, then wait to be killed
  burst        put chains 0..N-1 of 4 blocks with constant demotion; after every 5th chain
               sync and print `DURABLE <last seed>`; then wait to be killed
"""

import sys
import time

from tierd import TieredStore

from .helpers import block_for, chain, make_ns, small_config


def config(d):
    return small_config(None, disk_path=str(d), host_bytes="256KiB", host_slab_bytes="64KiB",
                        disk_bytes="48MiB", disk_file_bytes="16MiB")


def main() -> None:
    d, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ns = make_ns()
    s = TieredStore(config(d))
    for seed in range(n):
        keys = chain(ns, seed, 4)
        s.put(ns, keys, [block_for(ns, k) for k in keys])
        if mode == "burst" and seed % 5 == 4:
            s.sync()
            print(f"DURABLE {seed}", flush=True)
    if mode == "burst":
        print("IDLE", flush=True)
        time.sleep(3600)
    s.sync()
    if mode == "sync-close":
        s.close()
        print("DONE", flush=True)
        return
    print("SYNCED", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
