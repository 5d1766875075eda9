import json

import pytest

from codraft.bench.tapchannel import TRANSPORTS, run_tapchannel_bench


def test_tapchannel_bench_times_every_transport_against_the_local_taps_control(tmp_path):
    payload = run_tapchannel_bench(tmp_path, pps=(2,), microbatches=(2,), families=("eagle3",), sequences=4,
                                   repeats=1)
    rows = payload["rows"]
    assert [r["transport"] for r in rows] == list(TRANSPORTS)
    for r in rows:
        assert r["no_draft_step_s"] > 0 and r["local_taps_step_s"] > 0 and r["step_s"] > 0
        assert r["added_s"] == pytest.approx(r["step_s"] - r["local_taps_step_s"])
        assert r["added_pct_of_no_draft"] == pytest.approx(100 * r["added_s"] / r["no_draft_step_s"])
        assert r["post_s"] > 0 and r["fetch_s"] > 0  # the taps did travel
    assert json.loads((tmp_path / "tapchannel.json").read_text())["rows"] == rows
    assert "| host_staging |" in (tmp_path / "tapchannel.md").read_text()
    assert (tmp_path / "tapchannel.png").stat().st_size > 0
