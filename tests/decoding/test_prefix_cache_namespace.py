"""A prefix cache's namespace: it follows what decides a block's bits (the product kernels' choices) and nothing
that only decode steps use (the fused step's choices, timed when a batch first reaches their size)."""

from __future__ import annotations

import torch

from gptkit.decoding.prefix_cache import namespace_for
from gptkit.native import library


def _namespace(monkeypatch, chosen: dict[str, bool]) -> str:
    monkeypatch.setattr(library, "load", lambda wait=True: True)
    monkeypatch.setitem(library.STATE, "choices", chosen)
    return namespace_for("model", torch.float32)


def test_a_fused_step_choice_timed_later_keeps_the_namespace(monkeypatch):
    products = {"fp32": True, "bf16": True, "int8": False, "bf16_upcast": True}
    before = _namespace(monkeypatch, products)
    after = _namespace(monkeypatch, {**products, "fused_step": True, "fused_step_32_rows": False})
    assert after == before


def test_a_product_choice_changes_the_namespace(monkeypatch):
    products = {"fp32": True, "bf16": True, "int8": False, "bf16_upcast": True}
    assert _namespace(monkeypatch, products) != _namespace(monkeypatch, {**products, "fp32": False})
