"""`gptkit classify`: the label of each text under a classifier trained with `--finetune.objective classify`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gptkit.errors import InputError

# Shown by `gptkit --help`, which imports no command's dependencies.
HELP = "label texts with a classifier (a model trained with --finetune.objective classify)"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `classify` sub-command."""
    parser = subparsers.add_parser(
        "classify",
        help=HELP,
        description="Print each text's most likely label and its probability (--json: every label's). Texts come "
        'from --input (JSONL rows with a "text" field, or a text file with one text per line) or, without it, '
        "standard input (one text per line).",
    )
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="a classifier's model (or LoRA) directory")
    parser.add_argument("--input", metavar="FILE", type=Path, help='JSONL rows {"text": ...} or one text per line')
    parser.add_argument("--batch-size", type=int, default=16, help="texts per forward pass (default: 16)")
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda", "mps"), default="auto", help="where to run (default: auto)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per text, with every probability")
    parser.set_defaults(run=run)


def read_texts(path: Path | None) -> list[tuple[str, str]]:
    """(text, where) of each text: a JSONL file's "text" fields, a text file's or stdin's non-empty lines."""
    if path is None:
        lines = sys.stdin.read().splitlines()
        return [(line, f"stdin line {n}") for n, line in enumerate(lines, 1) if line.strip()]
    if not path.is_file():
        raise InputError(f"--input {path} does not exist (or is not a file)")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise InputError(f"--input {path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    if path.suffix != ".jsonl":
        return [(line, f"{path} line {n}") for n, line in enumerate(lines, 1) if line.strip()]
    texts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise InputError(f"{path} line {n} is not valid JSON ({err})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise InputError(f'{path} line {n} has no string field "text"')
        texts.append((row["text"], f"{path} line {n}"))
    return texts


def run(args: argparse.Namespace) -> int:
    """Classify the texts and print one line (or JSON object) per text."""
    from gptkit.devices import pick_device
    from gptkit.finetune.heads import is_classifier_dir, load_head, predict
    from gptkit.loading import load, resolve_model_path

    if args.batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {args.batch_size}")
    args.model_dir = str(resolve_model_path(args.model_dir))  # a run directory: its newest checkpoint
    if not is_classifier_dir(args.model_dir):
        raise InputError(
            f"{args.model_dir} has no classification head (classifier.json); train one with "
            "`gptkit train --finetune.objective classify` on labelled data"
        )
    texts = read_texts(args.input)
    if not texts:
        raise InputError(f"no text to classify in {args.input or 'stdin'}")
    model, tokenizer = load(args.model_dir, device=pick_device(args.device))
    if tokenizer is None:
        raise InputError(f"{args.model_dir} has no tokenizer files; classify needs one to read text")
    classifier = load_head(model.eval(), args.model_dir)
    rows = []
    for text, where in texts:
        ids = tokenizer.encode_prompt(text)[: model.config.block_size]  # its start, as prepare truncates
        if not ids:
            raise InputError(f"{where}: the text encodes to no token")
        rows.append(ids)
    probabilities = predict(classifier, rows, args.batch_size)
    for (text, _), p in zip(texts, probabilities.tolist()):
        best = max(range(len(p)), key=p.__getitem__)
        if args.json:
            print(
                json.dumps(
                    {"text": text, "label": classifier.labels[best], "probabilities": dict(zip(classifier.labels, p))}
                )
            )
        else:
            print(f"{classifier.labels[best]}\t{p[best]:.4f}\t{text}")
    return 0
