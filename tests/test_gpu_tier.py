"""The HBM tier's logic, run with the tier in host memory (`gpu_device="cpu"`): blocks are copied
up once served often enough to a reader of HBM copies (and never without one), leases expose
exact device views, pinned copies are never evicted, the tier stays inclusive of the host tier,
and flush/stats cover it. The CUDA IPC export and import run only on a GPU (marker gpu)."""

import pytest
import torch

from tierd import TieredStore
from tierd.errors import ConfigError

from .helpers import block_for, chain, make_ns, small_config


@pytest.fixture
def gstore():
    s = TieredStore(small_config(None, host_bytes="2MiB", gpu_bytes="256KiB", gpu_slab_bytes="64KiB",
                                 gpu_device="cpu", gpu_admit_hits=1))
    yield s
    s.close()


def put(s, ns, seed, n=4):
    keys = chain(ns, seed, n)
    s.put(ns, keys, [block_for(ns, k) for k in keys])
    return keys


def test_second_hit_copies_to_hbm_and_lease_views_are_exact(gstore):
    ns = make_ns()
    keys = put(gstore, ns, 1)
    with gstore.acquire(ns, keys, gpu=True) as lease:               # first hit: host only
        assert lease.gpu_offsets == [-1] * 4
    with gstore.acquire(ns, keys, gpu=True) as lease:               # served once before: copied up
        assert all(o >= 0 for o in lease.gpu_offsets)
        for buf, k in zip(lease.gpu_buffers, keys):
            assert isinstance(buf, torch.Tensor)
            assert bytes(buf.numpy()) == block_for(ns, k).tobytes()
    st = gstore.stats()["tiers"]["gpu"]
    assert st["blocks"] == 4 and st["promotions"] == 4 and st["device"] == "cpu"
    with gstore.acquire(ns, keys, gpu=True) as lease:               # now a plain HBM hit
        assert all(o >= 0 for o in lease.gpu_offsets)
    assert gstore.stats()["tiers"]["gpu"]["promotions"] == 4


def test_a_lease_that_copies_blocks_up_waits_for_the_device_once(gstore, monkeypatch):
    """The copies into HBM of one lease are all queued, then waited for once (a wait per block
    cost one device round trip each)."""
    ns = make_ns()
    keys = put(gstore, ns, 3, n=6)
    with gstore.acquire(ns, keys, gpu=True):
        pass
    waits = []
    tier = gstore.gpu
    real_wait = tier._wait
    monkeypatch.setattr(tier, "_wait", lambda: (waits.append(1), real_wait()))
    with gstore.acquire(ns, keys, gpu=True) as lease:
        assert all(o >= 0 for o in lease.gpu_offsets)
        assert [bytes(b.numpy()) for b in lease.gpu_buffers] == [block_for(ns, k).tobytes() for k in keys]
    assert len(waits) == 1
    with gstore.acquire(ns, keys, gpu=True):                        # all in HBM now: no copy, no wait
        pass
    assert len(waits) == 1


def test_without_a_reader_of_hbm_copies_the_tier_costs_nothing(gstore):
    """Acquires that do not read HBM copies never copy a block up, lease nothing there, and
    leave the tier's counters at zero; a reader's acquire then does."""
    ns = make_ns()
    keys = put(gstore, ns, 1)
    for _ in range(5):
        with gstore.acquire(ns, keys) as lease:
            assert lease.gpu_offsets == [] and lease.gpu_buffers == []
            assert [bytes(b) for b in lease.buffers] == [block_for(ns, k).tobytes() for k in keys]
        assert gstore.is_quick("acquire", ns, keys)
    st = gstore.stats()["tiers"]["gpu"]
    assert st["blocks"] == 0 and st["promotions"] == 0 and st["used_bytes"] == 0
    assert not gstore.is_quick("acquire", ns, keys, gpu=True)    # a reader's acquire would copy
    with gstore.acquire(ns, keys, gpu=True) as lease:
        assert all(o >= 0 for o in lease.gpu_offsets)
    assert gstore.stats()["tiers"]["gpu"]["promotions"] == 4
    assert gstore.is_quick("acquire", ns, keys, gpu=True)        # now plain HBM hits


def test_leased_hbm_copies_are_never_evicted_and_pressure_evicts_the_rest(gstore):
    ns = make_ns()                                          # 16 KiB blocks: 16 fit in 256 KiB
    held = put(gstore, ns, 1)
    for _ in range(2):
        gstore.acquire(ns, held, gpu=True).__exit__(None, None, None)
    lease = gstore.acquire(ns, held, gpu=True)                        # pins 4 HBM copies
    assert all(o >= 0 for o in lease.gpu_offsets)
    for seed in range(2, 12):                               # 40 more blocks want HBM
        keys = put(gstore, ns, seed)
        for _ in range(2):
            gstore.acquire(ns, keys, gpu=True).__exit__(None, None, None)
    st = gstore.stats()["tiers"]["gpu"]
    assert st["evictions"] > 0 and st["blocks"] <= 16
    for buf, k in zip(lease.gpu_buffers, held):             # the pinned copies are intact
        assert bytes(buf.numpy()) == block_for(ns, k).tobytes()
    gstore.release(lease)


def test_hbm_is_inclusive_and_flushable(gstore):
    ns = make_ns()
    keys = put(gstore, ns, 1)
    for _ in range(2):
        gstore.acquire(ns, keys, gpu=True).__exit__(None, None, None)
    assert gstore.stats()["tiers"]["gpu"]["blocks"] == 4
    assert gstore.flush("gpu") == 4
    assert gstore.stats()["tiers"]["gpu"]["blocks"] == 0
    assert gstore.lookup(ns, keys) == 4                      # the host copies stay
    gstore.acquire(ns, keys, gpu=True).__exit__(None, None, None)
    assert gstore.stats()["tiers"]["gpu"]["blocks"] == 4
    gstore.flush("host")                                     # no HBM copy without a host copy
    assert gstore.stats()["tiers"]["gpu"]["blocks"] == 0 and gstore.stats()["tiers"]["gpu"]["used_bytes"] == 0


def test_a_store_without_hbm_reports_no_gpu_tier_and_cuda_is_required_for_cuda():
    s = TieredStore(small_config(None))
    try:
        assert "gpu" not in s.stats()["tiers"]
        ns = make_ns()
        keys = put(s, ns, 1)
        with s.acquire(ns, keys) as lease:
            assert lease.gpu_offsets == []
    finally:
        s.close()
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            TieredStore(small_config(None, gpu_bytes="1MiB", gpu_device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_hbm_tier_on_the_device_and_another_process_maps_it(tmp_path):
    """On a GPU: the tier's copies are exact on the device, and a second process maps the tier
    through its IPC handle and reads the exact bytes at the leased offsets."""
    import json
    import subprocess
    import sys
    pytest.importorskip("cupy")
    s = TieredStore(small_config(None, gpu_bytes="4MiB", gpu_slab_bytes="1MiB", gpu_device="cuda"))
    try:
        ns = make_ns()
        keys = put(s, ns, 1)
        for _ in range(2):
            s.acquire(ns, keys, gpu=True).__exit__(None, None, None)
        with s.acquire(ns, keys, gpu=True) as lease:
            for buf, k in zip(lease.gpu_buffers, keys):
                assert buf.is_cuda and bytes(buf.cpu().numpy()) == block_for(ns, k).tobytes()
            desc = s.gpu.descriptor()
            assert desc["ipc_handle"] and desc["capacity_bytes"] == s.gpu.capacity_bytes
            spec = tmp_path / "spec.json"
            spec.write_text(json.dumps({**{k: v for k, v in desc.items() if k != "ipc_handle"},
                                        "ipc_handle": desc["ipc_handle"].hex(), "offsets": lease.gpu_offsets,
                                        "block_bytes": ns.block_bytes,
                                        "want": [block_for(ns, k).tobytes().hex() for k in keys]}))
            code = (
                "import json, sys\n"
                "from tierd.tiers.gpu import open_ipc\n"
                "d = json.load(open(sys.argv[1]))\n"
                "d['ipc_handle'] = bytes.fromhex(d['ipc_handle'])\n"
                "m = open_ipc(d)\n"
                "assert m is not None, 'could not map the HBM tier'\n"
                "arena = m.tensor\n"
                "for off, want in zip(d['offsets'], d['want']):\n"
                "    got = bytes(arena[off:off + d['block_bytes']].cpu().numpy())\n"
                "    assert got == bytes.fromhex(want), f'bytes differ at {off}'\n"
                "m.close()\n"
                "print('ok', len(d['offsets']))\n")
            r = subprocess.run([sys.executable, "-c", code, str(spec)], capture_output=True, text=True, timeout=120)
            assert r.returncode == 0 and "ok 4" in r.stdout, r.stderr
    finally:
        s.close()


def test_the_daemon_serves_and_reports_an_hbm_tier(tmp_path):
    """With `[gpu] device = "cpu"` the daemon runs the HBM tier's logic in host memory: stats,
    the stats schema, metrics and the CLI table include it (no IPC handle is exported)."""
    import json
    import subprocess
    import sys
    import urllib.request

    import jsonschema

    import tierd

    from .daemon import ROOT, SMALL_TOML, DaemonProc
    d = DaemonProc(tmp_path, toml=SMALL_TOML + '[gpu]\nbytes = "1MiB"\nslab_bytes = "256KiB"\ndevice = "cpu"\n').start()
    try:
        ns = make_ns()
        keys = chain(ns, 1, 4)
        with tierd.connect(d.url) as c:                  # maps no HBM tier: not a reader
            c.put(ns, keys, [block_for(ns, k) for k in keys])
            for _ in range(3):
                with c.acquire(ns, keys) as lease:
                    assert [bytes(b) for b in lease.buffers] == [block_for(ns, k).tobytes() for k in keys]
            assert c.stats()["tiers"]["gpu"]["promotions"] == 0   # nothing copied for nobody
        with tierd.connect(d.url + "?hbm=1") as c:       # says it reads HBM copies
            for _ in range(2):
                with c.acquire(ns, keys) as lease:
                    assert lease.gpu_buffers == []      # no CUDA here: host copies serve
                    assert [bytes(b) for b in lease.buffers] == [block_for(ns, k).tobytes() for k in keys]
            st = c.stats()
        assert st["tiers"]["gpu"]["blocks"] == 4 and st["tiers"]["gpu"]["promotions"] == 4
        schema = json.loads((ROOT / "docs" / "stats.schema.json").read_text())
        jsonschema.validate(st, schema)
        text = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5).read().decode()
        assert 'tierd_tier_blocks{tier="gpu"} 4.0' in text
        assert 'tierd_block_moves_total{from_tier="host",to_tier="gpu"} 4.0' in text
        out = subprocess.run([sys.executable, "-m", "tierd", "stats", "--socket", d.socket], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "\ngpu " in out.stdout
    finally:
        d.stop()
