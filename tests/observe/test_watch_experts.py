"""The live page's expert-load panel: a line per MoE layer of the load's coefficient of variation at each evaluation
(in Chromium; skipped where there is none outside CI, as tests/test_watch.py's page tests)."""

from __future__ import annotations

import json

from gptkit.serving.watch import create_watch_app
from tests.observe.test_watch import open_page, wait_for
from tests.serving.servers import live_server


def test_expert_load_panel(tmp_path, browser) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dense = [{"step": s, "loss": 3.0, "lr": 1e-3, "val_loss": 3.1} for s in (0, 10)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in dense))
    with live_server(create_watch_app(run_dir)) as url:
        page = open_page(browser, url)
        wait_for(page, "document.querySelectorAll('#chart-loss polyline').length === 2")
        assert page.inner_text("#chart-experts").startswith("No expert load")
        moe = [dict(r, moe_tokens_per_expert=[[4, 4, 4, 4], [8, 8, 0, 0]]) for r in dense]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in moe))
        wait_for(page, "document.querySelectorAll('#chart-experts polyline').length === 3")  # 2 layers and 0.3
        labels = page.eval_on_selector_all("#chart-experts polyline", "els => els.map(e => e.dataset.label)")
        assert labels == ["MoE layer 0", "MoE layer 1", "0.3"] and page.errors == []
