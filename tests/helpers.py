"""Helpers the tests share (import them as `from helpers import ...`): tiny configurations of every architecture
variant in docs/spec.md section 1, run-to-run tolerances, a char-level data directory. Fixtures: conftest.py files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

TINY = dict(vocab_size=50, block_size=16, n_layer=2, n_head=4, n_embd=32)

# One entry per variant worth telling apart; together they cover every value of every enum field.
VARIANTS: dict[str, dict] = {
    "gpt2": dict(TINY),
    "llama-gqa": dict(
        TINY,
        norm="rmsnorm",
        position="rope",
        activation="swiglu",
        n_kv_head=2,
        attn_bias=False,
        mlp_bias=False,
        norm_bias=False,
        tie_embeddings=False,
    ),
    "original-decoder": dict(TINY, norm_position="post", position="sinusoidal", activation="relu"),
    "gpt1-style": dict(TINY, norm_position="post", position="learned", activation="gelu"),
    "mqa-no-position": dict(TINY, n_kv_head=1, position="none"),
    "nanogpt-no-bias": dict(TINY, attn_bias=False, mlp_bias=False, norm_bias=False, activation="gelu"),
    "untied-head-bias": dict(TINY, tie_embeddings=False, lm_head_bias=True, ffn_hidden=40),
    "rmsnorm-post-rope": dict(TINY, norm="rmsnorm", norm_position="post", position="rope", rope_theta=500.0),
}

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "gptkit" / "corpora" / "tinyshakespeare.txt"


def same_run(device: torch.device) -> dict[str, float]:
    """assert_close tolerances for two runs of one computation: bit for bit on the CPU; on a GPU, whose attention
    backward adds its partial sums in no fixed order, within float32 rounding."""
    return dict(atol=0.0, rtol=0.0) if device.type == "cpu" else dict(atol=1e-6, rtol=1e-5)


def write_char_data_dir(path: Path, characters: int) -> Path:
    """A char-level data directory (90/10 split) from the first `characters` characters of the bundled corpus."""
    from gptkit.tokenizer import CharTokenizer

    text = CORPUS.read_text()[:characters]
    tokenizer = CharTokenizer.train([text])
    ids = np.asarray(tokenizer.encode(text), dtype=np.uint16)
    split = int(0.9 * len(ids))
    ids[:split].tofile(path / "train.bin")
    ids[split:].tofile(path / "val.bin")
    tokenizer.save(path)
    meta = {
        "vocab_size": tokenizer.vocab_size,
        "dtype": "uint16",
        "train_tokens": split,
        "val_tokens": len(ids) - split,
        "tokenizer": "char",
    }
    (path / "meta.json").write_text(json.dumps(meta))
    return path
