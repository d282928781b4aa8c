"""32 clients of mixed ops against one daemon (short here; `LOAD_SECONDS=600` or
`python -m benchmarks.load --seconds 600` for the long form): every block read is exact, nothing
is leaked, and RSS and open file descriptors stay within their bounds."""

import os

import pytest

from benchmarks import load

# Daemon RSS beyond the host tier: interpreter, numpy, msgpack, buffers (docs/RELIABILITY.md).
FIXED_OVERHEAD = 128 << 20


@pytest.mark.slow
def test_thirty_two_clients_mixed_ops_hold_their_bounds(tmp_path):
    r = load.run(float(os.environ.get("LOAD_SECONDS", "6")), 32, str(tmp_path))
    print({k: v for k, v in r.items() if k not in ("error_samples",)})
    assert r["errors"] == 0, r["error_samples"]
    assert r["verified"] > 100 and r["ops"] > 1000
    assert (r["leases_after"], r["reservations_after"]) == (0, 0)
    assert r["fds_after"] <= r["fds_baseline"] + 1                 # every connection's fd closed
    assert r["fds_peak"] <= r["fds_baseline"] + 32 + 8             # one per client, a few more
    assert r["rss_peak"] <= r["host_bytes"] + FIXED_OVERHEAD, r["rss_peak"]
