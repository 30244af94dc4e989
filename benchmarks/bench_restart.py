"""Time to first token after a restart: `gptkit serve --cache-dir` reading a prompt's blocks from disk, against a cold
start.

Each round takes a fresh, empty cache directory. A first server (the cold side) is sent each long prompt once, a
greedy streamed completion whose time to first token, text, tokens and log-probabilities are kept, and then the same
prompt again (warm in RAM: the blocks the first request left in the same process). That server is then stopped with
SIGTERM, which finishes its queued disk writes before it exits, and a second server is started on the same directory
(warm from disk after a restart) and sent the same prompts: its times to first token, whether each answer equals the
cold one bit for bit, and its /health counters (blocks read from disk, prompt tokens not computed) say the blocks
came from disk. Both servers first answer one short request (one-off costs: the kernels, the first step), whose
prompt fills no block. Rounds run cold and warm in turn; the table has the median of the rounds per side. The model is
a random GPT-2-small-shaped one (12 layers, 768 wide, a byte tokenizer: a corpus character is a token) unless
--model-dir is given; prompts are distinct slices of the bundled corpus. Only loopback is ever contacted.

    .venv/bin/python benchmarks/bench_restart.py                   # 4 prompts of 2,000-4,000 tokens, 3 rounds
    .venv/bin/python benchmarks/bench_restart.py --threads 2 --rounds 5 --json
    .venv/bin/python benchmarks/bench_restart.py --smoke           # a tiny model and short prompts: it runs

It exits 1 (after the table) when a warm answer differs from the cold one or the restarted server read fewer blocks
from disk than the prompts hold.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from serve_process import build_model_dir, start_server
from serve_workloads import cpu_line

BLOCK_TOKENS = 64  # gptkit.decoding.step.PREFILL_CHUNK: the prefix cache's block
SMOKE = {"n_layer": 2, "n_embd": 64, "block_size": 512, "prompt_tokens": [150, 300], "max_tokens": 8, "rounds": 1}


@dataclass
class Answer:
    """One streamed completion: when its first token came, and everything that must match bit for bit."""

    ttft_s: float
    prompt_tokens: int
    text: str
    tokens: list[str]
    logprobs: list[float]

    def same_as(self, other: Answer) -> bool:
        """Whether the text, tokens and log-probabilities are identical (JSON floats round-trip exactly)."""
        return (self.text, self.tokens, self.logprobs) == (other.text, other.tokens, other.logprobs)


def corpus_prompts(lengths: list[int]) -> list[str]:
    """Distinct slices of the bundled corpus, one of each length in characters, none overlapping another."""
    from gptkit.prepare import DEFAULT_CORPUS

    text, at, out = DEFAULT_CORPUS.read_text(), 0, []
    for length in lengths:
        out.append(text[at : at + length])
        at += length + 1000
    return out


def ask(url: str, model: str, prompt: str, max_tokens: int) -> Answer:
    """A greedy streamed completion with log-probabilities."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    answer = Answer(float("nan"), 0, "", [], [])
    started = time.perf_counter()
    with httpx.Client(base_url=url, timeout=900) as http, http.stream("POST", "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            for choice in data.get("choices", []):
                logprobs = choice.get("logprobs") or {}
                if answer.ttft_s != answer.ttft_s and logprobs.get("tokens"):  # nan: no token yet
                    answer.ttft_s = time.perf_counter() - started
                answer.text += choice.get("text") or ""
                answer.tokens += logprobs.get("tokens") or []
                answer.logprobs += logprobs.get("token_logprobs") or []
            if data.get("usage"):
                answer.prompt_tokens = data["usage"]["prompt_tokens"]
    return answer


class Server:
    """`gptkit serve MODEL --cache-dir DIR` for a with-block: its URL, model id, start-up seconds and cache counters."""

    def __init__(self, model_dir: Path, cache_dir: Path, threads: int | None) -> None:
        started = time.perf_counter()
        self.proc, self.url = start_server(model_dir, None, threads, extra=("--cache-dir", str(cache_dir)))
        self.start_s = time.perf_counter() - started
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]
        ask(self.url, self.model, "Warm up.", 4)  # shorter than a block: nothing is cached

    def cache(self) -> dict[str, int]:
        """The prefix cache's counters from /health."""
        return httpx.get(self.url + "/health").json()["prefix_cache"]

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        # SIGTERM: uvicorn shuts down, the engine stops and the prefix cache waits for its queued disk writes
        # (kv_store.CLOSE_WAIT_S) before the process exits.
        self.proc.terminate()
        self.proc.wait(timeout=120)


def one_round(model_dir: Path, cache_dir: Path, prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """A cold server on an empty cache_dir (each prompt twice: cold, then warm in RAM), then a restarted one."""
    with Server(model_dir, cache_dir, args.threads) as cold_server:
        cold = [ask(cold_server.url, cold_server.model, p, args.max_tokens) for p in prompts]
        ram = [ask(cold_server.url, cold_server.model, p, args.max_tokens) for p in prompts]
        cold_cache = cold_server.cache()
    written = list(cache_dir.glob("*/*.safetensors"))
    with Server(model_dir, cache_dir, args.threads) as warm_server:
        disk = [ask(warm_server.url, warm_server.model, p, args.max_tokens) for p in prompts]
        warm_cache = warm_server.cache()
    # One folder per namespace: a second one means the restarted server named its blocks otherwise (another model,
    # other kernels' sources or timed choices, another thread count) and so found none of the first server's.
    namespaces = [path.name for path in cache_dir.iterdir() if path.is_dir()]
    return {
        "cold_start_s": cold_server.start_s,
        "warm_start_s": warm_server.start_s,
        "blocks_in_ram": cold_cache["blocks"],
        "files_written": len(written),
        "disk_bytes": sum(path.stat().st_size for path in written),
        "disk_reads": warm_cache["disk_hits"],
        "hit_tokens": warm_cache["hit_tokens"],
        "computed_tokens": warm_cache["computed_tokens"],
        "namespaces": len(namespaces),
        "prompts": [
            {
                "prompt_tokens": c.prompt_tokens,
                "cold_ttft_s": c.ttft_s,
                "ram_ttft_s": r.ttft_s,
                "disk_ttft_s": d.ttft_s,
                "same_ram": r.same_as(c),
                "same_disk": d.same_as(c),
            }
            for c, r, d in zip(cold, ram, disk)
        ],
    }


def summary(rounds: list[dict[str, Any]], prompts: int) -> list[dict[str, Any]]:
    """Per prompt, the median of the rounds on each side and whether every round's answers matched the cold one."""
    rows = []
    for i in range(prompts):
        runs = [r["prompts"][i] for r in rounds]
        cold, ram, disk = (
            statistics.median(run[key] for run in runs) for key in ("cold_ttft_s", "ram_ttft_s", "disk_ttft_s")
        )
        rows.append(
            {
                "prompt_tokens": runs[0]["prompt_tokens"],
                "cold_ttft_s": cold,
                "ram_ttft_s": ram,
                "disk_ttft_s": disk,
                "cold_over_disk": cold / disk,
                "same_ram": all(run["same_ram"] for run in runs),
                "same_disk": all(run["same_disk"] for run in runs),
            }
        )
    return rows


def print_table(result: dict[str, Any]) -> None:
    """The markdown table docs/benchmarks.md shows, and the start-up and cache lines below it."""
    yes = {True: "yes", False: "NO"}
    print(f"CPU: {result['cpu']}")
    print(
        f"model {result['model']}; server --threads {result['threads'] or '(default)'}; greedy, {result['max_tokens']} "
        f"new tokens; median of {len(result['rounds'])} round(s)\n"
    )
    print(
        "| prompt tokens | cold TTFT (s) | warm from disk after restart (s) | cold / warm | same answer | warm in RAM (s) |"
    )
    print("|---:|---:|---:|---:|:---:|---:|")
    for row in result["rows"]:
        print(
            f"| {row['prompt_tokens']:,} | {row['cold_ttft_s']:.3f} | {row['disk_ttft_s']:.3f} | "
            f"{row['cold_over_disk']:.1f}x | {yes[row['same_disk']]} | {row['ram_ttft_s']:.3f} "
            f"(same: {yes[row['same_ram']]}) |"
        )
    median = lambda key: statistics.median(r[key] for r in result["rounds"])  # noqa: E731
    print(
        f"\nserver start (to listening): empty --cache-dir {median('cold_start_s'):.1f} s; with "
        f"{median('files_written'):.0f} blocks ({median('disk_bytes') / 1e6:.0f} MB) on disk {median('warm_start_s'):.1f} s"
    )
    print(
        f"restarted server's /health: {median('disk_reads'):.0f} blocks read from disk, {median('hit_tokens'):.0f} "
        f"prompt tokens not computed (the prompts hold {result['expected_hit_tokens']} in whole blocks before "
        "their last token)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="serve this model instead of a random one")
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--block-size", type=int, default=4096)
    parser.add_argument(
        "--prompt-tokens", type=int, nargs="+", default=[2000, 2600, 3300, 4000], help="each prompt's corpus characters"
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="cold/warm pairs, each on a fresh cache directory")
    parser.add_argument("--threads", type=int, default=None, help="the servers' --threads (default: the server's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, short prompts, one round: it runs")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    prompts = corpus_prompts(args.prompt_tokens)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or build_model_dir(Path(tmp), args.n_layer, args.n_embd, args.block_size)
        for index in range(args.rounds):
            rounds.append(one_round(model_dir, Path(tmp) / f"cache-{index}", prompts, args))
            if not args.json:
                print(f"round {index + 1}: {json.dumps(rounds[-1])}", flush=True)
            for path in (Path(tmp) / f"cache-{index}").glob("*/*.safetensors"):
                path.unlink()  # a round's blocks are not needed again (a GPT-2-small round writes about 1 GB)
    rows = summary(rounds, len(prompts))
    expected = sum((row["prompt_tokens"] - 1) // BLOCK_TOKENS * BLOCK_TOKENS for row in rows)
    result = {
        "cpu": cpu_line(),
        "model": str(args.model_dir) if args.model_dir else f"random, {args.n_layer} layers x {args.n_embd} wide",
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "expected_hit_tokens": expected,
        "rows": rows,
        "rounds": rounds,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    if not all(row["same_disk"] and row["same_ram"] for row in rows):
        raise SystemExit("bench_restart: a warm answer differs from the cold one")
    if any(r["hit_tokens"] < expected for r in rounds):
        raise SystemExit(
            "bench_restart: the restarted server computed tokens its cache directory held (a second namespace folder "
            "there means the blocks' namespace changed between the two servers: the kernels rebuilt or retimed?)"
        )


if __name__ == "__main__":
    main()
