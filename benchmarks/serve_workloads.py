"""gptkit serve against llama.cpp's llama-server on the same weights: the workloads of `bench_serve.py --llama-server`.

Both servers run at once on loopback, but only one is sent traffic at a time: each workload runs on one, then the
other, then (with --rounds) again in turn, and the best round of each is kept. Every request is a /v1/completions
call at temperature 0 with the end-of-text token's logit biased out (every request generates max_tokens), timed by the
same client code with the same clock. Prompts are slices of the bundled corpus, a different one per request, so that
nothing is reused except where a workload means it to be (a conversation's earlier turns, a shared system prompt);
each round starts from another place in the corpus, so one round never warms the next.

- clients N: N threads, each sending its requests one after another (prompts of about 600 characters, 64 tokens).
- conversation: one prompt of 4,000 characters growing 200 a turn for 5 turns; time to the first streamed token.
- shared system prompt: 32 clients, one system prompt of about 1,000 tokens, each request adding a short user turn.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import httpx
from serve_process import free_port, start_server

STREAM = True
MODEL = "served-model"  # the model directory's name, which gptkit serve requires (llama-server ignores it)
CORPUS = Path(__file__).resolve().parents[1] / "gptkit" / "corpora" / "tinyshakespeare.txt"
PROMPT_CHARS, NEW_TOKENS = 600, 64
CONVERSATION_CHARS, TURN_CHARS, TURNS = 4000, 200, 5
SYSTEM_CHARS, USER_CHARS, SYSTEM_CLIENTS = 3500, 120, 32


def build_model(tmp: Path, n_layer: int, n_embd: int, block_size: int) -> tuple[Path, Path, int]:
    """A random GPT-2-shaped model with a 4,096-token BPE of the corpus: (model dir, its GGUF, end-of-text id)."""
    import torch

    from gptkit.config import ModelConfig
    from gptkit.formats.gguf import export_gguf
    from gptkit.formats.modeldir import save_model_dir
    from gptkit.model import GPT
    from gptkit.tokenizer import BPETokenizer

    tokenizer = BPETokenizer.train([CORPUS.read_text()], vocab_size=4096)
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        block_size=block_size,
        n_layer=n_layer,
        n_head=max(1, n_embd // 64),
        n_embd=n_embd,
        activation="gelu_tanh",
    )
    model = GPT(config).eval()
    model_dir = save_model_dir(model, tmp / MODEL, tokenizer=tokenizer)
    gguf = export_gguf(model, tmp / f"{MODEL}.gguf", tokenizer)
    return model_dir, gguf, tokenizer.eos_id


class Texts:
    """Distinct slices of the corpus, handed out in order from a starting offset."""

    def __init__(self, offset: int) -> None:
        self.text = CORPUS.read_text()
        self.at = offset % (len(self.text) // 2)

    def take(self, chars: int) -> str:
        if self.at + chars > len(self.text):
            self.at = 0
        piece = self.text[self.at : self.at + chars]
        self.at += chars
        return piece


def complete(http: httpx.Client, prompt: str, eos: int, max_tokens: int) -> tuple[int, float]:
    """Stream one greedy completion: (completion tokens, seconds to the first token with text)."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logit_bias": {str(eos): -100},
        "stream": STREAM,
        "stream_options": {"include_usage": True} if STREAM else None,
    }
    # A connection per request on both sides: llama-server's HTTP library closes a kept-alive connection after a
    # few requests, and a request sent down one it has just closed fails.
    headers = {"Connection": "close"}
    started, first, tokens = time.perf_counter(), None, 0
    if not STREAM:
        response = http.post("/v1/completions", json=body, headers=headers)
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"], float("nan")
    with http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if first is None and any(c.get("text") for c in data.get("choices", [])):
                first = time.perf_counter() - started
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
    return tokens, first if first is not None else float("nan")


def clients_rate(url: str, eos: int, texts: Texts, clients: int, requests: int) -> dict[str, float]:
    """Completion tokens/s of `clients` threads sending `requests` each, one after another."""
    prompts = [[texts.take(PROMPT_CHARS) for _ in range(requests)] for _ in range(clients)]

    def client(mine: list[str]) -> int:
        with httpx.Client(base_url=url, timeout=600) as http:
            return sum(complete(http, p, eos, NEW_TOKENS)[0] for p in mine)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(client, prompts))
    return {"tokens_per_s": tokens / (time.perf_counter() - start)}


def conversation(url: str, eos: int, texts: Texts) -> dict[str, Any]:
    """Time to first token of each turn of a conversation growing TURN_CHARS a turn."""
    start, more = texts.take(CONVERSATION_CHARS), texts.take(TURN_CHARS * TURNS)
    turns = [start + more[: TURN_CHARS * t] for t in range(TURNS)]  # each turn extends the one before
    with httpx.Client(base_url=url, timeout=600) as http:
        ttft = [complete(http, prompt, eos, 8)[1] for prompt in turns]
    return {"ttft_s": ttft, "last_over_first": ttft[-1] / ttft[0]}


def shared_system(url: str, eos: int, texts: Texts, requests: int) -> dict[str, float]:
    """Completion tokens/s of SYSTEM_CLIENTS clients whose prompts share one system prompt."""
    system = "System: " + texts.take(SYSTEM_CHARS) + "\n"
    prompts = [
        [f"{system}User: {texts.take(USER_CHARS)}\nAssistant:" for _ in range(requests)] for _ in range(SYSTEM_CLIENTS)
    ]

    def client(mine: list[str]) -> tuple[int, float]:
        with httpx.Client(base_url=url, timeout=600) as http:
            done = [complete(http, p, eos, NEW_TOKENS) for p in mine]
        return sum(t for t, _ in done), sum(f for _, f in done) / len(done)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(SYSTEM_CLIENTS) as pool:
        results = list(pool.map(client, prompts))
    seconds = time.perf_counter() - start
    return {
        "tokens_per_s": sum(t for t, _ in results) / seconds,
        "mean_ttft_s": sum(f for _, f in results) / len(results),
    }


def start_llama_server(binary: Path, gguf: Path, settings: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """llama-server on 127.0.0.1 with a free port (its output in log), once its /health answers 200."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), *settings],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(
                f"bench_serve: llama-server exited ({proc.returncode}) with settings {settings}; see {log}"
            )
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("bench_serve: llama-server did not start")


def workloads(args: argparse.Namespace) -> dict[str, Callable[[str, int, Texts], dict[str, Any]]]:
    """The workloads by name, each (url, eos id, texts) -> its figures."""
    found: dict[str, Callable[[str, int, Texts], dict[str, Any]]] = {}
    for clients in (1, 8, 32):
        per_client = max(1, args.requests * 8 // max(clients, 8)) if clients > 1 else args.requests
        found[f"{clients} client{'s' * (clients > 1)}, tokens/s"] = lambda url, eos, texts, c=clients, r=per_client: (
            clients_rate(url, eos, texts, c, r)
        )
    found["conversation, time to first token (s)"] = conversation
    found[f"shared system prompt, {SYSTEM_CLIENTS} clients, tokens/s"] = lambda url, eos, texts: shared_system(
        url, eos, texts, 1
    )
    return {name: run for name, run in found.items() if args.only is None or args.only in name}


def run_pair(urls: dict[str, str], eos: int, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every workload on each server in turn, args.rounds times; the best round of each."""
    best: dict[str, dict[str, Any]] = {}
    for round_index in range(args.rounds):
        for index, (name, workload) in enumerate(workloads(args).items()):
            for side, url in urls.items():
                # The same text for both sides; another for each workload and round (no prompt starts where one
                # before it did, so no round finds the text of another in either server's cache).
                texts = Texts(offset=7919 * (round_index + 1) + 104729 * index)
                result = workload(url, eos, texts)
                print(f"  round {round_index + 1} {side:>12}: {name}: {json.dumps(result)}", flush=True)
                key = f"{name}|{side}"
                if key not in best or _better(result, best[key]):
                    best[key] = result
    return best


def _better(new: dict[str, Any], old: dict[str, Any]) -> bool:
    if "tokens_per_s" in new:
        return new["tokens_per_s"] > old["tokens_per_s"]
    return new["ttft_s"][-1] < old["ttft_s"][-1]


def cpu_line() -> str:
    from gptkit.native import library

    return library.capability() if platform.system() == "Linux" else platform.processor()


def compare_with_llama_server(args: argparse.Namespace) -> None:
    """Both servers at their best settings for this machine, then at their defaults; prints the table (or JSON)."""
    binary = args.llama_server / "llama-server"
    if not binary.is_file():
        raise SystemExit(f"bench_serve: no llama-server in {args.llama_server} (build llama.cpp: LLAMA_CPP/build/bin)")
    cores = len(os.sched_getaffinity(0))
    settings = {
        "best": (["-t", str(cores), "-np", "8", "-c", str(8 * 2048)], ["--threads", str(cores)]),
        "defaults": ([], []),
    }
    if not args.defaults:
        del settings["defaults"]
    table: dict[str, Any] = {"cpu": cpu_line(), "threads": cores}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, gguf, eos = build_model(Path(tmp), args.n_layer, args.n_embd, 2048)
        for label, (llama_flags, gptkit_flags) in settings.items():
            print(
                f"{label} settings: llama-server {' '.join(llama_flags) or '(none)'}; gptkit serve "
                f"{' '.join(gptkit_flags) or '(none)'}",
                flush=True,
            )
            ours, ours_url = start_server(model_dir, None, None, extra=tuple(gptkit_flags))
            theirs, theirs_url = start_llama_server(binary, gguf, llama_flags, Path(tmp) / f"llama-server-{label}.log")
            try:
                for url in (ours_url, theirs_url):  # warm-up: first requests pay one-off costs on both sides
                    with httpx.Client(base_url=url, timeout=600) as http:
                        complete(http, "Warm up.", eos, 4)
                table[label] = run_pair({"llama-server": theirs_url, "gptkit": ours_url}, eos, args)
            finally:
                for proc in (ours, theirs):
                    proc.terminate()
                    proc.wait(timeout=30)
                if theirs.returncode not in (0, -15):
                    print((Path(tmp) / f"llama-server-{label}.log").read_text()[-3000:])
    print_table(table, args.json)


def print_table(table: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(table, indent=2))
        return
    print(f"CPU: {table['cpu']}")
    for label in ("best", "defaults"):
        if label not in table:
            continue
        print(f"\n{label} settings | llama-server | gptkit serve | gptkit / llama-server")
        names = dict.fromkeys(key.split("|")[0] for key in table[label])
        for name in names:
            theirs, ours = table[label][f"{name}|llama-server"], table[label][f"{name}|gptkit"]
            if "tokens_per_s" in ours:
                a, b = theirs["tokens_per_s"], ours["tokens_per_s"]
                ratio = f"{b / a:.2f}x" if a and b else "- (a side generated nothing: see its log)"
                print(f"{name} | {a:.1f} | {b:.1f} | {ratio}")
            else:
                shown = lambda r: ", ".join(f"{t:.2f}" for t in r["ttft_s"])  # noqa: E731
                print(
                    f"{name}, turns 1-{TURNS} | {shown(theirs)} | {shown(ours)} | 5th/1st: "
                    f"{theirs['last_over_first']:.2f} vs {ours['last_over_first']:.2f}"
                )
