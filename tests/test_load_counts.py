"""What one hit's load asks of the device, counted: a transfer (`BlockTransfer.load_layers`)
runs on CPU caches with stand-ins for the CUDA calls -- streams that run queued work only when
something waits for it (tests/helpers.LazyStreams, counting host syncs), page-locking that
records the ranges, and a launcher that runs each launch of the copy kernel as its documented
semantics on the real addresses (tests/test_direct_scatter.py) -- and the copies, uploads,
launches and syncs of each load are counted. A load of B tier blocks into an L-layer model
costs one upload, L launches (one without layer-by-layer waits), at most 4 copies per block
that is not read where it lies, and no host sync before the first layer's compute: none of it
grows with L x B. The bytes land where the torch reference puts them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tierd.kernels import cases, ops, reference
from tierd.kernels.transfer import BlockTransfer

from .helpers import LazyStreams
from .test_direct_scatter import run_scatter_kernel


class CountingStreams(LazyStreams):
    def __init__(self):
        super().__init__()
        self.syncs = 0

    def synchronize(self, event) -> None:
        self.syncs += 1
        super().synchronize(event)


class Pinning:
    """Page-locking stand-in: every range registers."""

    def __init__(self):
        self.ranges = []

    def register(self, ptr, size, tag=None):
        self.ranges.append((ptr, size))
        return True

    def unregister(self, ptr, tag=None):
        pass


class CountCopies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.copies += 1
        return func(*args, **(kwargs or {}))


def build(layers: int, nb: int, bs: int = 4, heads: int = 2, d: int = 8):
    ks, vs = [], []
    for _ in range(layers):
        _, k, v = cases.cache_views("contiguous", nb, bs, heads, d, lambda s: torch.zeros(s, dtype=torch.float16))
        ks.append(k)
        vs.append(v)
    return ks, vs


@pytest.mark.parametrize("layered", [True, False])
@pytest.mark.parametrize("sources", ["staged", "direct", "mixed"])
@pytest.mark.parametrize("layers,blocks", [(2, 3), (8, 3), (8, 12), (16, 12)])
def test_a_hits_copies_uploads_launches_and_syncs_do_not_grow_with_layers_times_blocks(
        layers, blocks, sources, layered, monkeypatch):
    ratio, nb = 2, 2 * 12 + 4
    ks, vs = build(layers, nb)
    want_k, want_v = build(layers, nb)
    streams, pinning = CountingStreams(), Pinning()
    launches, uploads = [], []

    def launcher(*a):
        launches.append(a[3])
        run_scatter_kernel(*a)
    real_upload = ops._upload
    monkeypatch.setattr(ops, "_upload", lambda values, device: (uploads.append(len(values)),
                                                                real_upload(values, device))[1])
    xfer = BlockTransfer(ks, vs, ratio, pinning=pinning, streams=streams, launcher=launcher,
                         direct=sources != "staged")
    bb = xfer.block_bytes
    rng = np.random.default_rng(layers * 100 + blocks)
    arena = rng.integers(0, 256, (blocks + 2) * bb, dtype=np.uint8)      # the registered arena
    loose = rng.integers(0, 256, blocks * bb, dtype=np.uint8)            # host memory not registered
    if sources != "staged":
        assert xfer.register_host(arena)
    buffers, device_buffers, staged = [], [], 0
    for t in range(blocks):
        kind = {"staged": "loose", "direct": "arena"}.get(sources) or ("hbm", "arena", "loose")[t % 3]
        if kind == "loose":
            buffers.append(loose[t * bb:(t + 1) * bb])
            staged += 1
        else:
            buffers.append(arena[(t + 1) * bb:(t + 2) * bb])
        device_buffers.append(torch.from_numpy(rng.integers(0, 256, bb, dtype=np.uint8)) if kind == "hbm" else None)
    ids = torch.randperm(nb)[:blocks * ratio].view(blocks, ratio)
    ids[1, 0] = -1                                                        # a part the engine holds
    srcs = [d if d is not None else torch.from_numpy(b) for b, d in zip(buffers, device_buffers)]
    reference.scatter_blocks(want_k, want_v, ids, srcs)

    counter = CountCopies()
    with counter:
        job = xfer.load_layers(ids, buffers, device_buffers if sources == "mixed" else None, layered=layered)
        syncs_before_compute = streams.syncs
        for i in range(layers):
            job.wait_layer(i)
            streams.settle()
        job.synchronize()

    for got, want in zip(ks + vs, want_k + want_v):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert job.device_blocks == sum(d is not None for d in device_buffers) * (sources == "mixed")
    assert uploads == [(layers if layered else 1) * (blocks * ratio + blocks)]   # one upload, whole
    assert len(launches) == (layers if layered else 1)
    assert counter.copies == staged * (min(layers, BlockTransfer.LOAD_CHUNKS) if layered else 1)
    assert syncs_before_compute == 0
    assert streams.syncs == 1                                    # the caller's synchronize, at the end
    assert len(job.events) == (layers if layered else 1)


def test_the_first_layer_waits_for_its_own_range_of_layers_only():
    """Layer-by-layer: the staged copies of later layers are queued after layer 0's launch, so
    a compute stream that waits for layer 0 runs none of them."""
    layers, ratio, nb = 8, 1, 8
    ks, vs = build(layers, nb)
    streams = CountingStreams()
    launched = []

    def launcher(*a):
        launched.append(a)
        run_scatter_kernel(*a)
    xfer = BlockTransfer(ks, vs, ratio, pinning=Pinning(), streams=streams, launcher=launcher, direct=False)
    slots = [np.random.default_rng(i).integers(0, 256, xfer.block_bytes, dtype=np.uint8) for i in range(2)]
    ids = torch.tensor([[3], [5]])
    counter = CountCopies()
    with counter:
        job = xfer.load_layers(ids, slots, layered=True)
        assert counter.copies == 0 and not launched          # queued, not run
        job.wait_layer(0)
        streams.settle()
    # everything queued before layer 0's event ran, and nothing after it: one range's copies
    assert counter.copies == 2 and len(launched) == 1
    unit = xfer.layer_bytes // 2
    assert torch.equal(ks[0][3].reshape(-1).view(torch.uint8), torch.from_numpy(slots[0][:unit]))
    assert not ks[layers - 1][3].any()                         # a later layer: still loading
    job.synchronize()
    assert ks[layers - 1][3].view(torch.uint8).reshape(-1).tolist() == \
        slots[0][(layers - 1) * xfer.layer_bytes:(layers - 1) * xfer.layer_bytes + unit].tolist()
