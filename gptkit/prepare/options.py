"""`gptkit prepare`'s options (the CLI flags are generated from PrepareConfig's fields) and their defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptkit.errors import InputError

DEFAULT_CORPUS = Path(__file__).resolve().parents[1] / "corpora" / "tinyshakespeare.txt"


DEFAULT_MAX_LENGTH = 1024  # supervised examples' length limit when no model gives its context


SPLIT_SEED = 1337  # which supervised examples go to val.bin: a fixed draw, so that a re-prepare gives the same split


def _flag(help: str, metavar: str | None = None) -> dict[str, Any]:
    """Field metadata from which gptkit.cli.flags generates a flag."""
    return {"help": help, "metavar": metavar}


@dataclass
class PrepareConfig:
    """Options of `gptkit prepare`; the CLI flags are generated from these fields."""

    out: str = field(metadata=_flag("the data directory to write (created if missing)", "DATA_DIR"))
    inputs: list[str] = field(
        default_factory=list,
        metadata=_flag(
            "a file (text, .jsonl, .csv, .tsv, .parquet; also .gz, .xz, .bz2 or .zst compressed) or a "
            "directory of them (searched recursively); repeatable (default: the bundled tiny shakespeare)",
            "PATH",
        )
        | {"flag": "--input", "repeatable": True},
    )
    tokenizer: str = field(
        default="char",
        metadata=_flag(
            "char, byte, bpe (trained on the input) or a directory holding a tokenizer", "char|byte|bpe|DIR"
        ),
    )
    vocab_size: int = field(default=4096, metadata=_flag("vocabulary size of a trained bpe tokenizer", "N"))
    val_fraction: float = field(
        default=0.1, metadata=_flag("share of the token stream, at its end, kept for validation", "F")
    )
    glob: str | None = field(
        default=None, metadata=_flag("file name pattern inside input directories (default: every text file)", "PATTERN")
    )
    text_field: str = field(
        default="text",
        metadata=_flag("the JSONL field, or the CSV, TSV or Parquet column, that holds the text", "NAME"),
    )
    errors: str = field(
        default="strict",
        metadata=_flag("invalid UTF-8: strict (stop, naming file and offset) or replace (U+FFFD)")
        | {"choices": ["strict", "replace"]},
    )
    loss_on: str = field(
        default="completion",
        metadata=_flag(
            "supervised examples: train on the replies and completions only (completion) or on every token (all)"
        )
        | {"choices": ["completion", "all"]},
    )
    max_length: int | None = field(
        default=None,
        metadata=_flag(
            "supervised examples and prompts: the most tokens an example or prompt may have (default: "
            f"the context of the model given as --tokenizer, else {DEFAULT_MAX_LENGTH}); a longer prompt "
            "is dropped",
            "N",
        ),
    )
    overlong: str = field(
        default="truncate",
        metadata=_flag("supervised examples longer than --max-length: truncate (keep the start) or drop")
        | {"choices": ["truncate", "drop"]},
    )

    def validate(self) -> None:
        """Raise InputError for an option no run could use."""
        if not 0.0 <= self.val_fraction < 1.0:
            raise InputError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.errors not in ("strict", "replace"):
            raise InputError(f"--errors must be strict or replace, got {self.errors!r}")
        if self.vocab_size < 1:
            raise InputError(f"--vocab-size must be positive, got {self.vocab_size}")
        if self.max_length is not None and self.max_length < 2:
            raise InputError(f"--max-length must be at least 2 (a token and one to predict), got {self.max_length}")
