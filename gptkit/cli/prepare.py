"""`gptkit prepare`: tokenize text files, directories or JSONL into a data directory for training."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from gptkit.errors import InputError

# Flag names for PrepareConfig fields whose flag is not simply --field-name.
FLAG_NAMES = {"inputs": "--input"}


# Shown by `gptkit --help`, which imports no command's dependencies.
HELP = "tokenize text into train.bin / val.bin / meta.json for training"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `prepare` sub-command; its flags are generated from PrepareConfig."""
    from gptkit.prepare import PrepareConfig

    parser = subparsers.add_parser(
        "prepare",
        help=HELP,
        description="Tokenize text files, directories (recursively) and JSONL files (a 'text' field per line) "
        "into DATA_DIR/train.bin, val.bin, the tokenizer files and meta.json. With no --input, the bundled tiny "
        "shakespeare is used.",
    )
    for f in dataclasses.fields(PrepareConfig):
        flag = FLAG_NAMES.get(f.name, "--" + f.name.replace("_", "-"))
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        options: dict = {"dest": f.name, "help": f.metadata["help"]}
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            options["required"] = True
        else:
            # Unset flags stay absent so that run() can tell an explicit --vocab-size from the default.
            options["default"] = argparse.SUPPRESS
            options["help"] += f" (default: {default})" if default not in (None, []) else ""
        if f.name == "inputs":
            options["action"] = "append"
        elif f.type in ("int", int):
            options["type"] = int
        elif f.type in ("float", float):
            options["type"] = float
        if f.name == "errors":
            options["choices"] = ["strict", "replace"]
        parser.add_argument(flag, metavar=f.metadata.get("metavar"), **options)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Prepare the data directory and print a one-line summary."""
    from gptkit.prepare import PrepareConfig, prepare

    names = {f.name for f in dataclasses.fields(PrepareConfig)}
    config = PrepareConfig(**{k: v for k, v in vars(args).items() if k in names})
    if "vocab_size" in vars(args) and config.tokenizer != "bpe":
        raise InputError("--vocab-size applies only to --tokenizer bpe (char and byte vocabularies are fixed)")
    started = time.perf_counter()
    meta = prepare(config, progress=True)
    seconds = time.perf_counter() - started
    read = sum(i["bytes"] for i in meta["inputs"])
    print(
        f"wrote {config.out}: {meta['tokenizer']} vocabulary {meta['vocab_size']:,}, "
        f"train {meta['train_tokens']:,} tokens, val {meta['val_tokens']:,} tokens ({meta['dtype']}), "
        f"{len(meta['inputs'])} file(s), {read / 1e6:.1f} MB in {seconds:.1f} s ({read / 1e6 / seconds:.1f} MB/s)",
        file=sys.stdout,
    )
    return 0
