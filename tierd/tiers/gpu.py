"""The HBM tier: one device allocation carved into slab-class slots, an inclusive cache of
host-tier blocks (a block in HBM always has its host copy, so dropping it loses nothing).

In the daemon the allocation is exported with a CUDA IPC handle (`descriptor()`); a client on
the same node opens it (`open_ipc`) and copies leased blocks device-to-device. `device="cpu"`
gives the same tier in host memory without IPC: that is how the tier's logic is tested on
machines without a GPU.
"""

from __future__ import annotations

import logging

import torch

from ..arena import SlabAllocator, plan_slabs
from ..config import ALIGN
from ..errors import ConfigError
from .base import BlockMeta, Tier

log = logging.getLogger("tierd.store")

GPU_SLOT_ALIGN = ALIGN   # slots keep 4 KiB alignment, as on the host, so 16-byte accesses hold


class GpuTier(Tier):
    name = "gpu"

    def __init__(self, capacity_bytes: int, slab_bytes: int, device: str = "cuda"):
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("gpu_bytes is set but CUDA is not available; set gpu_bytes = 0")
        if self.device.type == "cuda":
            try:
                import cupy  # noqa: F401
            except ImportError:
                raise ConfigError("the HBM tier needs CuPy (pip install 'tierd[cuda]'), or set gpu_bytes = 0") from None
        capacity_bytes = capacity_bytes // ALIGN * ALIGN
        num_slabs, slab_bytes = plan_slabs(capacity_bytes, slab_bytes, "gpu tier")
        self.capacity_bytes = capacity_bytes
        self._raw = None
        if self.device.type == "cuda":
            self.buffer = self._cuda_buffer(capacity_bytes)
        else:
            self.buffer = torch.zeros(capacity_bytes, dtype=torch.uint8, device=self.device)
        self.alloc = SlabAllocator(num_slabs, slab_bytes, capacity_bytes=capacity_bytes)

    def _cuda_buffer(self, nbytes: int) -> torch.Tensor:
        """One cudaMalloc of its own (not torch's caching allocator, which may hand out the middle
        of a larger segment: an IPC handle names a whole allocation, so the buffer must be one)."""
        import cupy
        dev = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", dev)
        with cupy.cuda.Device(dev):
            self._raw = cupy.cuda.runtime.malloc(nbytes)
            mem = cupy.cuda.UnownedMemory(self._raw, nbytes, owner=self, device_id=dev)
            arr = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
            arr.fill(0)
        return torch.as_tensor(arr, device=self.device)

    def view(self, slot: int, nbytes: int) -> torch.Tensor:
        """(nbytes,) uint8 view of a slot on the device."""
        off = self.alloc.offset(slot)
        return self.buffer[off:off + nbytes]

    def fill(self, slot: int, src) -> None:
        """Copy a host buffer (numpy uint8) into a slot; returns when the copy is done."""
        if not self.fill_many([(slot, src)])[0]:
            raise RuntimeError(f"copying {src.nbytes} bytes into HBM slot {slot} failed")

    def fill_many(self, items) -> list[bool]:
        """Copy host buffers (numpy uint8) into slots: every copy queued, then one wait for
        them all (not one per block). Per item, whether its bytes are there; an error at the
        wait fails every item (the host copies still serve them)."""
        ok = []
        for slot, src in items:
            try:
                t = torch.from_numpy(src)
                self.view(slot, t.numel()).copy_(t, non_blocking=True)
                ok.append(True)
            except Exception as e:  # noqa: BLE001 -- that block is served from host RAM
                log.warning("HBM tier: copy into slot %d failed (%s)", slot, e)
                ok.append(False)
        if any(ok):
            try:
                self._wait()
            except Exception as e:  # noqa: BLE001
                log.warning("HBM tier: waiting for %d copies failed (%s)", sum(ok), e)
                return [False] * len(ok)
        return ok

    def _wait(self) -> None:
        """Until the copies queued on the device's current stream have run (one wait a fill)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def write(self, slot: int, src, meta: BlockMeta) -> int:
        self.fill(slot, src[:meta.block_bytes])
        return slot

    def read(self, slot: int, dst) -> None:
        torch.from_numpy(dst).copy_(self.view(slot, dst.nbytes).cpu())

    def usage(self) -> dict:
        return {**super().usage(), "device": str(self.device)}

    def descriptor(self) -> dict | None:
        """What a client on this node needs to map the tier (CUDA only: an IPC handle)."""
        if self.device.type != "cuda":
            return None
        import cupy
        with cupy.cuda.Device(self.device.index):
            handle = cupy.cuda.runtime.ipcGetMemHandle(self._raw)
        return {"tier": "gpu", "ipc_handle": bytes(handle), "capacity_bytes": self.capacity_bytes,
                "device": self.device.index,
                "device_uuid": str(torch.cuda.get_device_properties(self.device).uuid)}

    def close(self) -> None:
        self.buffer = None
        if self._raw is not None:
            import cupy
            with cupy.cuda.Device(self.device.index):
                cupy.cuda.runtime.free(self._raw)
            self._raw = None


class IpcMapping:
    """A daemon's HBM tier mapped into this process: `tensor` (capacity_bytes,) uint8 on the
    device; `close()` closes the IPC handle (once every view of it is gone)."""

    def __init__(self, tensor: torch.Tensor, ptr: int, device: int, key: tuple):
        self.tensor, self._ptr, self._device, self.key = tensor, ptr, device, key

    def close(self) -> None:
        if self._ptr is None:
            return
        self.tensor = None
        try:
            import cupy
            with cupy.cuda.Device(self._device):
                torch.cuda.synchronize(self._device)   # no copy from the mapping still in flight
                cupy.cuda.runtime.ipcCloseMemHandle(self._ptr)
        except Exception:  # noqa: BLE001 -- the daemon is gone or the context with it
            pass
        self._ptr = None


def ipc_key(desc: dict) -> tuple:
    """What names one export: the device and the handle (a restarted daemon exports another)."""
    return (desc.get("device_uuid"), bytes(desc.get("ipc_handle") or b""))


def open_ipc(desc: dict) -> IpcMapping | None:
    """Map a daemon's HBM tier, or None where this process cannot (no CUDA or CuPy, or the
    daemon's device is not visible here). The device is found by UUID: under another
    CUDA_VISIBLE_DEVICES its index differs from the daemon's."""
    if not desc or not torch.cuda.is_available():
        return None
    try:
        import cupy
        dev = next((i for i in range(torch.cuda.device_count())
                    if str(torch.cuda.get_device_properties(i).uuid) == desc.get("device_uuid")), None)
        if dev is None:
            return None
        with cupy.cuda.Device(dev):
            ptr = cupy.cuda.runtime.ipcOpenMemHandle(desc["ipc_handle"],
                                                     cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
            mem = cupy.cuda.UnownedMemory(ptr, desc["capacity_bytes"], owner=None, device_id=dev)
            arr = cupy.ndarray((desc["capacity_bytes"],), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        return IpcMapping(torch.as_tensor(arr, device=f"cuda:{dev}"), ptr, dev, ipc_key(desc))
    except Exception:  # noqa: BLE001 -- the host tier still serves every block
        return None
