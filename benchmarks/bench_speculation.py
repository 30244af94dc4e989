"""Prompt-lookup speculation in `gptkit serve`: tokens/s with and without --lookup, acceptance, and the cost on text
that does not copy its prompt.

Three workloads, each at 1 and 8 concurrent clients, greedy, against two `gptkit serve` processes on the same
model (one plain, one with --lookup), in interleaved rounds (plain, lookup, lookup, plain, ...):
- editing: the prompt holds a passage and asks for it again with small changes; the reply mostly copies it;
- code: the prompt is the start of a Python file whose later lines repeat its earlier names and shapes;
- chat: a plain question; the reply copies little, so this row is the cost of lookup when little matches.
Each row gives both servers' tokens/s, the speed-up, lookup's acceptance (accepted / proposed tokens, from the
server's /metrics) and whether every reply was the same text (greedy output with lookup is the model's own).

Speculation helps exactly as far as the model copies, so the model matters: a random-weight model never continues a
copy. Without --model-dir the script trains one first (a byte-level model of the shakespeare-char-cpu shape with a
512-byte context and rotary positions, on the bundled corpus with watch_it_learn's "copy documents" added, so that
it learns to copy), --train-steps steps; --model-dir measures a model of your own (a trained checkpoint directory).

    .venv/bin/python benchmarks/bench_speculation.py --json                        # trains 2,000 steps, then measures
    .venv/bin/python benchmarks/bench_speculation.py --model-dir RUN/checkpoints/step-002000 --rounds 3
    .venv/bin/python benchmarks/bench_speculation.py --smoke                       # a few steps and tokens: runs
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serve_process import start_server
from serve_workloads import cpu_line

MODEL = "model"
EDIT_PASSAGE_CHARS = 300  # with the instruction and the reply, within the 512-byte context trained
CODE = """class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def add(self, other):
        return Point(self.x + other.x, self.y + other.y)

    def sub(self, other):
        return Point(self.x - other.x, self.y - other.y)

    def mul(self, other):
"""
CHAT = "QUEEN: What news, my lord, from France?\nKING:"


def workloads(corpus: str) -> dict[str, list[str]]:
    """Prompts per workload: editing rewrites passages from the end of the corpus (text the model saw least)."""
    passages = [corpus[-(i + 1) * EDIT_PASSAGE_CHARS : -i * EDIT_PASSAGE_CHARS or None] for i in range(8)]
    editing = []
    for passage in passages:
        changed = passage.replace(" the ", " that ").replace(" and ", " & ")
        editing.append(f"Copy the text with 'the' as 'that' and 'and' as '&'.\n\n{passage}\n\n{changed[:60]}")
    code = [CODE + "        return Point(self.x * other.x, self.y * other.y)\n\n    def div(self, other):\n"] * 8
    return {"editing": editing, "code": code, "chat": [CHAT] * 8}


def train_model(out: Path, steps: int) -> Path:
    """A byte-level model trained to copy (see the module's note); returns its last checkpoint's directory."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from watch_it_learn import with_copies

    from gptkit.prepare import DEFAULT_CORPUS

    source = out / "shakespeare_copies.txt"
    source.write_text(with_copies(DEFAULT_CORPUS.read_text()))
    gptkit = [sys.executable, "-m", "gptkit"]
    data = out / "data"
    subprocess.run([*gptkit, "prepare", "--input", str(source), "--tokenizer", "byte", "--out", str(data)], check=True)
    flags = ["--model.preset", "shakespeare-char-cpu", "--model.block_size", "512", "--model.position", "rope"]
    flags += ["--train.batch_size", "8"]
    flags += ["--optim.lr", "2e-3", "--optim.min_lr", "2e-4", "--optim.warmup_steps", str(max(1, steps // 20))]
    flags += ["--train.eval_interval", str(steps), "--train.checkpoint_interval", str(steps)]
    run = out / "run"
    command = [*gptkit, "train", "--data", str(data), "--out", str(run), "--train.max_steps", str(steps), "--quiet"]
    subprocess.run([*command, *flags], check=True)
    return run / "checkpoints" / f"step-{steps:06d}"


def counters(http: httpx.Client) -> tuple[int, int]:
    """(proposed, accepted) tokens so far, from the server's /metrics."""
    text = http.get("/metrics").text
    read = lambda name: int(re.search(rf"^gptkit_speculative_{name}_total (\d+)$", text, re.M).group(1))  # noqa: E731
    return read("draft_tokens"), read("accepted_tokens")


def run_clients(url: str, prompts: list[str], clients: int, max_tokens: int) -> tuple[float, int, list[str]]:
    """Every prompt once, `clients` at a time: (seconds, completion tokens, texts in prompt order)."""

    def one(prompt: str) -> tuple[int, str]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        with httpx.Client(base_url=url, timeout=600) as http:
            reply = http.post("/v1/completions", json=body).raise_for_status().json()
        return reply["usage"]["completion_tokens"], reply["choices"][0]["text"]

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(one, prompts))
    seconds = time.perf_counter() - started
    return seconds, sum(tokens for tokens, _ in done), [text for _, text in done]


def measure(model_dir: Path, args: argparse.Namespace) -> dict:
    """The table: per workload and client count, both servers' tokens/s (best round), speed-up and acceptance."""
    from gptkit.prepare import DEFAULT_CORPUS

    prompts = workloads(DEFAULT_CORPUS.read_text())
    plain_proc, plain_url = start_server(model_dir, 8, args.threads, extra=("--model-name", MODEL))
    lookup_flags = ("--model-name", MODEL, "--lookup", "--lookup-k", str(args.lookup_k))
    lookup_proc, lookup_url = start_server(model_dir, 8, args.threads, extra=lookup_flags)
    rows = []
    try:
        with httpx.Client(base_url=lookup_url, timeout=60) as metrics:
            for name, texts in prompts.items():
                for clients in args.clients:
                    rows.append(_row(name, texts, clients, plain_url, lookup_url, metrics, args))
    finally:
        for proc in (plain_proc, lookup_proc):
            proc.terminate()
            proc.wait(timeout=30)
    return {"cpu": cpu_line(), "model_dir": str(model_dir), "lookup_k": args.lookup_k, "rows": rows}


def _row(
    name: str,
    prompts: list[str],
    clients: int,
    plain_url: str,
    lookup_url: str,
    metrics: httpx.Client,
    args: argparse.Namespace,
) -> dict:
    """One workload at one client count: interleaved rounds, the best of each server."""
    best = {"plain": 0.0, "lookup": 0.0}
    texts: dict[str, list[str]] = {}
    proposed = accepted = 0
    run_clients(plain_url, prompts, clients, 4)  # warm both (first-request costs are not the workload's)
    run_clients(lookup_url, prompts, clients, 4)
    for r in range(args.rounds):
        order = ("plain", "lookup") if r % 2 == 0 else ("lookup", "plain")
        for mode in order:
            before = counters(metrics)
            seconds, tokens, texts[mode] = run_clients(
                plain_url if mode == "plain" else lookup_url, prompts, clients, args.max_tokens
            )
            best[mode] = max(best[mode], tokens / seconds)
            if mode == "lookup":
                after = counters(metrics)
                proposed, accepted = proposed + after[0] - before[0], accepted + after[1] - before[1]
    return {
        "workload": name,
        "clients": clients,
        "plain_tokens_per_s": best["plain"],
        "lookup_tokens_per_s": best["lookup"],
        "speedup": best["lookup"] / best["plain"],
        "acceptance_rate": accepted / proposed if proposed else None,
        "proposed_per_token": proposed / max(1, args.rounds * len(prompts) * args.max_tokens),
        "same_text": texts["plain"] == texts["lookup"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=None, help="a trained model to measure (default: train one)")
    parser.add_argument("--train-steps", type=int, default=2000, help="steps of the model trained without --model-dir")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per row (the best counts)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per reply")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8], help="concurrent clients per row")
    parser.add_argument("--lookup-k", type=int, default=8, help="the lookup server's --lookup-k")
    parser.add_argument("--threads", type=int, default=None, help="the servers' --threads (default: theirs)")
    parser.add_argument("--smoke", action="store_true", help="a few training steps, tokens and one round: it runs")
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    args = parser.parse_args()
    if args.smoke:
        args.train_steps, args.rounds, args.max_tokens = 10, 1, 8
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or train_model(Path(tmp), args.train_steps)
        table = measure(model_dir, args)
    if args.json:
        print(json.dumps(table, indent=1))
        return
    print(f"cpu: {table['cpu']}  model: {table['model_dir']}  --lookup-k {table['lookup_k']}")
    print(f"{'workload':<9} {'clients':>7} {'plain tok/s':>11} {'lookup tok/s':>12} {'speed-up':>8} {'accepted':>8}")
    for row in table["rows"]:
        rate = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.0%}"
        print(
            f"{row['workload']:<9} {row['clients']:>7} {row['plain_tokens_per_s']:>11.1f} "
            f"{row['lookup_tokens_per_s']:>12.1f} {row['speedup']:>7.2f}x {rate:>8}"
            + ("" if row["same_text"] else "  (texts differ)")
        )


if __name__ == "__main__":
    main()
