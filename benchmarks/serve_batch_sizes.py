"""`gptkit serve --max-batch-size` swept: tokens/s of the same clients against one server per setting, so that the
default is chosen by measurement. Run through bench_serve.py --max-batch-sizes 8,16,32.

Only one server runs at a time: each round starts a server at each setting in turn, warms it up, runs every
concurrency against it and stops it; the median of the rounds is kept. The clients, prompts, seeds and token counts
are bench_serve.py's, the same for every setting. Each setting's KV cache is printed beside it: the server holds
max-batch-size rows of the model's block_size positions (gptkit.serving.engine), whether clients fill them or not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import httpx
from serve_process import start_server

from gptkit.accounting import kv_cache_bytes
from gptkit.config import ModelConfig
from gptkit.native import library


def batch_sizes(text: str) -> list[int]:
    """--max-batch-sizes' comma-separated list (8,16,32) as ints, each at least 1."""
    parts = text.split(",")
    if not all(part.strip().isdigit() and int(part) >= 1 for part in parts):
        raise SystemExit(f"bench_serve: --max-batch-sizes takes sizes >= 1 separated by commas (8,16,32), got {text!r}")
    return [int(part) for part in parts]


def row_bytes(model_dir: Path) -> tuple[int, int]:
    """(block_size, KV cache bytes of one batch row at block_size positions in float32, the model's dtype here)."""
    config = ModelConfig.load(model_dir)
    return config.block_size, kv_cache_bytes(config, 1, config.block_size, "float32")


def one_round(args: argparse.Namespace, model_dir: Path, run_clients, rates: dict[int, dict[int, list[float]]]) -> None:  # noqa: ANN001
    """One server per batch size in turn, each run at every concurrency; tokens/s appended to rates[size][clients]."""
    for size in args.max_batch_sizes:
        proc, url = start_server(model_dir, size, args.threads, args.compile)
        try:
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            run_clients(url, model, 1, 1, 4)  # warm-up
            for clients in args.concurrency:
                seconds, _, tokens = run_clients(url, model, clients, args.requests, args.max_tokens)
                rates[size][clients].append(tokens / seconds)
                if not args.json:
                    print(f"  max batch {size:>3}, {clients:>3} clients: {tokens / seconds:.1f} tokens/s", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def sweep(args: argparse.Namespace, build_model_dir, run_clients) -> None:  # noqa: ANN001
    """Print (or with --json, dump) the median tokens/s of each max batch size at each concurrency."""
    rates: dict[int, dict[int, list[float]]] = {s: {c: [] for c in args.concurrency} for s in args.max_batch_sizes}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or build_model_dir(Path(tmp), args.n_layer, args.n_embd, args.block_size)
        block_size, per_row = row_bytes(model_dir)
        for round_index in range(args.rounds):
            if not args.json:
                print(f"round {round_index + 1} of {args.rounds}", flush=True)
            one_round(args, model_dir, run_clients, rates)
    median = {s: {c: statistics.median(r) for c, r in by_clients.items()} for s, by_clients in rates.items()}
    result: dict[str, Any] = {
        "cpu": library.capability(),
        "model": str(args.model_dir) if args.model_dir else f"random, {args.n_layer} layers x {args.n_embd} wide",
        "block_size": block_size,
        "kv_bytes_per_row": per_row,
        "requests_per_client": args.requests,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "rounds_run": args.rounds,
        "tokens_per_s": median,
        "rounds": rates,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print_table(result, args.concurrency)


def print_table(result: dict[str, Any], concurrency: list[int]) -> None:
    """One line per max batch size: its KV cache and the median tokens/s at each concurrency."""
    print(f"cpu: {result['cpu']}")
    print(
        f"model: {result['model']}; {result['requests_per_client']} requests per client of {result['max_tokens']} "
        f"tokens; KV cache per batch row at block_size {result['block_size']}: "
        f"{result['kv_bytes_per_row'] / 2**20:.1f} MiB (float32); median of {result['rounds_run']} round(s)"
    )
    print(f"{'max batch':>9} {'KV cache MiB':>13} " + " ".join(f"{f'{c} clients':>12}" for c in concurrency))
    for size, by_clients in result["tokens_per_s"].items():
        cells = " ".join(f"{by_clients[c]:>12.1f}" for c in concurrency)
        print(f"{size:>9} {size * result['kv_bytes_per_row'] / 2**20:>13.1f} {cells}")
    print("(tokens/s of all clients together)")
