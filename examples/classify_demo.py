"""GPT-1's task head, on a laptop CPU in minutes: two classification tasks on speeches of the bundled corpus.

1. Cut the bundled tiny shakespeare into speeches and label each with its play (the corpus runs play after play; a
   play starts where its first speaker first speaks). Keep four plays, drop the speaker names (they would give
   the play away) and the words past 120 characters; hold out 15% of the speeches.
2. Pre-train a small byte-level model on the corpus WITHOUT the held-out speeches.
3. Two tasks, each fine-tuned with a classification head (`--finetune.objective classify`: cross-entropy on the
   label plus 0.5 x the language-modelling loss, as GPT-1):
   - play: which of the four plays a speech comes from (mostly a matter of which words and names occur);
   - order: whether a speech reads as written or with its words shuffled (the same bag of words either way: only
     the order, what the words mean together, tells them apart).
4. Score the held-out speeches with `gptkit classify`, beside a bag-of-words baseline (multinomial naive Bayes on
   the same training texts) and the majority class.

Run: python examples/classify_demo.py [--out runs/classify-demo] [--quick]
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import re
import time
from pathlib import Path

import numpy as np
from demo_commands import PRETRAIN, gptkit_cli

from gptkit.prepare import DEFAULT_CORPUS

# Each play's first speaker, in the order the corpus runs (its first line opens the play).
PLAY_STARTS = [
    ("Coriolanus", "First Citizen"),
    ("Richard III", "GLOUCESTER"),
    ("Richard II", "KING RICHARD II"),
    ("Romeo and Juliet", "GREGORY"),
    ("Henry VI", "WARWICK"),
    ("The Winter's Tale", "ARCHIDAMUS"),
    ("Measure for Measure", "DUKE VINCENTIO"),
    ("The Taming of the Shrew", "SLY"),
    ("The Tempest", "Master"),
]
PLAYS = ["Coriolanus", "Romeo and Juliet", "The Winter's Tale", "The Taming of the Shrew"]
MAX_CHARS = 120  # the model reads 128 bytes
# 300 steps (about 4 epochs): the 0.8M-parameter model memorises 2,000 speeches' plays by 500.
CLASSIFY = [
    "--finetune.objective",
    "classify",
    "--train.batch_size",
    "32",
    "--optim.lr",
    "5e-4",
    "--optim.min_lr",
    "5e-5",
    "--optim.warmup_steps",
    "20",
    "--model.dropout",
    "0.1",
    "--train.eval_interval",
    "100",
    "--train.eval_iters",
    "4",
    "--train.checkpoint_interval",
    "1000",
]


def speeches() -> list[tuple[str, str, str]]:
    """(the corpus block, its speech text without the speaker, its play) of every speech of PLAYS."""
    blocks = DEFAULT_CORPUS.read_text().split("\n\n")
    speakers = [b.split("\n", 1)[0][:-1] if b.split("\n", 1)[0].endswith(":") else None for b in blocks]
    starts = [speakers.index(first) for _, first in PLAY_STARTS] + [len(blocks)]
    out = []
    for (play, _), begin, end in zip(PLAY_STARTS, starts, starts[1:]):
        for block in blocks[begin:end]:
            lines = block.split("\n")
            text = " ".join(lines[1:]).strip()
            if play in PLAYS and lines[0].endswith(":") and len(text) >= 40:
                out.append((block, cut(text), play))
    return out


def cut(text: str) -> str:
    """The text's first MAX_CHARS characters, ending at a word boundary."""
    return text if len(text) <= MAX_CHARS else text[:MAX_CHARS].rsplit(" ", 1)[0]


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def naive_bayes(train: list[tuple[str, str]], test: list[str]) -> list[str]:
    """Multinomial naive Bayes over word counts with add-one smoothing: the bag-of-words baseline."""
    counts = {label: collections.Counter() for _, label in train}
    prior = collections.Counter(label for _, label in train)
    for text, label in train:
        counts[label].update(words(text))
    vocab = set().union(*counts.values())
    totals = {label: sum(c.values()) + len(vocab) for label, c in counts.items()}

    def score(text: str, label: str) -> float:
        logp = math.log(prior[label] / len(train))
        return logp + sum(math.log((counts[label][w] + 1) / totals[label]) for w in words(text) if w in vocab)

    return [max(counts, key=lambda label: score(text, label)) for text in test]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/classify-demo"), help="where everything is written")
    parser.add_argument("--quick", action="store_true", help="a fraction of the steps (a smoke run, not the result)")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    scale = 10 if args.quick else 1
    started = time.perf_counter()

    data = speeches()
    held = np.random.default_rng(0).permutation(len(data))[: int(0.15 * len(data))]
    held_set = set(held.tolist())
    train_rows = [(text, play) for i, (_, text, play) in enumerate(data) if i not in held_set]
    test_rows = [(data[i][1], data[i][2]) for i in sorted(held_set)]
    print(f"{len(data)} speeches of {len(PLAYS)} plays: {len(train_rows)} to train on, {len(test_rows)} held out")

    base = out / "base" / "checkpoints" / f"step-{2000 // scale:06d}"
    if not base.is_dir():
        held_blocks = {data[i][0] for i in held_set}
        corpus = "\n\n".join(b for b in DEFAULT_CORPUS.read_text().split("\n\n") if b not in held_blocks)
        (out / "pretrain.txt").write_text(corpus)
        gptkit_cli(
            "prepare", "--input", str(out / "pretrain.txt"), "--tokenizer", "byte", "--out", str(out / "pretrain_data")
        )
        gptkit_cli(
            "train",
            "--data",
            str(out / "pretrain_data"),
            "--out",
            str(out / "base"),
            *PRETRAIN,
            "--train.max_steps",
            str(2000 // scale),
            "--optim.warmup_steps",
            str(100 // scale),
            "--quiet",
        )

    rng = np.random.default_rng(1)
    shuffled = {i: bool(rng.integers(2)) for i in range(len(data))}

    def ordered(i: int) -> str:
        if not shuffled[i]:
            return data[i][1]
        tokens = data[i][1].split(" ")
        return " ".join(tokens[j] for j in np.random.default_rng(i).permutation(len(tokens)))

    tasks = {
        "play": ([(t, p) for t, p in train_rows], test_rows),
        "order": (
            [(ordered(i), "shuffled" if shuffled[i] else "original") for i in range(len(data)) if i not in held_set],
            [(ordered(i), "shuffled" if shuffled[i] else "original") for i in sorted(held_set)],
        ),
    }
    results = {}
    for task, (train_texts, test_texts) in tasks.items():
        results[task] = run_task(out / task, base, train_texts, test_texts, scale)

    print(
        f"\nheld-out accuracy over {len(test_rows)} speeches the base model never read "
        f"({time.perf_counter() - started:.0f} s in all):"
    )
    print(f"  {'task':6s} {'gptkit classifier':>18s} {'bag of words':>13s} {'majority class':>15s}")
    for task, r in results.items():
        print(f"  {task:6s} {100 * r['gptkit']:17.1f}% {100 * r['bag_of_words']:12.1f}% {100 * r['majority']:14.1f}%")
    print(json.dumps(results))
    return 0


def run_task(
    out: Path, base: Path, train_rows: list[tuple[str, str]], test_rows: list[tuple[str, str]], scale: int
) -> dict[str, float]:
    """Fine-tune a classifier on train_rows and score it, naive Bayes and the majority class on test_rows."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.jsonl").write_text("".join(json.dumps({"text": t, "label": p}) + "\n" for t, p in train_rows))
    (out / "held_out.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t, _ in test_rows))
    gptkit_cli("prepare", "--input", str(out / "train.jsonl"), "--tokenizer", str(base), "--out", str(out / "data"))
    run_dir = out / "classifier"
    if not (run_dir / "latest").is_file():
        gptkit_cli(
            "train",
            "--data",
            str(out / "data"),
            "--out",
            str(run_dir),
            "--model.init_from",
            str(base),
            "--train.max_steps",
            str(max(300 // scale, 2)),
            *CLASSIFY,
            "--quiet",
        )
    checkpoint = run_dir / (run_dir / "latest").read_text().strip()
    lines = gptkit_cli("classify", str(checkpoint), "--input", str(out / "held_out.jsonl"), "--json", capture=True)
    predicted = [json.loads(line)["label"] for line in lines.splitlines()]
    truth = [label for _, label in test_rows]
    majority = collections.Counter(label for _, label in train_rows).most_common(1)[0][0]
    bow = naive_bayes(train_rows, [t for t, _ in test_rows])
    return {
        "gptkit": float(np.mean([a == b for a, b in zip(predicted, truth)])),
        "bag_of_words": float(np.mean([a == b for a, b in zip(bow, truth)])),
        "majority": float(np.mean([label == majority for label in truth])),
        "majority_label": majority,
    }


if __name__ == "__main__":
    raise SystemExit(main())
