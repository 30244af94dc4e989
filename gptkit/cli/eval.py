"""`gptkit eval`: loss, perplexity and bits per byte of a text file or a prepared val.bin under a model."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from gptkit.cli.flags import add_dataclass_flags, dataclass_from_args
from gptkit.errors import InputError

# Shown by `gptkit --help`, which imports no command's dependencies.
HELP = "loss, perplexity and bits per byte of a text (sliding window; by position too); a classifier's accuracy"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `eval` sub-command; its tuning flags come from EvalOptions."""
    from gptkit.evaluate import EvalOptions

    parser = subparsers.add_parser(
        "eval",
        help=HELP,
        description="Score a UTF-8 text file (--input) or a prepared data directory's val.bin (--data) under "
        "MODEL_DIR: mean next-token loss in nats, perplexity and bits per byte. Texts longer than the context are "
        "scored with windows of block_size tokens starting every --stride tokens; every token but the first is "
        "scored exactly once. Bytes are the UTF-8 bytes the scored tokens stand for.",
    )
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="a gptkit (or Hugging Face) model directory")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", metavar="FILE", help="a UTF-8 text file, encoded as the tokenizer encodes it")
    source.add_argument("--data", metavar="DATA_DIR", help="a directory made by `gptkit prepare`: scores its val.bin")
    add_dataclass_flags(parser, EvalOptions)
    parser.add_argument(
        "--icl",
        action="store_true",
        help="instead of the loss: the in-context learning score "
        "(late minus early loss in the context) and the induction-head test",
    )
    parser.add_argument(
        "--icl-windows",
        type=int,
        default=None,
        metavar="N",
        help="context windows the ICL score averages over (default: 64)",
    )
    parser.add_argument(
        "--context",
        type=int,
        default=None,
        metavar="N",
        help="score windows of N tokens (default: the model's block_size); past block_size for RoPE (or "
        "position-free) models only",
    )
    parser.add_argument(
        "--by-position",
        type=int,
        default=None,
        metavar="BUCKET",
        help="also the mean loss per bucket of BUCKET positions in the window (windows then start every N tokens "
        "unless --stride says otherwise), to see the loss beyond the model's original context",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


def _read_text(path: str) -> str:
    """The text of a UTF-8 file, or a one-line error naming what is wrong with it."""
    file = Path(path)
    if not file.is_file():
        raise InputError(f"--input {path} does not exist (or is not a file)")
    try:
        return file.read_bytes().decode("utf-8")  # not read_text: its newline translation would change \r\n
    except UnicodeDecodeError as err:
        raise InputError(f"--input {path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    except OSError as err:
        raise InputError(f"cannot read --input {path}: {err.strerror}") from None


def run(args: argparse.Namespace) -> int:
    """Evaluate and print the metrics."""
    import torch
    from tqdm import tqdm

    from gptkit.data import is_examples, load_examples, read_meta
    from gptkit.devices import pick_device
    from gptkit.evaluate import (
        EvalOptions,
        check_context,
        encode_text,
        evaluate_examples,
        evaluate_ids,
        sliding_windows,
        val_tokens,
    )
    from gptkit.finetune.heads import is_classifier_dir
    from gptkit.loading import load, resolve_model_path
    from gptkit.quantization import is_quantized, quantize

    options = dataclass_from_args(EvalOptions, args)
    args.model_dir = str(resolve_model_path(args.model_dir))  # a run directory: its newest checkpoint
    text = _read_text(args.input) if args.input is not None else None
    if text == "":
        raise InputError(f"--input {args.input} is empty; there is nothing to score")
    model, tokenizer = load(args.model_dir, dtype=getattr(torch, options.dtype), device=pick_device(options.device))
    if options.quantize is not None and not is_quantized(model):
        quantize(model, options.quantize)
    context = model.config.block_size if args.context is None else args.context
    check_context(model.config, context)
    if args.by_position is not None and (args.icl or options.kv_cache is not None):
        raise InputError("--by-position scores a text without a KV cache; drop --icl or --kv-cache")
    if text is not None:
        if tokenizer is None:
            raise InputError(f"{args.model_dir} has no tokenizer files; use --data with a prepared directory")
        ids = encode_text(tokenizer, text)
        lengths = tokenizer.token_byte_lengths()
        source = args.input
    else:
        ids, data_tokenizer = val_tokens(args.data, tokenizer, args.model_dir)
        lengths = data_tokenizer.token_byte_lengths() if data_tokenizer is not None else None
        source = str(Path(args.data) / "val.bin")
        meta = read_meta(args.data)
        if args.icl and is_examples(meta):
            raise InputError(f"--icl reads running text; {args.data} holds separate examples")
        if options.kv_cache is not None and is_examples(meta):
            raise InputError(
                "--kv-cache scores a text (--input, or a data directory of text); examples are scored without a cache"
            )
        if meta.kind == "labelled" and is_classifier_dir(args.model_dir):
            return _classify_report(args, model, meta, options.batch_size)
        if is_examples(meta) and (args.context is not None or args.by_position is not None):
            raise InputError(f"--context and --by-position score running text; {args.data} holds separate examples")
        if is_examples(meta):  # supervised examples: each scored alone, on its trained tokens
            examples = load_examples(args.data, "val", meta)
            with tqdm(total=len(examples), unit="example", desc="eval", file=sys.stderr, disable=args.quiet) as bar:
                result = evaluate_examples(model, examples, lengths, options.batch_size, bar.update)
            return _report(
                args,
                result,
                f"{source}: {len(examples):,} examples, {result.tokens:,} trained tokens "
                f"scored ({result.bytes:,} bytes)",
            )
    if args.icl:
        return _icl_report(args, model, ids, source, options.kv_cache)
    if len(ids) < 2:
        raise InputError(f"{source} holds {len(ids)} token(s); at least 2 are needed to score a prediction")
    if args.by_position is not None:
        return _positions_report(args, model, ids, lengths, source, context, options)
    total = len(sliding_windows(len(ids), context, options.stride))  # also checks --stride before the model runs
    with tqdm(total=total, unit="window", desc="eval", file=sys.stderr, disable=args.quiet) as bar:
        result = evaluate_ids(
            model, ids, lengths, options.stride, options.batch_size, bar.update, options.kv_cache, context
        )
    return _report(
        args,
        result,
        f"{source}: {result.tokens:,} tokens scored ({result.bytes:,} bytes), context "
        f"{context}, stride {options.stride or max(1, context // 2)}",
    )


def _positions_report(args: argparse.Namespace, model, ids, lengths, source: str, context: int, options) -> int:
    """The overall metrics and the mean loss per bucket of window positions: one JSON object, or a table."""
    from tqdm import tqdm

    from gptkit.evaluate import metrics, position_buckets, score_positions, scored_bytes, sliding_windows

    if args.by_position < 1:  # before the model runs; position_buckets says the same afterwards
        raise InputError(f"--by-position must be >= 1 positions per bucket, got {args.by_position}")
    stride = options.stride if options.stride is not None else context
    total = len(sliding_windows(len(ids), context, stride))  # also checks --stride before the model runs
    with tqdm(total=total, unit="window", desc="eval", file=sys.stderr, disable=args.quiet) as bar:
        nll_sums, counts = score_positions(model, ids, context, stride, options.batch_size, bar.update)
    n_bytes = scored_bytes(ids, lengths) if lengths is not None else 0
    result = metrics(float(nll_sums.sum()), int(counts.sum()), n_bytes)
    buckets = position_buckets(nll_sums, counts, args.by_position)
    if args.json:
        rows = [dataclasses.asdict(bucket) for bucket in buckets]
        print(json.dumps({**result.to_dict(), "context": context, "stride": stride, "by_position": rows}))
        return 0
    heading = (
        f"{source}: {result.tokens:,} tokens scored ({result.bytes:,} bytes), context {context}, stride {stride}, "
        f"model block_size {model.config.block_size}"
    )
    _report(args, result, heading)
    print(f"{'positions':>13} {'tokens':>10} {'loss':>8}")
    for bucket in buckets:
        loss = f"{bucket.loss:.4f}" if bucket.loss is not None else "-"
        print(f"{bucket.start:>6}-{bucket.end:<6} {bucket.tokens:>10,} {loss:>8}")
    return 0


def _report(args: argparse.Namespace, result, heading: str) -> int:
    """Print the metrics: one JSON object, or a heading line and a metrics line."""
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    bpb = f"{result.bits_per_byte:.4f}" if result.bits_per_byte is not None else "unknown (no tokenizer)"
    print(heading)
    print(f"loss {result.loss:.4f} nats/token  perplexity {result.perplexity:.3f}  bits per byte {bpb}")
    return 0


def _icl_report(args: argparse.Namespace, model, ids, source: str, kv_cache: str | None) -> int:
    """The ICL score over windows of ids and the induction test: one JSON object, or a few lines."""
    from gptkit.observe.measures import ICL_WINDOWS, icl_summary

    windows = args.icl_windows if args.icl_windows is not None else ICL_WINDOWS
    if windows < 1:
        raise InputError(f"--icl-windows must be >= 1, got {windows}")
    if kv_cache is not None:
        raise InputError("--icl reads attention weights from the plain forward pass; drop --kv-cache")
    context = model.config.block_size
    if len(ids) < context + 1:
        raise InputError(
            f"{source} holds {len(ids):,} tokens; --icl needs at least block_size + 1 = "
            f"{context + 1:,} for a full context window"
        )
    summary = icl_summary(model, ids, windows)
    if args.json:
        print(json.dumps(summary))
        return 0
    induction = summary["induction"]
    print(f"{source}: {summary['windows']} windows of {context} tokens")
    stderr = f" +- {summary['icl_stderr']:.4f}" if summary["icl_stderr"] is not None else ""
    print(
        f"ICL score {summary['icl_score']:+.4f}{stderr} nats (late loss {summary['late_loss']:.4f}, last tenth of "
        f"the context, minus early loss {summary['early_loss']:.4f}, 5-10% in; negative: the context helps)"
    )
    print(
        f"induction test ({induction['length']} random tokens repeated): loss {induction['first_half_loss']:.4f} "
        f"on the first half, {induction['repeated_half_loss']:.4f} on the repeat"
    )
    heads = ", ".join(f"L{h['layer']}H{h['head']} {h['score']:.3f}" for h in induction["top_heads"])
    print(
        f"strongest induction heads (layer, head, score): {heads}; uniform attention scores "
        f"{induction['chance']:.3f}, a perfect induction head 1"
    )
    return 0


def _classify_report(args: argparse.Namespace, model, meta: dict, batch_size: int) -> int:
    """A classifier on a labelled data set's validation texts: accuracy, macro-F1 and the confusion matrix."""
    from tqdm import tqdm

    from gptkit.data import load_examples
    from gptkit.evaluate import classification_scores
    from gptkit.finetune.heads import load_head, predict

    classifier = load_head(model, args.model_dir)
    unknown = sorted(set(meta.labels) - set(classifier.labels))
    if unknown:
        raise InputError(
            f"{args.data} has label(s) {', '.join(map(repr, unknown))} that the classifier "
            f"{args.model_dir} does not know (it knows {', '.join(map(repr, classifier.labels))})"
        )
    examples = load_examples(args.data, "val", meta)
    if len(examples) == 0:
        raise InputError(f"{args.data} has no validation texts (prepared with --val-fraction 0)")
    rows = [examples.ids[a:b].tolist() for a, b in zip(examples.offsets[:-1], examples.offsets[1:])]
    with tqdm(total=len(rows), unit="text", desc="eval", file=sys.stderr, disable=args.quiet) as bar:
        probabilities = predict(classifier, rows, batch_size, bar.update)
    truth = np.asarray([classifier.labels.index(meta.labels[i]) for i in examples.labels])
    scores = classification_scores(truth, probabilities.argmax(1).numpy(), classifier.labels)
    if args.json:
        print(json.dumps(scores))
        return 0
    print(f"{Path(args.data) / 'val.bin'}: {scores['examples']:,} labelled texts")
    print(f"accuracy {scores['accuracy']:.4f}  macro-F1 {scores['macro_f1']:.4f}")
    width = max(8, *(len(label) + 2 for label in classifier.labels))
    print("confusion (rows: true label, columns: predicted)")
    print(" " * width + "".join(f"{label:>{width}}" for label in classifier.labels))
    for label, row in zip(classifier.labels, scores["confusion"]):
        print(f"{label:>{width}}" + "".join(f"{count:>{width}}" for count in row))
    return 0
