import json

import torch

from codraft.bench.attention import AttentionBenchShape, run_attention_bench
from codraft.bench.memory import LiveTensorBytes, peak_memory


def test_live_tensor_bytes_tracks_the_peak_of_tensors_allocated_inside():
    before = torch.randn(1000, 1000, requires_grad=True)  # 4 MB that exist before: not counted
    with peak_memory("cpu") as mem:
        a = torch.empty(250_000)  # 1 MB, freed at once
        del a
        b = torch.empty(500_000)  # 2 MB
        c = b * 2  # 2 MB more: peak 4 MB
        del b, c
        view = before.view(-1)  # a view of an older tensor allocates nothing
        del view
    assert mem.bytes == 4_000_000
    with LiveTensorBytes() as mode:
        y = before.exp().sum()  # exp's 4 MB result stays alive, saved for the backward
        assert mode.live == 4_000_000 + 4
        y.backward()
        del y
        assert mode.live == 4_000_000  # the graph let go of exp's result; before.grad is new and alive
        before.grad = None
    assert mode.live == 0


def test_attention_bench_writes_json_markdown_and_plot(tmp_path):
    shape = AttentionBenchShape(heads=2, kv_heads=1, head_dim=8, block=4, anchors_per_seq=2)
    rows = run_attention_bench(tmp_path, cps=(1,), seq_lens=(80, 160), shape=shape, iters=1)
    assert {(r["workload"], r["seq_len"]) for r in rows} == {(w, n) for w in ("ttt", "dflash") for n in (80, 160)}
    assert all(r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["peak_mib"] > 0 for r in rows)
    assert json.loads((tmp_path / "attention.json").read_text())["rows"] == rows
    assert "| ttt | single | 1 | 1x1 | 160 |" in (tmp_path / "attention.md").read_text()
    assert (tmp_path / "attention.png").stat().st_size > 0
