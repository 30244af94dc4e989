"""The live page's charts: the induction chart's y-axis always spans the score's range, [0, 1], so that a small
model's scores near chance do not fill the chart with their noise."""

from __future__ import annotations

import json

from gptkit.serving.watch import create_watch_app
from tests.observe.test_watch import lines, open_page, wait_for, write_run
from tests.serving.servers import live_server


def y_labels(page, chart: str) -> list[float]:
    """The numbers on a chart's y-axis (its labels with text-anchor end, left of the plot)."""
    texts = page.eval_on_selector_all(f"#{chart} svg text[text-anchor='end']", "els => els.map((e) => e.textContent)")
    return [float(t) for t in texts]


def test_induction_scores_near_chance_are_drawn_near_zero_on_a_zero_to_one_axis(tmp_path, browser):
    run_dir = write_run(tmp_path / "run", up_to=200)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for record, score in zip([r for r in records if "induction_score" in r], (0.012, 0.017, 0.011)):
        record["induction_score"], record["induction_chance"] = score, 0.01  # noise around chance
    (run_dir / "metrics.jsonl").write_text(lines(records))
    with live_server(create_watch_app(run_dir)) as url:
        page = open_page(browser, url)
        wait_for(page, "document.querySelectorAll('#chart-induction svg').length > 0")
        assert y_labels(page, "chart-induction") == [0, 0.2, 0.4, 0.6, 0.8, 1]
        loss = y_labels(page, "chart-loss")  # the other charts still fit their values
        assert min(loss) > 2 and max(loss) < 5
        assert page.errors == []
