import json

from codraft.bench.e2e import run_e2e_bench
from codraft.config import load_config
from codraft.drafts import build_draft
from codraft.drafts.export import export_draft
from codraft.models import load_policy


def test_e2e_bench_runs_every_variant_and_writes_table_and_plot(tmp_path):
    cfg = load_config(None, ["model.path=tiny-llama", "rl.steps=3", "rl.prompts_per_step=2", "rl.group_size=2",
                             "rl.max_new_tokens=5", "rl.adaptive=false", "run.tensorboard=false"])
    policy, tokenizer = load_policy(cfg)
    warm = tmp_path / "warm_eagle3"
    export_draft(build_draft(cfg.draft, policy, tokenizer), warm)
    run_e2e_bench(cfg, {"eagle3": str(warm)}, str(tmp_path), runs_dir=tmp_path / "runs")
    payload = json.loads((tmp_path / "e2e.json").read_text())
    runs = {s["run"]: s for s in payload["summary"]}
    assert set(runs) == {"baseline", "eagle3", "frozen_eagle3"}
    assert runs["baseline"]["rollout_speedup"] == 1.0 and runs["baseline"]["e2e_speedup"] == 1.0
    assert all(len(payload["history"][name]) == 3 for name in runs)
    assert (tmp_path / "e2e.md").read_text().startswith("| run |")
    assert (tmp_path / "e2e.png").stat().st_size > 0
    assert (tmp_path / "runs" / "eagle3" / "metrics.jsonl").is_file()
