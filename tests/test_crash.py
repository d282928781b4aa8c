"""The crash harness's short form (the soak: `python -m tests.crash_harness --kills 200`)."""

import json

import pytest

from . import crash_harness


@pytest.mark.slow
def test_sigkill_rounds_lose_nothing_durable_and_serve_nothing_wrong_from_disk_or_host(tmp_path):
    (tmp_path / "arena").mkdir()
    lines = []
    summary = crash_harness.run(6, seed=1, workdir=tmp_path, log=lines.append)
    rounds = summary["rounds"]
    assert len(rounds) == 7 and all(r.get("verdict") != "FAIL" for r in rounds)
    assert sum(r["durable_checked"] for r in rounds) > 0          # durable chains were checked
    assert any(r.get("damage") for r in rounds)                    # and torn files were survived
    assert any(r.get("host_damage") for r in rounds)               # and a damaged host arena
    assert summary["host_adopted"] > 0                             # host blocks came back after kills
    print("\n".join(lines))
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}))
