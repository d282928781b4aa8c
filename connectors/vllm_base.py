"""vLLM's connector base classes where vLLM is installed, stand-ins where it is not: the
connector's modules import without vLLM, so their logic is tested everywhere."""

from __future__ import annotations

import enum
import functools
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

try:  # vLLM is optional: the real base classes where it is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Stand-in for vLLM's (empty) metadata base class."""

    class KVConnectorBase_V1:  # type: ignore[no-redef]
        """Stand-in for the part of vLLM's base class this connector relies on."""

        def __init__(self, vllm_config, role, kv_cache_config):
            self._connector_metadata = None
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self):
            return self._role

        def bind_connector_metadata(self, connector_metadata) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None

        def get_transfer_results(self, finished_req_ids: set[str]) -> "KVConnectorTransferResults":
            sending, recving = self.get_finished(finished_req_ids)
            return KVConnectorTransferResults(set(sending or ()), set(recving or ()))

try:  # what a worker reports each step (vLLM versions that take failed requests back)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:
    @dataclass
    class KVConnectorTransferResults:  # type: ignore[no-redef]
        """Stand-in for vLLM's per-step transfer report."""

        finished_sending: set[str] = field(default_factory=set)
        finished_recving: set[str] = field(default_factory=set)
        failed_recving: set[str] = field(default_factory=set)

try:  # where cached prompt tokens came from, in vLLM's metrics (vLLM versions that count it)
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:
    class CacheHitSource(str, enum.Enum):  # type: ignore[no-redef]
        """Stand-in for vLLM's cache hit sources (the ones this connector reports)."""

        HOST = "host"
        DISK = "disk"
        EXTERNAL_UNSPECIFIED = "external_unspecified"

try:  # the hybrid KV cache manager's interface (vLLM keeps the manager on only for its subclasses)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:
    class SupportsHMA(ABC):  # type: ignore[no-redef]
        """Stand-in for vLLM's mark of a connector that takes block ids per KV cache group."""

        @abstractmethod
        def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
            raise NotImplementedError


def timed(stat: str):
    """Adds the wall time of each call of the decorated connector method to `self.stats[stat]`
    (the connector's time on the engine's own thread: `sched_s` in the scheduler's hooks,
    `hook_s` in the worker's; what a request that hits nothing pays)."""
    def wrap(fn):
        @functools.wraps(fn)
        def method(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                self.stats[stat] = self.stats.get(stat, 0.0) + time.perf_counter() - t0
        return method
    return wrap
