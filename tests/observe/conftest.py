"""The observing wing's fixtures: one Chromium per test module that drives the live page (it skips where Debian's
Chromium or Playwright is missing)."""

from __future__ import annotations

import pytest

from tests.serving.test_serve_playground import CHROMIUM, CHROMIUM_FLAGS, _need_browser


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium, closed after the module's tests."""
    with _need_browser()() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()
