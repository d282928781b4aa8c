"""The engine never fails because of tierd: with the daemon down, stalled or answering errors,
every request completes with the tokens of a run without tierd, at a bounded extra latency."""

import pytest

pytest.importorskip("transformers")

from benchmarks import engine_faults  # noqa: E402
from tierd.engine.random_model import write_random_model  # noqa: E402


@pytest.mark.slow
def test_requests_complete_with_the_same_tokens_at_bounded_extra_latency(tmp_path):
    model_dir = write_random_model(tmp_path / "llama", seed=0)
    res = engine_faults.run(model_dir, 4, str(tmp_path))
    base_lat, base_out, _ = res["baseline"]
    for cond in ("down", "erroring", "stalled"):
        lat, outs, stats = res[cond]
        assert outs == base_out, cond
        assert stats["unavailable"] >= 1, (cond, stats)
        assert stats["loaded_tokens"] == 0 and stats["stored_blocks"] == 0
        # at most one failed connect + one retried request per request, each bounded by the timeout
        extra = max(a - b for a, b in zip(lat, base_lat))
        assert extra < 2 * engine_faults.TIMEOUT_S + 1.0, (cond, lat, base_lat)
        print(cond, [round(x * 1e3) for x in lat], "ms vs", [round(x * 1e3) for x in base_lat])
