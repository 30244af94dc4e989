"""Many adapters, one server: 8 clients spread over 4 LoRA adapters of one base against 8 clients on one merged
model, each `gptkit serve` timed the same way (same clients, prompts, seeds and token counts; the two servers'
runs interleaved round by round; the median of the rounds kept). Run through bench_serve.py --adapters N.

The adapters' server decodes every batch through the base's layers plus each row's own low-rank update
(gptkit.multi_lora); the merged server decodes one plain model, through the fused CPU step where it applies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from gptkit.adapters import adapters, add_lora, fingerprint
from gptkit.formats.lora import write_lora_dir
from gptkit.loading import load
from gptkit.native import library
from gptkit.weights import model_state

RANK = 8


def write_adapters(base_dir: Path, root: Path, count: int) -> list[Path]:
    """count LoRA directories over base_dir (rank 8 on every block layer, random non-zero updates)."""
    model, _ = load(base_dir)
    settings = {
        "base": str(base_dir.resolve()),
        "base_fingerprint": fingerprint(model_state(model)),
        "rank": RANK,
        "alpha": 16.0,
        "dropout": 0.0,
        "targets": "all",
        "base_precision": "float32",
    }
    add_lora(model, RANK, 16.0, 0.0, "all")
    dirs = []
    for i in range(count):
        torch.manual_seed(100 + i)
        with torch.no_grad():
            for adapter in adapters(model).values():
                adapter.lora_B.normal_(0, 0.02)
        dirs.append(write_lora_dir(model, root / f"adapter{i}", settings))
    return dirs


def compare(args: argparse.Namespace, build_model_dir, start_server, run_clients) -> None:  # noqa: ANN001
    """Print (or with --json, dump) tokens/s of the adapters' server and of the merged one, and their ratio."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base_dir = args.model_dir or build_model_dir(root, args.n_layer, args.n_embd, args.block_size)
        lora_dirs = write_adapters(base_dir, root, args.adapters)
        lora_flags = tuple(f for i, d in enumerate(lora_dirs) for f in ("--lora", f"adapter{i}={d}"))
        clients = max(args.concurrency)
        servers = {
            "adapters": start_server(base_dir, clients, args.threads, extra=lora_flags),
            "merged": start_server(lora_dirs[0], clients, args.threads),
        }
        rates: dict[str, list[float]] = {name: [] for name in servers}
        try:
            names = {
                "adapters": [f"adapter{i % args.adapters}" for i in range(clients)],
                "merged": [json.loads(_get(servers["merged"][1] + "/v1/models"))["data"][0]["id"]] * clients,
            }
            for name, (_, url) in servers.items():
                run_clients(url, names[name], 1, 1, 4)  # warm-up
            for _ in range(args.rounds):
                for name, (_, url) in servers.items():
                    seconds, _, tokens = run_clients(url, names[name], clients, args.requests, args.max_tokens)
                    rates[name].append(tokens / seconds)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=30)
    median = {name: statistics.median(values) for name, values in rates.items()}
    ratio = median["adapters"] / median["merged"]
    result = {
        "cpu": library.capability(),
        "clients": clients,
        "adapters": args.adapters,
        "tokens_per_s": median,
        "rounds": rates,
        "ratio": ratio,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"{result['cpu']}: {clients} clients, {args.requests} requests each of {args.max_tokens} tokens, median of "
        f"{args.rounds} interleaved rounds"
    )
    print(f"  {clients} clients over {args.adapters} adapters: {median['adapters']:.1f} tokens/s")
    print(f"  {clients} clients on one merged model: {median['merged']:.1f} tokens/s")
    print(f"  ratio: {ratio:.2f}x")


def _get(url: str) -> str:
    import httpx

    return httpx.get(url).text
