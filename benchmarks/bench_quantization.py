"""What quantisation costs in loss: `gptkit eval` of models at fp32, int8 and int4 weights and with an int8 KV cache.

For each model directory (any format gptkit loads) and one text to score (--data: a prepared data directory's
val.bin, or --input: a text file), it prints the loss, the perplexity and the change from fp32 of:
  fp32        the model as saved (float32);
  int8        --quantize int8 (a byte a weight, a scale per output channel);
  int4        --quantize int4 (llama.cpp's Q4_0 blocks);
  kv int8     an int8 KV cache (each window fed through it 64 tokens at a time, as decoding reads it);
  int4 + kv   both.
Windows are the model's whole context with --stride its length (no overlap) by default, so that the cache holds up
to a full context of keys: the long-context case a quantised cache is for.

    python benchmarks/bench_quantization.py RUN/checkpoints/step-002000 --data data/shakespeare_char
    python benchmarks/bench_quantization.py MODEL_A MODEL_B --input text.txt --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from gptkit.data import load_tokens, read_meta
from gptkit.evaluate import encode_text, evaluate_ids
from gptkit.loading import load
from gptkit.native import library
from gptkit.quantization import quantize

SETTINGS = {
    "fp32": (None, None),
    "int8": ("int8", None),
    "int4": ("int4", None),
    "kv int8": (None, "int8"),
    "int4 + kv int8": ("int4", "int8"),
}


def tokens_of(args: argparse.Namespace, tokenizer) -> tuple[np.ndarray, np.ndarray | None, str]:
    """The ids to score, the byte length of each token id (for bits per byte), and what they are."""
    if args.data:
        meta = read_meta(args.data)
        ids = load_tokens(Path(args.data) / "val.bin", meta.dtype)
        return ids, tokenizer.token_byte_lengths() if tokenizer is not None else None, f"{args.data}/val.bin"
    text = Path(args.input).read_bytes().decode("utf-8")
    return encode_text(tokenizer, text), tokenizer.token_byte_lengths(), args.input


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="+", metavar="MODEL", help="model directories (or .gguf files)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="a prepared data directory: scores its val.bin")
    source.add_argument("--input", help="a UTF-8 text file")
    parser.add_argument("--stride", type=int, default=None, help="tokens between windows (default: the context)")
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    library.prepare()
    report = {"cpu": library.capability(), "models": {}}
    for path in args.models:
        model, tokenizer = load(path)
        ids, lengths, what = tokens_of(args, tokenizer)
        ids = ids[: args.max_tokens] if args.max_tokens else ids
        context = model.config.block_size
        rows = {}
        for name, (method, kv_cache) in SETTINGS.items():
            print(f"{path}: {name} ...", file=sys.stderr, flush=True)
            scored, _ = load(path)
            if method is not None:
                quantize(scored, method)
            with torch.no_grad():
                result = evaluate_ids(scored, ids, lengths, args.stride or context, 8, kv_cache=kv_cache)
            rows[name] = result.to_dict()
        for row in rows.values():
            row["loss_change"] = row["loss"] / rows["fp32"]["loss"] - 1
            row["perplexity_change"] = row["perplexity"] / rows["fp32"]["perplexity"] - 1
        report["models"][path] = {"scored": what, "tokens": rows["fp32"]["tokens"], "context": context, "rows": rows}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"cpu: {report['cpu']}")
    for path, entry in report["models"].items():
        print(f"{path}: {entry['tokens']:,} tokens of {entry['scored']}, context {entry['context']}")
        print(f"  {'setting':16} {'loss':>8} {'perplexity':>11} {'ppl change':>10}")
        for name, row in entry["rows"].items():
            print(f"  {name:16} {row['loss']:8.4f} {row['perplexity']:11.3f} {100 * row['perplexity_change']:+9.2f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
