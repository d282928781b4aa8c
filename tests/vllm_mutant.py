"""A deliberately wrong TierdConnector, for tests that must show they would notice the mistake
(tests/test_vllm_models.py). Loaded by vLLM from `kv_connector_module_path = tests.vllm_mutant`;
`kv_connector_extra_config.mutation` names the mistake:

- ``swap_groups``: every layer is loaded through the other KV cache group's block ids.
- ``no_state``: a hit's recurrent state (Mamba, linear attention) is not written, its attention
  KV is: the state blocks keep what they held.
- ``cpu_mla``: MLA is cached on vLLM's CPU build although vLLM computes wrong tokens over a
  loaded prefix there (see `TierdConnector._mla_declined`): to check the latent byte path end to
  end. With ``dump`` (a directory), the latent rows each save copied out and each load copied in
  are written there (torch.save), so a test can compare them across engine processes.

Never used outside tests."""

from __future__ import annotations

import os

import torch

from tierd.connectors import vllm as tv


def _extra(conn) -> dict:
    return getattr(conn._kv_transfer_config, "kv_connector_extra_config", None) or {}


class TierdConnector(tv.TierdConnector):
    def _mla_declined(self) -> str:
        return "" if _extra(self).get("mutation") == "cpu_mla" else super()._mla_declined()

    def _dump(self, what: str, ids: list[int]) -> None:
        where = _extra(self).get("dump")
        if where and ids:
            rows = [self._layers[i][0][ids].clone() for i in range(len(self._layers))]
            torch.save({"ids": ids, "rows": rows}, os.path.join(where, f"{what}-{os.getpid()}-{ids[0]}.pt"))

    def _start_copy(self, res, p):
        out = super()._start_copy(res, p)
        self._dump("save", [b for b in p.spec.block_ids[0] if b >= 0])
        return out

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        super().start_load_kv(forward_context, **kwargs)
        for spec in getattr(meta, "loads", None) or ():
            if not spec.is_async:
                self._dump("load", [b for b in spec.block_ids[0] if b >= 0])

    def _load_state(self, store, spec):
        if _extra(self).get("mutation") == "no_state":
            return True
        return super()._load_state(store, spec)

    def _load_ids(self, spec, loaded):
        ids = super()._load_ids(spec, loaded)
        mutation = _extra(self).get("mutation")
        if mutation == "swap_groups" and ids.dim() == 3:
            ids = ids.flip(1)
        return ids
