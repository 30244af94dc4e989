"""`gptkit prepare`'s driver: text, JSONL, CSV, Parquet (plain or compressed; see gptkit.prepare.inputs) in; train.bin, val.bin,
the tokenizer and meta.json out.

The input is streamed: it is read in chunks, cut into pieces at places where cutting cannot change the
encoding, encoded a batch of pieces at a time (on every core for BPE) and appended to one token file, so memory
stays flat however large the corpus. Documents (each text file, each JSONL line, CSV or Parquet row) are
separated by the end-of-text token. The last val_fraction of the token stream is then moved to val.bin.

The new data set is written into a staging directory beside the output directory, meta.json last, and swapped
in only when complete (gptkit.atomic.replace_dir: one atomic exchange of the two directories where the system
has one), so a failure or a kill at any instant leaves the previous data set usable; files of the user's in the
output directory stay there. The next run finishes a swap a kill interrupted and deletes what killed runs left.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from gptkit.atomic import building_dir, sweep_staging
from gptkit.chat import TOKENIZER_CONFIG
from gptkit.data import EXAMPLE_FILES, META_FILE, PROMPT_FILES, PROMPT_KIND, SPLIT_FILES, DataMeta
from gptkit.data_kinds import SUPERVISED
from gptkit.errors import InputError
from gptkit.prepare.encoding import tokenizer_for
from gptkit.prepare.examples import example_kind, row_formats, write_examples
from gptkit.prepare.inputs import Reader, resolve_inputs
from gptkit.prepare.options import DEFAULT_CORPUS, PrepareConfig
from gptkit.prepare.prompts import write_prompts
from gptkit.prepare.text import write_text_set
from gptkit.tokenizer import (
    GPTKIT_FILE,
    HF_FILE,
)

logger = logging.getLogger(__name__)

# The files a data set is made of; anything else found in an output directory is the user's and stays there.
DATA_FILES = {
    META_FILE,
    *SPLIT_FILES.values(),
    *(n for f in EXAMPLE_FILES.values() for n in f.values()),
    *(f["rows"] for f in PROMPT_FILES.values()),
    GPTKIT_FILE,
    HF_FILE,
    TOKENIZER_CONFIG,
}


def _owned(out: Path) -> Callable[[str], bool]:
    """Whether a name in out belongs to its data set: a file prepare writes (its meta.json lists them) or a
    temporary an older prepare left."""
    names = set(DATA_FILES)
    try:
        listed = json.loads((out / META_FILE).read_text(encoding="utf-8")).get("files", [])
        names.update(n for n in listed if isinstance(n, str))
    except (OSError, ValueError, AttributeError):
        pass
    return lambda name: name in names or (name.startswith(".") and name.endswith(".tmp"))


def _sweep(out: Path) -> None:
    """Remove what killed runs left: staging directories, and the temporary files of older gptkit versions."""
    sweep_staging(out)
    if out.is_dir():
        prefixes = tuple(
            f".{name}." for name in (*DATA_FILES, "tokens", "examples")
        )  # atomic_write's, and the streams'
        for path in out.glob(".*.tmp"):
            if path.is_file() and path.name.startswith(prefixes):
                path.unlink(missing_ok=True)


def prepare(config: PrepareConfig, progress: bool = False) -> DataMeta:
    """Tokenize the configured inputs into config.out; returns the meta.json written there.

    The new data set is built in a staging directory and swapped in only once complete (see the module's
    docstring), so a failure or a kill at any point leaves the previous one usable.
    """
    config.validate()
    started = time.perf_counter()
    files = resolve_inputs(config.inputs or [str(DEFAULT_CORPUS)], config.glob)
    total_input = sum(p.stat().st_size for p in files)
    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} exists and is not a directory")
    out = out.resolve()  # a symlinked data directory is replaced where it lives
    _sweep(out)

    formats = row_formats(files, config)
    if any(fmt in SUPERVISED for fmt in formats.values()):
        write = write_prompts if example_kind(files, formats) == PROMPT_KIND else write_examples
        return _publish(out, config.out, lambda stage: write(stage, config, files, formats, started, progress))
    reader = Reader(files, config.errors, config.text_field)
    tokenizer = tokenizer_for(config.tokenizer, config, reader, progress, total_input)
    if config.tokenizer == "bpe" and tokenizer.vocab_size < config.vocab_size:
        logger.warning("the corpus allowed only %d BPE tokens (asked for %d)", tokenizer.vocab_size, config.vocab_size)
    return _publish(
        out,
        config.out,
        lambda stage: write_text_set(stage, files, reader, tokenizer, config, progress, total_input, started),
    )


def _publish(out: Path, name: str, write: Callable[[Path], DataMeta]) -> DataMeta:
    """Have write() build a data set in a staging directory (meta.json last), then swap it in for out's.

    A failed write (a full disk, say) leaves the previous data set untouched and is one line naming `name`."""
    with building_dir(name, META_FILE, _owned(out), what="data set") as stage:  # (name resolves to out)
        return write(stage)
