"""Helpers the tests share (import them as `from helpers import ...`): tiny configurations of every architecture
variant in docs/spec.md section 1, run-to-run tolerances, a char-level data directory, a random byte-tokenizer model
directory and the JSONL rows the fine-tuning tests prepare. Fixtures: conftest.py files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from gptkit.config import ModelConfig
from gptkit.decoding import fused
from gptkit.decoding.api import generate_ids
from gptkit.formats.modeldir import save_model_dir
from gptkit.kv_cache import KVCache
from gptkit.model import GPT
from gptkit.native import library
from gptkit.tokenizer import CharTokenizer

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


def write_jsonl(path: Path, rows: list) -> Path:
    """One row a line: a dict as JSON, a string as written (a malformed row stays malformed)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def byte_model_dir(path: Path, **config) -> Path:
    """A random tiny model with the byte tokenizer (and the default chat template)."""
    from gptkit.config import ModelConfig
    from gptkit.formats.modeldir import save_model_dir
    from gptkit.model import GPT
    from gptkit.tokenizer import ByteTokenizer

    torch.manual_seed(0)
    fields = dict(vocab_size=257, block_size=64, n_layer=2, n_head=4, n_embd=32) | config
    return save_model_dir(GPT(ModelConfig(**fields)), path, tokenizer=ByteTokenizer())


WORDS = ["apple", "river", "stone", "cloud", "night", "sword", "crown", "ghost", "honey", "lemon", "tiger", "music"]
FRUIT = {"apple", "lemon", "honey"}


def reversal_rows(count: int, seed: int = 0) -> list[dict]:
    """Conversations asking for a word reversed, answered."""
    rng = np.random.default_rng(seed)
    words = [WORDS[i] for i in rng.integers(0, len(WORDS), count)]
    return [
        {"messages": [{"role": "user", "content": f"Reverse: {w}"}, {"role": "assistant", "content": w[::-1]}]}
        for w in words
    ]


def addition_rows(count: int, seed: int = 0) -> list[dict]:
    """Prompts of two one-digit numbers to add, with their answers (the RL tests' verifiable task)."""
    generator = torch.Generator().manual_seed(seed)
    pairs = torch.randint(0, 10, (count, 2), generator=generator).tolist()
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b), "id": i} for i, (a, b) in enumerate(pairs)]


def preference_rows(count: int, seed: int = 0) -> list[dict]:
    """Pairs whose chosen reply ends with a full stop and whose rejected one does not."""
    rng = np.random.default_rng(seed)
    rows = []
    for w in (WORDS[i] for i in rng.integers(0, len(WORDS), count)):
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"Say {w}"}],
                "chosen": [{"role": "assistant", "content": f"{w}."}],
                "rejected": [{"role": "assistant", "content": w}],
            }
        )
    return rows


def labelled_rows(count: int, seed: int = 0) -> list[dict]:
    """Texts labelled fruit or other by their word."""
    rng = np.random.default_rng(seed)
    words = [WORDS[i] for i in rng.integers(0, len(WORDS), count)]
    return [
        {"text": f"a {w} {'x' * int(rng.integers(0, 6))}", "label": "fruit" if w in FRUIT else "other"} for w in words
    ]


def greedy_with_and_without_fused_step(
    model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, monkeypatch
) -> dict[bool, list[list[int]]]:
    """Each prompt's greedy ids with the fused decode step chosen (True) and not (False); asserts that the fused step
    ran exactly when chosen, so that equal runs are not the eager step compared with itself."""
    runs = {}
    for chosen in (False, True):
        monkeypatch.setitem(library.STATE, "choices", dict(library.choices(), fused_step=chosen))
        calls = []
        real = fused.step_for

        def spy(model, real=real, calls=calls):
            step = real(model)
            return None if step is None else (lambda *args: calls.append(1) or step(*args))

        monkeypatch.setattr(fused, "step_for", spy)
        runs[chosen] = [generate_ids(model, p, max_new_tokens=new_tokens, temperature=0) for p in prompts]
        assert bool(calls) == chosen  # the fused step ran exactly when chosen
        monkeypatch.setattr(fused, "step_for", real)
    return runs


def confident_char_model_dir(directory: Path, block_size: int) -> Path:
    """A saved random RoPE model over lower-case characters, digits and punctuation whose greedy picks are clear-cut
    (weights of std 0.5: top-2 logit gaps far above float rounding), for comparing decodes token for token."""
    tokenizer = CharTokenizer.train(["abcdefghijklmnopqrstuvwxyz 0123456789,.:\n"], specials=["<|endoftext|>"])
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size, block_size=block_size, n_layer=2, n_head=4, n_embd=32, position="rope"
    )
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5)
    return save_model_dir(model, directory, tokenizer=tokenizer)


def sharpened(config: ModelConfig, scale: float = 20.0) -> GPT:
    """A random model whose logits are scaled up, so that greedy choices are far from float ties."""
    torch.manual_seed(0)
    model = GPT(config).eval()
    with torch.no_grad():
        model.norm_f.weight.mul_(scale)
    return model


def filled_cache(model: GPT, stored: torch.dtype, rows: int = 2) -> KVCache:
    """`rows` rows of `stored` values whose every position holds random keys and values (an int8 cache: random codes
    and scales)."""
    kv_dtype = torch.int8 if stored == torch.int8 else None
    cache = KVCache(
        model.config, rows, model.config.block_size, dtype=torch.float32 if kv_dtype else stored, kv_dtype=kv_dtype
    )
    g = torch.Generator().manual_seed(1)
    for t in cache.tensors:
        if t.dtype == torch.int8:
            t.copy_(torch.randint(-127, 128, t.shape, generator=g, dtype=torch.int8))
        elif t.dim() == 3:  # an int8 cache's scales, (rows, heads, positions)
            t.copy_(0.001 + 0.02 * torch.rand(t.shape, generator=g))
        else:
            t.copy_(2.0 * torch.randn(t.shape, generator=g))
    return cache


def product_inputs(
    rows: int, k: int, n: int, dtype: torch.dtype = torch.float32, bias: bool = True, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A product's operands from one seed: activations x (rows, k), weights w (n, k), a bias (n,) or None."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b
