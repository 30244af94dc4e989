"""A sliding-window model's KV cache at 8,192 tokens: `gptkit info`'s figure, the bytes the cache's tensors hold and the
resident memory the process grew by, beside the same model with full attention in every layer.

Each model keeps what a preset's KV cache depends on (its layers, key/value heads, head_dim, window and which layers
are windowed) with the width, the feed-forward, the vocabulary and the query heads (one per key/value head) shrunk so
that 8,192 tokens run on a CPU in minutes: the cache depends on none of them (grouped-query attention's query heads
read the same keys and values). The tokens go through the code the batch engine (the server, `gptkit generate`) runs:
prefill_chunks (64-token forwards) for all but the last DECODE_STEPS tokens, then decode_one_token one at a time.

Every measurement runs in a fresh process, with PyTorch's products (GPTKIT_CPU_KERNELS=0): resident memory (VmRSS)
is read after the model is built and warmed up, before the cache exists, and again after the 8,192 tokens. What the
allocator keeps of the forwards' temporaries, or reuses of the warm-up's, shows up as the difference between the
growth and the cache's bytes (the margin column).

    python benchmarks/bench_kv_memory.py                      # gemma3-1b's and mistral-7b's attention
    python benchmarks/bench_kv_memory.py --presets gemma3-1b --kv float32 int8 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from gptkit.cli.info import LONG_CONTEXT, describe
from gptkit.config import ModelConfig
from gptkit.decoding.step import decode_one_token, inference, new_cache, prefill_chunks
from gptkit.model import GPT
from gptkit.native import library

DECODE_STEPS = 64  # the last tokens go one at a time, as generation writes them
SHRUNK = dict(n_embd=64, ffn_hidden=128, vocab_size=256)  # what the KV cache does not depend on
# A KV setting: the model's dtype and what its cache stores (None: the model's dtype); named as `gptkit info` names them.
KV_SETTINGS = {
    "float32": (torch.float32, None),
    "bfloat16": (torch.bfloat16, None),
    "int8": (torch.float32, torch.int8),
}
ATTENTIONS = ("windowed", "full")
# PyTorch's products only: gptkit's kernels, built (or awaited from another process) and timed once in a background
# thread, would land in the measured memory. The cache and the model calls are the same either way.
KERNELS_OFF = ("GPTKIT_CPU_KERNELS", "0")


def attention_shape(preset: str, attention: str = "windowed", layers: int | None = None) -> ModelConfig:
    """preset's KV-cache shape with SHRUNK's width, feed-forward and vocabulary and one query head per kv head;
    attention "full": no layer windowed; layers: only the first that many (each layer's cache is its own)."""
    config = ModelConfig.load(preset)
    if layers is not None:
        if not 1 <= layers <= config.n_layer:
            raise SystemExit(f"bench_kv_memory: --layers must be 1 to {preset}'s {config.n_layer}, got {layers}")
        types = config.layer_types[:layers] if config.layer_types is not None else None
        config = dataclasses.replace(config, n_layer=layers, layer_types=types)
    if config.sliding_window is None:
        raise SystemExit(f"bench_kv_memory: {preset} has no sliding window; choose a windowed preset")
    if config.position == "learned" and config.block_size < LONG_CONTEXT:
        raise SystemExit(f"bench_kv_memory: {preset} has {config.block_size} learned positions, fewer than 8,192")
    config = dataclasses.replace(config, n_head=config.n_kv_head, **SHRUNK)
    if attention == "full":
        config = dataclasses.replace(config, sliding_window=None, layer_types=None, rope_local_theta=None)
    return config


def info_kv_bytes(config: ModelConfig, kv: str) -> int:
    """`gptkit info CONFIG.json`'s KV cache bytes at 8,192 tokens (batch 1) for config, under kv's name."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(config.to_dict()))
        return describe(str(path))[f"kv_cache_bytes_at_{LONG_CONTEXT}_tokens"][kv]


def resident_bytes() -> int:
    """This process's resident memory now (VmRSS of /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("bench_kv_memory: no VmRSS in /proc/self/status (resident memory is read on Linux only)")


def measure(config: ModelConfig, kv: str, decode_steps: int = DECODE_STEPS) -> dict[str, Any]:
    """Run 8,192 tokens through a cache for a random model of config; info's bytes, the cache's and the RSS growth."""
    dtype, kv_dtype = KV_SETTINGS[kv]
    library.prepare()  # a first product would otherwise build or time gptkit's kernels during the measurement
    torch.manual_seed(0)
    model = GPT(config).to(dtype).eval()
    tokens = torch.randint(config.vocab_size, (LONG_CONTEXT,)).tolist()
    with inference(model):
        # One short pass first: the kernels' and threads' one-off buffers are not the cache's.
        prefill_chunks(model, new_cache(model, 1, 128, kv_dtype), 0, tokens[:128])
        before = resident_bytes()
        cache = new_cache(model, 1, LONG_CONTEXT, kv_dtype)
        prompt = LONG_CONTEXT - decode_steps
        prefill_chunks(model, cache, 0, tokens[:prompt])
        for position in range(prompt, LONG_CONTEXT):
            decode_one_token(model, torch.tensor([[tokens[position]]]), cache, position)
        after = resident_bytes()
    return {
        "info_bytes": info_kv_bytes(config, kv),
        "cache_bytes": cache.nbytes,
        "rss_growth_bytes": after - before,
        "windowed_layers": sum(w is not None for w in cache.windows),
        "layers": config.n_layer,
    }


def measure_in_child(preset: str, attention: str, kv: str, layers: int | None) -> dict[str, Any]:
    """measure() in a fresh process, so that no earlier measurement's freed memory hides this one's growth."""
    command = [sys.executable, __file__, "--child", preset, attention, kv]
    command += ["--layers", str(layers)] if layers is not None else []
    result = subprocess.run(command, capture_output=True, text=True, env=os.environ | {KERNELS_OFF[0]: KERNELS_OFF[1]})
    if result.returncode != 0:
        raise SystemExit(f"bench_kv_memory: {preset} {attention} {kv} failed:\n{result.stderr}")
    return json.loads(result.stdout)


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def print_table(report: dict[str, Any]) -> None:
    """The rows as a table, then windowed against full per preset and KV setting."""
    print(f"cpu: {report['cpu']}")
    print(f"model: {report['model']}")
    header = ("preset", "attention", "kv", "info at 8k MiB", "cache MiB", "RSS growth MiB", "margin MiB")
    print(" | ".join(header))
    rows = report["rows"]
    for row in rows:
        margin = row["rss_growth_bytes"] - row["cache_bytes"]
        cells = (row["preset"], row["attention"], row["kv"], mib(row["info_bytes"]), mib(row["cache_bytes"]))
        print(" | ".join((*cells, mib(row["rss_growth_bytes"]), mib(margin))))
    for row in rows:
        if row["attention"] != "windowed":
            continue
        full = next(
            (r for r in rows if r["attention"] == "full" and (r["preset"], r["kv"]) == (row["preset"], row["kv"])), None
        )
        if full is not None:
            print(
                f"{row['preset']} {row['kv']}: windowed holds {row['cache_bytes'] / full['cache_bytes']:.3f} of full "
                f"attention's cache; RSS grew {row['rss_growth_bytes'] / full['rss_growth_bytes']:.3f} as much"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["gemma3-1b", "mistral-7b"], help="windowed presets")
    parser.add_argument("--kv", nargs="+", default=list(KV_SETTINGS), choices=list(KV_SETTINGS), help="KV settings")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        metavar="N",
        help="keep each preset's first N layers (default: all) for a quicker run; each layer's cache is its own",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--child", nargs=3, metavar=("PRESET", "ATTENTION", "KV"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        preset, attention, kv = args.child
        print(json.dumps(measure(attention_shape(preset, attention, args.layers), kv)))
        return 0
    for preset in args.presets:
        attention_shape(preset, layers=args.layers)  # a preset without a window stops here, before any measurement
    rows = []
    for preset in args.presets:
        for kv in args.kv:
            for attention in ATTENTIONS:
                rows.append(
                    {"preset": preset, "attention": attention, "kv": kv}
                    | measure_in_child(preset, attention, kv, args.layers)
                )
                if not args.json:
                    print(f"measured {preset} {attention} {kv}", file=sys.stderr, flush=True)
    model = (
        f"each preset's {f'first {args.layers} ' if args.layers else ''}layers, kv heads, head_dim, window and windowed layers; width {SHRUNK['n_embd']}, ffn "
        f"{SHRUNK['ffn_hidden']}, vocabulary {SHRUNK['vocab_size']} and one query head per kv head (the KV cache "
        f"depends on none of them); {LONG_CONTEXT} tokens, batch 1, the last {DECODE_STEPS} decoded one at a time"
    )
    report = {"cpu": library.capability(), "model": model, "tokens": LONG_CONTEXT, "rows": rows}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
