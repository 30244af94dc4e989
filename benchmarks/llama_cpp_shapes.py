"""The decode table against llama.cpp for today's model shapes (issue 54 item 7, issue 55 item 5), a part of
bench_generate.py (`--shapes llama3.2-1b,gemma3-1b,qwen3-moe --llama-cpp DIR`).

Each shape is built directly as a gptkit model with random weights (no transformers model: at a billion parameters
that would take minutes and twice the memory) and written as GGUF by gptkit's own writer: bf16 beside gptkit's bf16,
q8_0 from gptkit's int8 model, q4_0 from gptkit's int4 (its very bits). Per round and format, gptkit decodes
--new-tokens greedy tokens at batch 1 after a --decode-prompt-len prompt and llama-bench runs its tg test (`-p 0 -n
NEW_TOKENS -r 1`), the rounds interleaved; each side's best round counts. Each side's rate is its own clock (gptkit's
Timing.decode_seconds, llama-bench's samples_ts). The bound is the rate at which the active weights (what one token's
step reads: every matmul weight, only the routed experts' share of an expert tensor) stream at the measured read
bandwidth; each side's share of it uses its own bytes (gptkit's experts may stay in a wider type than q8_0's).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from gptkit.config import ModelConfig
from gptkit.decoding.api import complete
from gptkit.decoding.sampling import SamplingParams
from gptkit.decoding.weight_bytes import step_weight_bytes
from gptkit.errors import ConfigError
from gptkit.model import GPT
from gptkit.presets import PRESETS
from gptkit.quantization import quantize

# A Qwen3-MoE-shaped model that fits 2 cores and 24 GiB (issue 55): Qwen3-30B-A3B's layer (q/k norms, top-8
# renormalised, SwiGLU experts) at 16 layers, 1024 wide, 64 experts of hidden 256, heads of 64 (16 query, 4 kv).
QWEN3_MOE = dict(
    PRESETS["qwen3-30b-a3b"],
    vocab_size=32000,
    block_size=4096,
    n_layer=16,
    n_head=16,
    n_kv_head=4,
    n_embd=1024,
    head_dim=64,
    n_experts=64,
    moe_ffn_hidden=256,
)
SHAPES = {"llama3.2-1b": PRESETS["llama3.2-1b"], "gemma3-1b": PRESETS["gemma3-1b"], "qwen3-moe": QWEN3_MOE}
FORMATS = {"bf16": "bf16", "int8": "q8_0", "int4": "q4_0"}  # gptkit's format -> the GGUF type llama.cpp runs


def shape_config(name: str, tiny: bool) -> ModelConfig:
    """The shape's config; tiny: the same switches at a smoke run's size (2 layers, 64 wide, vocab 1000)."""
    fields = dict(SHAPES[name])
    if tiny:
        layers = 6 if fields.get("layer_types") else 2  # gemma's 5 local to 1 global kept whole
        fields |= dict(n_layer=layers, n_embd=64, n_head=4, head_dim=16, ffn_hidden=128, vocab_size=1000)
        fields |= dict(block_size=256, n_kv_head=min(fields.get("n_kv_head") or 4, 2))
        if fields.get("layer_types"):
            fields["layer_types"] = fields["layer_types"][:layers]
        if fields.get("n_experts"):
            fields |= dict(n_experts=8, moe_ffn_hidden=32, n_experts_per_token=2)
        if fields.get("embedding_scale"):
            fields["embedding_scale"] = 8.0  # sqrt(64), as the preset's is sqrt of its width
        if fields.get("attn_scale"):
            fields["attn_scale"] = 16**-0.5  # Gemma 3's 1/sqrt(head_dim) at the tiny heads of 16
    return ModelConfig(**fields)


def formats_of(config: ModelConfig, wanted: list[str]) -> tuple[dict[str, GPT], dict[str, str]]:
    """gptkit's models of one set of random weights (seeded) in each wanted format (bf16, and int8 and int4 over fp32
    activations), and the formats gptkit cannot quantise this model to, with quantize's reason: those keep the fp32
    model, from which the GGUF writer makes llama.cpp's q8_0 or q4_0 alone."""
    torch.manual_seed(0)
    fp32 = GPT(config).eval()
    models, refused = {}, {}
    if "bf16" in wanted:
        models["bf16"] = copy.deepcopy(fp32).to(torch.bfloat16)
    for method in ("int8", "int4"):
        if method in wanted:
            try:
                models[method] = quantize(copy.deepcopy(fp32), method)
            except ConfigError as refusal:  # a model quantize() refuses (none of these shapes today)
                models[method], refused[method] = fp32, str(refusal)
    return models, refused


def vocabulary_of(size: int) -> Any:
    """A byte-level BPE tokenizer of exactly `size` tokens (the 256 bytes, merges of byte pairs, then of a pair and a
    byte, <|endoftext|> last): GGUF needs one token per embedding, and these random models have any vocabulary
    size, Gemma 3's 262,144 among them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from gptkit.tokenizer import BYTE_LEVEL_SYMBOLS, EOT, BPETokenizer

    symbols = [BYTE_LEVEL_SYMBOLS[b] for b in range(256)]
    pairs = [(a, b) for a in symbols for b in symbols]
    triples = ((a + b, c) for a, b in pairs for c in symbols)  # made only as far as the size needs
    merges = list(itertools.islice(itertools.chain(pairs, triples), size - 257))
    vocab = {s: i for i, s in enumerate(symbols + [a + b for a, b in merges])}
    hf = Tokenizer(models.BPE(vocab, merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([EOT])
    return BPETokenizer(hf)


def write_gguf(model: GPT, path: Path, kind: str) -> Path:
    """model's weights as a GGUF file of tensor type kind, by gptkit's own writer (`gptkit convert --to-gguf`)."""
    from gptkit.formats.gguf import export_gguf

    return export_gguf(model, path, vocabulary_of(model.config.vocab_size), file_type=kind)


def gguf_active_bytes(path: Path, config: ModelConfig) -> int:
    """step_weight_bytes' count for a GGUF file: every matrix but the embedding (unless it is also the output), and of
    each expert tensor (the 3-D ones, one matrix per expert) the routed share."""
    from gptkit.formats.gguf import open_gguf

    tensors = {t.name: (int(t.n_bytes), len(t.shape)) for t in open_gguf(path).tensors if len(t.shape) > 1}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight")
    experts = config.n_experts or 1
    return sum(size * config.n_experts_per_token // experts if dims == 3 else size for size, dims in tensors.values())


def gptkit_decode_rate(model: GPT, prompt: list[int], new_tokens: int) -> float:
    """Batch-1 greedy decode tokens/s by gptkit's own clock (the default decoding path, the prefill not counted)."""
    done = complete(model, [prompt], SamplingParams(max_new_tokens=new_tokens, temperature=0))
    return done.timing.decode_tokens / done.timing.decode_seconds


def llama_cpp_decode_rate(binary: Path, gguf: Path, new_tokens: int, threads: int) -> float:
    """llama-bench's tg test (decode from an empty context, one repetition after its warm-up): tokens/s."""
    command = [str(binary), "-m", str(gguf), "-p", "0", "-n", str(new_tokens), "-t", str(threads), "-r", "1"]
    out = subprocess.run([*command, "-o", "json"], capture_output=True, text=True, check=True).stdout
    return max(json.loads(out)[0]["samples_ts"])


def compare_shape(name: str, args: argparse.Namespace, bandwidth: float, tmp: Path) -> list[dict[str, Any]]:
    """One row per format of the shape: gptkit's and llama.cpp's best decode rates, their ratio, and each side's
    share of its active-bytes bound."""
    config = shape_config(name, args.tiny_shapes)
    models, refused = formats_of(config, args.dtypes + args.quantized)
    ggufs = {}
    if args.llama_cpp:
        ggufs = {
            label: write_gguf(model, tmp / f"{name}-{label}.gguf", FORMATS[label]) for label, model in models.items()
        }
    prompt = torch.randint(0, config.vocab_size, (args.decode_prompt_len,), generator=torch.Generator().manual_seed(1))
    best: dict[tuple[str, str], float] = {}
    for round_index in range(args.rounds):
        print(f"[{name}] round {round_index + 1} of {args.rounds}", flush=True, file=sys.stderr)
        for label, model in models.items():
            if label not in refused:
                rate = gptkit_decode_rate(model, prompt.tolist(), args.new_tokens)
                best[("gptkit", label)] = max(best.get(("gptkit", label), 0.0), rate)
            if label in ggufs:
                binary = Path(args.llama_cpp) / "llama-bench"
                rate = llama_cpp_decode_rate(binary, ggufs[label], args.new_tokens, torch.get_num_threads())
                best[("llama.cpp", label)] = max(best.get(("llama.cpp", label), 0.0), rate)
    rows = []
    for label, model in models.items():
        row: dict[str, Any] = dict(shape=name, format=label, gguf=FORMATS[label])
        if label in refused:
            row["gptkit_refused"] = refused[label]
        else:
            ours, rate = step_weight_bytes(model), best[("gptkit", label)]
            row |= dict(gptkit=rate, active_bytes=ours, bound=bandwidth / ours, gptkit_share=rate * ours / bandwidth)
        if label in ggufs:
            theirs, rate = gguf_active_bytes(ggufs[label], config), best[("llama.cpp", label)]
            row |= dict(llama_cpp=rate, llama_cpp_active_bytes=theirs, llama_cpp_bound=bandwidth / theirs)
            row["llama_cpp_share"] = rate * theirs / bandwidth
            if "gptkit" in row:
                row["vs_llama_cpp"] = row["gptkit"] / rate
        rows.append(row)
    return rows


def print_rows(rows: list[dict[str, Any]], bandwidth: float) -> None:
    """The decode table: one line per shape and format, with its ratio and each side's share of its bound (gptkit's
    bound and active bytes where it runs the format, else llama.cpp's)."""
    print(f"batch-1 decode against llama.cpp's tg (tokens/s; bound: active weight bytes at {bandwidth / 1e9:.1f} GB/s)")
    print(
        f"{'shape':12} {'format':6} {'gguf':5} {'gptkit':>8} {'llama.cpp':>9} {'ratio':>6} {'bound':>7} "
        f"{'gptkit%':>7} {'llama%':>6} {'active MB':>9}"
    )
    for r in rows:
        cell = lambda key, spec: format(r[key], spec) if key in r else "-"  # noqa: E731
        bound = r.get("bound", r.get("llama_cpp_bound", 0.0))
        active = r.get("active_bytes", r.get("llama_cpp_active_bytes", 0))
        print(
            f"{r['shape']:12} {r['format']:6} {r['gguf']:5} {cell('gptkit', '.1f'):>8} {cell('llama_cpp', '.1f'):>9} "
            f"{cell('vs_llama_cpp', '.2f'):>6} {bound:7.1f} {cell('gptkit_share', '.0%'):>7} "
            f"{cell('llama_cpp_share', '.0%'):>6} {active / 1e6:9.1f}"
        )
    for r in rows:
        if "gptkit_refused" in r:
            print(f"{r['shape']} {r['format']}: gptkit: {r['gptkit_refused']}")
