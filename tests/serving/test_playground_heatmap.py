"""The playground's attention heatmap keeps its token labels readable on long texts: a 10-pixel font, and past
about 45 tokens every k-th token labelled (with its position) instead of every token in a smaller font."""

from __future__ import annotations

import pytest

from gptkit.serving.server import ServeOptions, build_app
from tests.serving.servers import live_server, make_model_dir
from tests.serving.test_serve_playground import TEXT, _need_browser, playground_page


def ink(page) -> list[float]:
    """The alpha summed over the left and the top margins of the heatmap: where the labels are written."""
    return page.eval_on_selector(
        "#heatmap",
        """el => { const c = el.getContext('2d'), m = 48;
        const alpha = (x, y, w, h) => c.getImageData(x, y, w, h).data.filter((v, k) => k % 4 == 3)
            .reduce((a, b) => a + b, 0);
        return [alpha(0, m, m, el.height - m), alpha(m, 0, el.width - m, m)]; }""",
    )


@pytest.mark.parametrize("tokens, every", [(27, "1"), (60, "2"), (96, "3")])  # (560 - 48) // n pixels a cell
def test_long_texts_label_every_kth_token_in_a_readable_font(tmp_path, tokens, every):
    _need_browser()
    app = build_app(make_model_dir(tmp_path / "tiny-served", block_size=96), ServeOptions())
    with live_server(app) as url, playground_page(url, "tiny-served") as page:
        page.fill("#prompt", ((TEXT + " ") * 5)[:tokens])  # a character a token
        page.click("#tab-attention")
        page.wait_for_function(f"document.getElementById('heatmap').dataset.drawn === '{tokens}'")
        assert page.eval_on_selector("#heatmap", "el => el.dataset.labelEvery") == every
        assert min(ink(page)) > 0
