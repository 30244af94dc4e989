"""Throughput of `gptkit serve` with 1, 4 and 8 concurrent clients: requests/s and generated tokens/s.

Starts `gptkit serve` in a subprocess on a free 127.0.0.1 port (a random model built here unless --model-dir is
given), sends a bounded number of completion requests per client, and prints one line per concurrency plus the
speed-up over one client. Only loopback is ever contacted.

    .venv/bin/python benchmarks/bench_serve.py                       # default: 4 layers x 256 wide, 4 req/client
    .venv/bin/python benchmarks/bench_serve.py --requests 2 --max-tokens 16 --n-layer 2 --n-embd 64   # smoke run
"""

from __future__ import annotations

import argparse
import json
import concurrent.futures
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def build_model_dir(path: Path, n_layer: int, n_embd: int, block_size: int) -> Path:
    """A random GPT-2-style model with a byte tokenizer (its speed, not its text, is what is measured)."""
    import torch

    from gptkit.config import ModelConfig
    from gptkit.model import GPT
    from gptkit.formats.modeldir import save_model_dir
    from gptkit.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer(specials=())  # no end-of-text token: every request generates max_tokens
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=tokenizer.vocab_size, block_size=block_size, n_layer=n_layer,
                         n_head=max(1, n_embd // 64), n_embd=n_embd)  # fmt: skip
    return save_model_dir(GPT(config), path / "bench-model", tokenizer=tokenizer)


def start_server(model_dir: Path, max_batch_size: int, threads: int | None,
                 compile: bool = False) -> tuple[subprocess.Popen, str]:  # fmt: skip
    """`gptkit serve` on 127.0.0.1 with a free port; returns the process and its base URL."""
    extra = (["--threads", str(threads)] if threads else []) + (["--compile"] if compile else [])
    proc = subprocess.Popen(
        [sys.executable, "-m", "gptkit", "serve", str(model_dir), "--port", "0", "--device", "cpu",
         "--max-batch-size", str(max_batch_size), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + (900 if compile else 120)  # compiling every batch shape comes before ready
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        match = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
        if match:
            return proc, match.group(1)
    proc.kill()
    raise SystemExit("bench_serve: the server did not start")


def run_clients(url: str, model: str, clients: int, requests: int, max_tokens: int) -> tuple[float, int, int]:
    """clients threads x requests sequential completions each; returns (seconds, requests, tokens)."""

    def client(index: int) -> int:
        tokens = 0
        with httpx.Client(base_url=url, timeout=300) as http:
            for j in range(requests):
                body = {"model": model, "prompt": f"Request {index}.{j}: once upon a time", "max_tokens": max_tokens,
                        "temperature": 1.0, "seed": index * 1000 + j}  # fmt: skip
                response = http.post("/v1/completions", json=body)
                response.raise_for_status()
                tokens += response.json()["usage"]["completion_tokens"]
        return tokens

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(client, range(clients)))
    return time.perf_counter() - start, clients * requests, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="serve this model instead of a random one")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--requests", type=int, default=4, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--threads", type=int, default=None, help="the server's --threads (default: the server's)")
    parser.add_argument("--compile", action="store_true", help="serve with --compile (compiled decode step)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    show = (lambda *a, **k: None) if args.json else print  # noqa: E731
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or build_model_dir(Path(tmp), args.n_layer, args.n_embd, args.block_size)
        proc, url = start_server(model_dir, max(args.concurrency), args.threads, args.compile)
        try:
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            run_clients(url, model, 1, 1, 4)  # warm-up
            show(f"model {model}; {args.requests} requests per client, {args.max_tokens} max tokens each, "
                  f"server threads: {args.threads or 'server default'}")
            show(f"{'clients':>8} {'requests/s':>11} {'tokens/s':>10} {'speed-up':>9}")
            base = None
            for clients in args.concurrency:
                seconds, requests, tokens = run_clients(url, model, clients, args.requests, args.max_tokens)
                rate = tokens / seconds
                base = base or rate
                show(f"{clients:>8} {requests / seconds:>11.2f} {rate:>10.1f} {rate / base:>8.2f}x", flush=True)
                rows.append({"clients": clients, "requests_per_s": requests / seconds, "tokens_per_s": rate,
                             "speedup": rate / base})  # fmt: skip
            if args.json:
                print(json.dumps({"model": model, "requests_per_client": args.requests,
                                  "max_tokens": args.max_tokens, "threads": args.threads, "rows": rows}, indent=2))
        finally:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
