"""Prompt-lookup speculation in `gptkit serve`: tokens/s with and without lookup, acceptance, and the cost on text
that does not copy its prompt.

Four workloads, each at 1 and 8 concurrent clients, greedy, against one `gptkit serve` whose requests say
`"lookup": false` (plain) or give lookup's settings; `gptkit serve --lookup` builds the same engine and only sets a
request's default, so one process measures both sides on the same cores and caches. Plain and each setting run in
interleaved rounds (plain, setting 1, ..., setting n, then the reverse order):
- editing: the prompt holds a passage and asks for it again with small changes; the reply mostly copies it;
- code: the prompt is the start of a Python file whose later lines repeat its earlier names and shapes;
- chat: a plain question; the reply copies little, so this row is the cost of lookup when little matches;
- copy: a random string of the corpus's characters and its first 16 again; the reply continues the copy, which the
  trained model does (its induction head), so this row is what the check costs and gains where the model copies.
Each row (a workload, a client count, a setting) gives tokens/s without and with lookup, the speed-up, lookup's
acceptance (accepted / proposed tokens, from the server's /metrics), tokens proposed per generated token, and
whether every reply was the same text (greedy output with lookup is the model's own). --k and --ngram take
comma-separated values and measure every pair: the way to choose the defaults.

Speculation helps exactly as far as the model copies, so the model matters: a random-weight model never continues a
copy. Without --model-dir the script trains one first, --train-steps steps in four stages (STAGES), kept in
--save-model's directory if given; --model-dir measures a trained checkpoint directory. The model and optimiser are
watch_it_learn's (configs/watch-it-learn.yaml), on bytes: 2 layers, 4 heads, 128 wide, an MLP of 128, exact GELU,
rotary positions, untied embeddings, no biases; AdamW at 1e-3, beta2 0.99, weight decay 0.1. Stage one (5,000 of
the 11,500 steps) is that recipe: a 64-byte context, batches of 32, the rate held after 50 warm-up steps, on its data
(speeches and copy documents, half each); the induction head grew between steps 4,000 and 4,750 (validation loss
2.81 to 2.48). Stages two to four (1,500, 1,500 and 3,500 steps, each wsd to 1e-4) run at the 512-byte context,
batches of 8, on text shaped like the workloads (benchmarks/speculation_data.py), never the corpus's last 2,400
characters, which the editing prompts quote. Stage two's long random-string copies carry the head from 64 bytes back
to 256 (a trial without them copied from 32 bytes back, induction score 0.86, and not from 128: 0.09); stage three's
repeated passages and copies of 8-symbol strings start it copying English, where one byte matches too many places.
After three stages the model copied random strings of the corpus's characters (induction score 0.90 on 256 of them
repeated; uniform attention 0.003) but English only a little: the held-out end cut into 200-character passages, each
written twice with a blank line between, cost 1.57 nats a byte on the first copy and 1.30 on the second, and
300-character ones (the editing passages' length) 1.56 and 1.60, no copying at all; lookup's acceptance on the
editing workload was 17-20%. Stage four makes English the bulk of the copying: long repeats (passages of 150-320
characters written twice, so the second copy reads from as far back as an editing reply does) 40%, edits 25%,
shorter repeats 10%, speeches 10%, and a little of the rest (FOURTH_SHARES). After it: induction score 0.90,
200-character passages 1.51 then 0.15 nats a byte, 300-character ones 1.50 then 0.46, and lookup's acceptance on
editing 72% (code 48%, chat 55%, copy 99%; after stage three 25%, 44%, 99%). A first try of stage four, 2,500 steps
on 6 million characters with long repeats at 30%, small copies at 10% and speeches at 15%, reached 0.21 and 0.50 on
the second copies and 52% on editing. One core shared with other jobs trained the stages in 22 + 11 + 11 + 23 minutes.

    .venv/bin/python benchmarks/bench_speculation.py --save-model spec-model --json  # trains 11,500 steps, measures
    .venv/bin/python benchmarks/bench_speculation.py --model-dir spec-model --rounds 3
    .venv/bin/python benchmarks/bench_speculation.py --model-dir spec-model --workloads editing chat \\
        --k 2,4,8 --ngram 1,2,3                                                       # the defaults, chosen
    .venv/bin/python benchmarks/bench_speculation.py --smoke                           # a few steps and tokens: runs
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serve_process import start_server
from serve_workloads import cpu_line
from speculation_data import FIRST_SHARES, FOURTH_SHARES, SHARES, THIRD_SHARES, training_text

from gptkit.decoding.lookup import LOOKUP_K, LOOKUP_NGRAM

MODEL = "model"
WORKLOADS = ("editing", "code", "chat", "copy")
COPY_CHARS, COPY_SHOWN = 240, 16  # a copy prompt's string, and how much of it the prompt repeats
WARM_TOKENS = 16  # a warm-up reply: long enough for lookup's checks to run at their sizes
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
    rng, alphabet = random.Random(1), sorted(set(corpus) - {"\n"})
    strings = ["".join(rng.choice(alphabet) for _ in range(COPY_CHARS)) for _ in range(8)]
    copy = [text + text[:COPY_SHOWN] for text in strings]
    return dict(zip(WORKLOADS, (editing, code, [CHAT] * 8, copy)))


# The trained model (see the module's note): watch_it_learn's (configs/watch-it-learn.yaml: two layers, 128 wide, an
# MLP of 128, exact GELU, rotary positions, AdamW at beta2 0.99 and weight decay 0.1) on bytes; each stage's context,
# batch, data (speculation_data's shares), share of the steps, schedule and learning rate.
MODEL_FLAGS = ["--model.n_layer", "2", "--model.n_head", "4", "--model.n_embd", "128", "--model.position", "rope"]
MODEL_FLAGS += ["--model.ffn_hidden", "128", "--model.activation", "gelu", "--model.dropout", "0.0"]
MODEL_FLAGS += ["--model.tie_embeddings", "false", "--model.attn_bias", "false", "--model.mlp_bias", "false"]
MODEL_FLAGS += ["--model.norm_bias", "false"]
OPTIM_FLAGS = ["--optim.weight_decay", "0.1", "--optim.beta1", "0.9", "--optim.beta2", "0.99"]
OPTIM_FLAGS += ["--optim.grad_clip", "1.0"]
STAGES = (  # share: of --train-steps; warm-up: steps (at most a tenth of the stage's)
    {"name": "copy", "block": 64, "batch": 32, "share": 10 / 23, "warmup": 50, "schedule": "constant", "lr": 1e-3},
    {"name": "full", "block": 512, "batch": 8, "share": 3 / 23, "warmup": 50, "schedule": "wsd", "lr": 1e-3},
    {"name": "english", "block": 512, "batch": 8, "share": 3 / 23, "warmup": 50, "schedule": "wsd", "lr": 1e-3},
    {"name": "passages", "block": 512, "batch": 8, "share": 7 / 23, "warmup": 50, "schedule": "wsd", "lr": 1e-3},
)
STAGE_CHARS = (4_000_000, 4_000_000, 4_000_000, 8_000_000)  # each stage's training text (its last tenth: validation)
SMOKE_CHARS = (100_000, 100_000, 100_000, 100_000)  # --smoke's: enough for a few batches at either context
STAGE_SHARES = (FIRST_SHARES, SHARES, THIRD_SHARES, FOURTH_SHARES)  # each stage's kinds of document (speculation_data)
TRAIN_STEPS = 11_500
EVALS = 10  # evaluations per stage (each logs the induction score)


def stage_command(out: Path, index: int, count: int, start: Path | None) -> list[str]:
    """The `gptkit train` command of stage `index` over `count` steps in out (its data prepared there), from the
    checkpoint start (None: fresh weights)."""
    stage = STAGES[index]
    data, run = out / f"{stage['name']}-data", out / f"{stage['name']}-run"
    flags = [*MODEL_FLAGS, *OPTIM_FLAGS, "--model.block_size", str(stage["block"])]
    flags += ["--model.init_from", str(start)] if start else []
    flags += ["--train.batch_size", str(stage["batch"]), "--optim.schedule", stage["schedule"]]
    flags += ["--optim.lr", str(stage["lr"]), "--optim.min_lr", str(stage["lr"] / 10)]
    flags += ["--optim.warmup_steps", str(max(1, min(stage["warmup"], count // 10)))]
    flags += ["--train.eval_interval", str(max(1, count // EVALS)), "--train.eval_iters", "5"]
    flags += ["--train.checkpoint_interval", str(count), "--train.eval_at_start", "false"]
    command = [sys.executable, "-m", "gptkit", "train", "--data", str(data), "--out", str(run)]
    return [*command, "--train.max_steps", str(count), "--quiet", *flags]


def prepare_stage(out: Path, index: int, chars: int) -> None:
    """Write stage `index`'s training text (about `chars` characters) into out and prepare it (bytes)."""
    from gptkit.prepare import DEFAULT_CORPUS

    name = STAGES[index]["name"]
    source, data = out / f"{name}.txt", out / f"{name}-data"
    source.write_text(training_text(DEFAULT_CORPUS.read_text(), chars, STAGE_SHARES[index]))
    prepare = ["prepare", "--input", str(source), "--tokenizer", "byte", "--out", str(data)]
    subprocess.run([sys.executable, "-m", "gptkit", *prepare], check=True)


def stage_steps(steps: int) -> list[int]:
    """Each stage's steps out of `steps` (at least one each; the last takes what rounding leaves)."""
    counts = [max(1, round(steps * stage["share"])) for stage in STAGES[:-1]]
    return [*counts, max(1, steps - sum(counts))]


def train_model(out: Path, steps: int, chars: tuple[int, ...] = STAGE_CHARS) -> Path:
    """A byte-level model trained to copy (see the module's note) in `steps` steps over its stages, on `chars`
    characters of text each; returns its last checkpoint's directory."""
    start = None
    for index, count in enumerate(stage_steps(steps)):
        prepare_stage(out, index, chars[index])
        subprocess.run(stage_command(out, index, count, start), check=True)
        start = out / f"{STAGES[index]['name']}-run" / "checkpoints" / f"step-{count:06d}"
    return start


def counters(http: httpx.Client) -> tuple[int, int]:
    """(proposed, accepted) tokens so far, from the server's /metrics."""
    text = http.get("/metrics").text
    read = lambda name: int(re.search(rf"^gptkit_speculative_{name}_total (\d+)$", text, re.M).group(1))  # noqa: E731
    return read("draft_tokens"), read("accepted_tokens")


def run_clients(
    url: str, prompts: list[str], clients: int, max_tokens: int, lookup: bool | dict
) -> tuple[float, int, list[str]]:
    """Every prompt once, `clients` at a time, with this `lookup` field: (seconds, completion tokens, texts in
    prompt order)."""

    def one(prompt: str) -> tuple[int, str]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "lookup": lookup}
        with httpx.Client(base_url=url, timeout=600) as http:
            reply = http.post("/v1/completions", json=body).raise_for_status().json()
        return reply["usage"]["completion_tokens"], reply["choices"][0]["text"]

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(one, prompts))
    seconds = time.perf_counter() - started
    return seconds, sum(tokens for tokens, _ in done), [text for _, text in done]


def measure(model_dir: Path, args: argparse.Namespace) -> dict:
    """The table: per workload, client count and lookup setting, tokens/s without and with lookup (best round),
    speed-up and acceptance.

    One server answers both sides, each request saying `"lookup": false` or its settings: `gptkit serve` and
    `gptkit serve --lookup` build the same engine (--lookup only sets what a request without the field gets), so
    one process gives both sides the same cores, memory and caches, and no second server sits beside the one
    being timed."""
    from gptkit.prepare import DEFAULT_CORPUS

    prompts = {name: texts for name, texts in workloads(DEFAULT_CORPUS.read_text()).items() if name in args.workloads}
    settings = [{"k": k, "ngram": n} for k in args.k for n in args.ngram]
    flags = ("--model-name", MODEL, "--lookup-k", str(max(args.k)))
    proc, url = start_server(model_dir, max(args.clients), args.threads, extra=flags)
    try:
        with httpx.Client(base_url=url, timeout=60) as metrics:
            rows = [
                row
                for name, texts in prompts.items()
                for clients in args.clients
                for row in _rows(name, texts, clients, settings, url, metrics, args)
            ]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {"cpu": cpu_line(), "model_dir": str(model_dir), "rows": rows}


def _rows(
    name: str,
    prompts: list[str],
    clients: int,
    settings: list[dict],
    url: str,
    metrics: httpx.Client,
    args: argparse.Namespace,
) -> list[dict]:
    """One workload at one client count: plain decoding and each lookup setting in interleaved rounds (the order
    reversed every other round), the best round of each; a row per setting."""
    modes: list[bool | dict] = [False, *settings]
    best, texts = [0.0] * len(modes), [[] for _ in modes]
    proposed, accepted, tokens = [0] * len(modes), [0] * len(modes), [0] * len(modes)
    for mode in modes:  # first-request costs and each setting's check shapes are not the workload's
        run_clients(url, prompts, clients, WARM_TOKENS, mode)
    for r in range(args.rounds):
        for i in range(len(modes)) if r % 2 == 0 else reversed(range(len(modes))):
            before = counters(metrics)  # read between runs, outside the timed span
            seconds, count, texts[i] = run_clients(url, prompts, clients, args.max_tokens, modes[i])
            after = counters(metrics)
            best[i] = max(best[i], count / seconds)
            proposed[i], accepted[i] = proposed[i] + after[0] - before[0], accepted[i] + after[1] - before[1]
            tokens[i] += count
    if proposed[0]:
        raise SystemExit(f"bench_speculation: {proposed[0]} tokens proposed for requests without lookup")
    return [
        {
            "workload": name,
            "clients": clients,
            "k": setting["k"],
            "ngram": setting["ngram"],
            "plain_tokens_per_s": best[0],
            "lookup_tokens_per_s": best[i],
            "speedup": best[i] / best[0],
            "acceptance_rate": accepted[i] / proposed[i] if proposed[i] else None,
            "proposed_per_token": proposed[i] / max(1, tokens[i]),
            "same_text": texts[i] == texts[0],
        }
        for i, setting in enumerate(modes[1:], start=1)
    ]


def save_model(checkpoint: Path, target: Path) -> None:
    """The trained checkpoint copied to target (a new directory), whole or not at all, for --model-dir."""
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(checkpoint, partial)
    partial.rename(target)


def int_list(text: str) -> list[int]:
    """An option's comma-separated integers, each at least 1."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers (e.g. 2,4,8)") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} holds a value below 1")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=None, help="a trained model to measure (default: train one)")
    parser.add_argument(
        "--train-steps", type=int, default=TRAIN_STEPS, help="steps of the model trained without --model-dir"
    )
    parser.add_argument("--save-model", type=Path, default=None, help="keep the trained model here (a new directory)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per row (the best counts)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per reply")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8], help="concurrent clients per row")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS), help="which to run")
    parser.add_argument("--k", type=int_list, default=[LOOKUP_K], help="lookup's k values to sweep, e.g. 2,4,8")
    parser.add_argument("--ngram", type=int_list, default=[LOOKUP_NGRAM], help="lookup's ngram values, e.g. 1,2,3")
    parser.add_argument("--threads", type=int, default=None, help="the server's --threads (default: its own)")
    parser.add_argument("--smoke", action="store_true", help="a few training steps, tokens and one round: it runs")
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    args = parser.parse_args()
    if args.save_model and (args.model_dir or args.save_model.exists()):
        why = "--model-dir trains nothing" if args.model_dir else f"{args.save_model} exists; name a new directory"
        parser.error(f"--save-model: {why}")
    if args.smoke:
        args.train_steps, args.rounds, args.max_tokens = 10, 1, 8
    with tempfile.TemporaryDirectory() as tmp:
        chars = SMOKE_CHARS if args.smoke else STAGE_CHARS
        model_dir = args.model_dir or train_model(Path(tmp), args.train_steps, chars)
        if args.save_model:
            save_model(model_dir, args.save_model)
            model_dir = args.save_model
        table = measure(model_dir, args)
    if args.json:
        print(json.dumps(table, indent=1))
        return
    print(f"cpu: {table['cpu']}  model: {table['model_dir']}")
    print(
        f"{'workload':<9} {'clients':>7} {'k':>2} {'ngram':>5} {'plain tok/s':>11} {'lookup tok/s':>12} "
        f"{'speed-up':>8} {'accepted':>8} {'proposed/tok':>12}"
    )
    for row in table["rows"]:
        rate = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.0%}"
        print(
            f"{row['workload']:<9} {row['clients']:>7} {row['k']:>2} {row['ngram']:>5} "
            f"{row['plain_tokens_per_s']:>11.1f} {row['lookup_tokens_per_s']:>12.1f} {row['speedup']:>7.2f}x "
            f"{rate:>8} {row['proposed_per_token']:>12.2f}" + ("" if row["same_text"] else "  (texts differ)")
        )


if __name__ == "__main__":
    main()
