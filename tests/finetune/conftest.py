"""The fine-tuning wing's fixtures: a byte-tokenizer base model with data prepared for it, one per test module that
asks (its tests train from it and never change it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import addition_rows, byte_model_dir, labelled_rows, preference_rows, reversal_rows, write_jsonl

from gptkit.cli import main


def _prepare(rows: Path, base: Path, out: Path) -> Path:
    assert main(["prepare", "--input", str(rows), "--tokenizer", str(base), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> tuple[Path, Path]:
    """(a byte-tokenizer base model, reversal conversations prepared with its tokenizer)."""
    root = tmp_path_factory.mktemp("sft")
    base = byte_model_dir(root / "base", dropout=0.1)
    return base, _prepare(write_jsonl(root / "chat.jsonl", reversal_rows(60)), base, root / "data")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> tuple[Path, Path]:
    """(a byte-tokenizer base model, addition prompts prepared with its tokenizer)."""
    root = tmp_path_factory.mktemp("rl")
    base = byte_model_dir(root / "base")
    return base, _prepare(write_jsonl(root / "prompts.jsonl", addition_rows(40)), base, root / "data")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(a byte-tokenizer base model, preference pairs and labelled texts prepared with its tokenizer)."""
    root = tmp_path_factory.mktemp("objectives")
    base = byte_model_dir(root / "base")
    pairs = _prepare(write_jsonl(root / "p.jsonl", preference_rows(40)), base, root / "pairs")
    texts = _prepare(write_jsonl(root / "t.jsonl", labelled_rows(80)), base, root / "texts")
    return base, pairs, texts
