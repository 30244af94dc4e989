"""`gptkit prepare`: tokenize text, JSONL, CSV or Parquet files (or directories of them) into a data directory."""

from __future__ import annotations

import argparse
import sys
import time

from gptkit.cli.flags import add_dataclass_flags, dataclass_from_args
from gptkit.errors import InputError

# Shown by `gptkit --help`, which imports no command's dependencies.
HELP = "tokenize text into train.bin / val.bin / meta.json for training"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `prepare` sub-command; its flags are generated from PrepareConfig."""
    from gptkit.prepare import PrepareConfig

    parser = subparsers.add_parser(
        "prepare",
        help=HELP,
        description="Tokenize text, JSONL, CSV/TSV and Parquet files (plain or gzip/xz/bzip2/zstd compressed) and "
        "directories of them into DATA_DIR/train.bin, val.bin, the tokenizer files and meta.json. With no --input, "
        "the bundled tiny shakespeare is used. The new data set replaces the old one only once it is complete. "
        'Rows of supervised examples ("messages" conversations, "prompt" and "completion", or '
        '"instruction" and "output") make a data set of examples for fine-tuning: each rendered with the chat '
        "template of the model given as --tokenizer, with which tokens are trained on. Rows that are prompts "
        '(a "prompt" without "completion", or "messages" ending with a user turn; any other fields kept) '
        "make a data set of prompts for reinforcement learning.",
    )
    # Unset flags stay out of the namespace, so that run() can tell an explicit --vocab-size from the default.
    add_dataclass_flags(parser, PrepareConfig, keep_unset=True)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Prepare the data directory and print a one-line summary."""
    from gptkit.data_kinds import DATA_KINDS, row_format
    from gptkit.prepare import PrepareConfig, prepare

    config = dataclass_from_args(PrepareConfig, args)
    if "vocab_size" in vars(args) and config.tokenizer != "bpe":
        raise InputError("--vocab-size applies only to --tokenizer bpe (char and byte vocabularies are fixed)")
    started = time.perf_counter()
    meta = prepare(config, progress=True)
    seconds = time.perf_counter() - started
    read = sum(i["bytes"] for i in meta.inputs)
    kind = DATA_KINDS.get(meta.kind)
    if kind is not None and kind.examples:
        noun, per = kind.noun, kind.items_of
        train, val = meta.train_examples // per, meta.val_examples // per
        rows = ", ".join(sorted({row_format(i["format"]).title for i in meta.inputs if i["format"]}))
        labels = f" of the labels {', '.join(meta.labels)}" if meta.labels else ""
        cut = f"; longer than {meta.max_length} tokens: {meta.truncated} truncated, {meta.dropped} dropped"
        print(
            f"wrote {config.out}: recognised {rows} rows: {train + val:,} {noun}{labels} (train {train:,}, val "
            f"{val:,}); {meta.tokenizer} vocabulary {meta.vocab_size:,}, {meta.train_targets:,} trained "
            f"tokens of {meta.train_tokens:,} in train{cut if meta.truncated or meta.dropped else ''}"
        )
        return 0
    if meta.kind == "prompts":
        kept = meta.train_prompts + meta.val_prompts
        dropped = f"; longer than {meta.max_length} tokens: {meta.dropped} dropped" if meta.dropped else ""
        print(
            f"wrote {config.out}: {meta.tokenizer} vocabulary {meta.vocab_size:,}, {kept:,} prompts "
            f"(train {meta.train_prompts:,}, val {meta.val_prompts:,}), {meta.train_tokens:,} tokens in "
            f"train, the longest {meta.longest_prompt:,}{dropped}"
        )
        return 0
    print(
        f"wrote {config.out}: {meta.tokenizer} vocabulary {meta.vocab_size:,}, "
        f"train {meta.train_tokens:,} tokens, val {meta.val_tokens:,} tokens ({meta.dtype}), "
        f"{len(meta.inputs)} file(s), {read / 1e6:.1f} MB in {seconds:.1f} s ({read / 1e6 / seconds:.1f} MB/s)",
        file=sys.stdout,
    )
    return 0
