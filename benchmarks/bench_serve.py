"""Throughput of `gptkit serve` with 1, 4 and 8 concurrent clients: requests/s and generated tokens/s.

Starts `gptkit serve` in a subprocess on a free 127.0.0.1 port (a random model built here unless --model-dir is
given), sends a bounded number of completion requests per client, and prints one line per concurrency plus the
speed-up over one client. Only loopback is ever contacted.

    .venv/bin/python benchmarks/bench_serve.py                       # default: 4 layers x 256 wide, 4 req/client
    .venv/bin/python benchmarks/bench_serve.py --requests 2 --max-tokens 16 --n-layer 2 --n-embd 64   # smoke run
    .venv/bin/python benchmarks/bench_serve.py --adversarial   # latency under half-open sockets and a bad template

--adversarial: the median latency of sequential completions, alone and again while 300 connections hold
half-sent request heads and a chat request whose template (the model's own, written here) loops is in flight.

--llama-server DIR: gptkit serve against llama.cpp's llama-server (DIR holds the binary: LLAMA_CPP/build/bin) on the
same weights (a random GPT-2-small-shaped model with a 4,096-token BPE trained on the bundled corpus, which gptkit
writes as GGUF), both at their best settings for this machine and again at their defaults; workloads in
benchmarks/serve_workloads.py:

    .venv/bin/python benchmarks/bench_serve.py --llama-server LLAMA_CPP/build/bin

--vllm PYTHON: gptkit serve against vLLM's CPU backend (PYTHON is the vLLM venv's, made by `make vllm`) on the same
model as --llama-server's, exported to HF, both at their defaults (benchmarks/serve_vllm.py):

    .venv/bin/python benchmarks/bench_serve.py --vllm .venv-vllm/bin/python --rounds 3

--busy N: N neighbour processes each keep a core busy (a Python loop) while the clients run, as other programs on
a shared machine do; the load average is printed with the figures:

    .venv/bin/python benchmarks/bench_serve.py --n-layer 12 --n-embd 768 --concurrency 1 --busy 2

--adapters N: 8 clients over N LoRA adapters of one base, served together, against 8 clients on one merged model
(benchmarks/serve_lora.py):

    .venv/bin/python benchmarks/bench_serve.py --adapters 4 --rounds 3

--max-batch-sizes 8,16,32: one server per `--max-batch-size` setting in turn, each run at every --concurrency, the
median tokens/s of --rounds interleaved rounds, and each setting's KV cache (benchmarks/serve_batch_sizes.py):

    .venv/bin/python benchmarks/bench_serve.py --max-batch-sizes 8,16,32 --concurrency 1 8 32 --rounds 3
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from serve_process import build_model_dir, start_server

# A chat template that renders normally, except for the message "loop", where it writes without end (the server
# stops it at its size or time limit).
LOOPING_TEMPLATE = (
    "{% if messages[-1]['content'] == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{{ j % 2 }}{% endfor %}{% endfor %}{% else %}{% for m in messages %}{{ m['role'] }}: "
    "{{ m['content'] }}\n{% endfor %}assistant:{% endif %}"
)


def latencies(url: str, model: str, count: int, max_tokens: int) -> list[float]:
    """Seconds each of count sequential greedy completions takes."""
    out = []
    with httpx.Client(base_url=url, timeout=300) as http:
        for i in range(count):
            started = time.perf_counter()
            body = {"model": model, "prompt": f"Latency probe {i}", "max_tokens": max_tokens, "temperature": 0}
            http.post("/v1/completions", json=body).raise_for_status()
            out.append(time.perf_counter() - started)
    return out


def adversarial(url: str, model: str, max_tokens: int, half_open: int = 300, probes: int = 8) -> dict[str, float]:
    """Median probe latency alone, then under half-open connections and a looping template in flight."""
    alone = statistics.median(latencies(url, model, probes, max_tokens))
    host, port = url.removeprefix("http://").split(":")
    sockets = []
    for _ in range(half_open):
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # the head never ends
        sockets.append(s)
    stop = threading.Event()

    def loop_requests() -> None:
        body = {"model": model, "messages": [{"role": "user", "content": "loop"}], "max_tokens": 1}
        while not stop.is_set():
            httpx.post(url + "/v1/chat/completions", json=body, timeout=60)  # answered 400 when the limit stops it

    looping = threading.Thread(target=loop_requests, daemon=True)
    looping.start()
    time.sleep(0.5)
    try:
        loaded = statistics.median(latencies(url, model, probes, max_tokens))
    finally:
        stop.set()
        for s in sockets:
            s.close()
    looping.join(timeout=30)
    return {"alone_s": alone, "loaded_s": loaded, "ratio": loaded / alone, "half_open": half_open}


def run_clients(
    url: str, model: str | list[str], clients: int, requests: int, max_tokens: int
) -> tuple[float, int, int]:
    """clients threads x requests sequential completions each (client i asks for model[i] when model is a list);
    returns (seconds, requests, tokens)."""

    def client(index: int) -> int:
        tokens = 0
        with httpx.Client(base_url=url, timeout=300) as http:
            for j in range(requests):
                body = {
                    "model": model[index] if isinstance(model, list) else model,
                    "prompt": f"Request {index}.{j}: once upon a time",
                    "max_tokens": max_tokens,
                    "temperature": 1.0,
                    "seed": index * 1000 + j,
                }
                response = http.post("/v1/completions", json=body)
                response.raise_for_status()
                tokens += response.json()["usage"]["completion_tokens"]
        return tokens

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(client, range(clients)))
    return time.perf_counter() - start, clients * requests, tokens


@contextlib.contextmanager
def busy_neighbours(count: int) -> Iterator[None]:
    """count processes, each spinning on a core, for the block's duration."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


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
    parser.add_argument(
        "--busy", type=int, default=0, metavar="N", help="N neighbour processes keep a core busy each while clients run"
    )
    parser.add_argument(
        "--adversarial",
        action="store_true",
        help="latency alone vs under 300 half-open connections and a looping chat template",
    )
    parser.add_argument(
        "--llama-server",
        type=Path,
        default=None,
        metavar="DIR",
        help="compare with llama.cpp's llama-server in DIR on the same weights (serve_workloads.py)",
    )
    parser.add_argument(
        "--vllm",
        type=Path,
        default=None,
        metavar="PYTHON",
        help="compare with vLLM's CPU backend run by PYTHON (make vllm: .venv-vllm/bin/python) (serve_vllm.py)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --llama-server, --vllm, --adapters or --max-batch-sizes: interleaved rounds",
    )
    parser.add_argument(
        "--adapters",
        type=int,
        default=0,
        metavar="N",
        help="compare N LoRA adapters served together with one merged model (serve_lora.py)",
    )
    parser.add_argument(
        "--max-batch-sizes",
        default=None,
        metavar="N,N,...",
        help="serve each --max-batch-size in turn (one server at a time) and compare tokens/s (serve_batch_sizes.py)",
    )
    parser.add_argument(
        "--only",
        default=None,
        metavar="TEXT",
        help="with --llama-server: only the workloads whose name contains TEXT (such as conversation)",
    )
    parser.add_argument(
        "--defaults",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --llama-server: also run both servers at their default settings",
    )
    args = parser.parse_args()
    if args.llama_server is not None:
        from serve_workloads import compare_with_llama_server

        compare_with_llama_server(args)
        return
    if args.vllm is not None:
        from serve_vllm import compare_with_vllm

        compare_with_vllm(args)
        return
    if args.adapters:
        from serve_lora import compare

        compare(args, build_model_dir, start_server, run_clients)
        return
    if args.max_batch_sizes is not None:
        from serve_batch_sizes import batch_sizes, sweep

        args.max_batch_sizes = batch_sizes(args.max_batch_sizes)
        sweep(args, build_model_dir, run_clients)
        return
    show = (lambda *a, **k: None) if args.json else print  # noqa: E731
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or build_model_dir(Path(tmp), args.n_layer, args.n_embd, args.block_size)
        if args.adversarial:
            if args.model_dir is not None:
                raise SystemExit("bench_serve: --adversarial writes its own template; leave out --model-dir")
            (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": LOOPING_TEMPLATE}))
        proc, url = start_server(model_dir, max(args.concurrency), args.threads, args.compile)
        try:
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            run_clients(url, model, 1, 1, 4)  # warm-up
            if args.adversarial:
                result = adversarial(url, model, args.max_tokens)
                show(
                    f"median latency of a {args.max_tokens}-token completion: alone {result['alone_s']:.3f} s; with "
                    f"{result['half_open']} half-open connections and a looping template in flight "
                    f"{result['loaded_s']:.3f} s ({result['ratio']:.2f}x; target <= 2x)"
                )
                if args.json:
                    print(json.dumps({"model": model, "adversarial": result}, indent=2))
                return
            show(
                f"model {model}; {args.requests} requests per client, {args.max_tokens} max tokens each, "
                f"server threads: {args.threads or 'server default'}; {args.busy} busy neighbour(s)"
            )
            show(f"{'clients':>8} {'requests/s':>11} {'tokens/s':>10} {'speed-up':>9} {'load 1 min':>11}")
            base = None
            for clients in args.concurrency:
                with busy_neighbours(args.busy):
                    seconds, requests, tokens = run_clients(url, model, clients, args.requests, args.max_tokens)
                    load = os.getloadavg()[0]
                rate = tokens / seconds
                base = base or rate
                line = f"{clients:>8} {requests / seconds:>11.2f} {rate:>10.1f} {rate / base:>8.2f}x {load:>11.2f}"
                show(line, flush=True)
                row = {"clients": clients, "requests_per_s": requests / seconds, "tokens_per_s": rate}
                rows.append({**row, "speedup": rate / base, "load": load, "busy": args.busy})
            if args.json:
                print(
                    json.dumps(
                        {
                            "model": model,
                            "requests_per_client": args.requests,
                            "max_tokens": args.max_tokens,
                            "threads": args.threads,
                            "rows": rows,
                        },
                        indent=2,
                    )
                )
        finally:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
