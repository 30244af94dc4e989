"""A text data set: the input's token stream in train.bin, its tail in val.bin (see gptkit.data)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from gptkit.data import DataMeta
from gptkit.prepare.encoding import Cutter, encode_stream, no_text, progress_bar, token_dtype
from gptkit.prepare.inputs import Reader
from gptkit.prepare.meta import write_meta
from gptkit.prepare.options import PrepareConfig
from gptkit.prepare.readers import Piece
from gptkit.prepare.streams import READ_CHUNK
from gptkit.tokenizer import (
    EOT,
    Tokenizer,
)


def _split_tail(stage: Path, dtype: str, total: int, val_fraction: float, lengths: np.ndarray) -> tuple[int, int, int]:
    """Move the tail of stage/train.bin (the whole token stream) into val.bin; returns (train, val, val_bytes)."""
    train = int(total * (1.0 - val_fraction))  # as nanoGPT: the first 90% of the stream trains
    itemsize = np.dtype(dtype).itemsize
    val_bytes = 0
    with open(stage / "train.bin", "rb+") as src, open(stage / "val.bin", "wb") as dst:
        src.seek(train * itemsize)
        while chunk := src.read(READ_CHUNK // 4 * itemsize):
            dst.write(chunk)
            val_bytes += int(lengths[np.frombuffer(chunk, dtype=dtype)].sum())
        src.truncate(train * itemsize)
        for f in (src, dst):
            f.flush()
            os.fsync(f.fileno())
    return train, total - train, val_bytes


def write_text_set(
    stage: Path,
    files: list[Path],
    reader: Reader,
    tokenizer: Tokenizer,
    config: PrepareConfig,
    progress: bool,
    total_input: int,
    started: float,
) -> DataMeta:
    """Encode the input into stage: train.bin, val.bin, the tokenizer, and meta.json last; returns the meta."""
    dtype = token_dtype(tokenizer.vocab_size)
    cutter = Cutter(tokenizer.cut_points)
    total_tokens = 0
    text_bytes = 0
    with open(stage / "train.bin", "wb") as sink, progress_bar(total_input, "encoding", progress) as bar:
        reader.on_bytes = bar.update

        def counted(pieces: Iterable[Piece]) -> Iterator[Piece]:
            nonlocal text_bytes
            for piece in pieces:
                text_bytes += len(piece.text.encode("utf-8"))
                yield piece

        for ids in encode_stream(tokenizer, counted(cutter(reader)), tokenizer.eos_id):
            sink.write(ids.astype(dtype))
            total_tokens += len(ids)
    if total_tokens == 0:
        raise no_text(files)
    train, val, val_bytes = _split_tail(stage, dtype, total_tokens, config.val_fraction, tokenizer.token_byte_lengths())
    tokenizer.save(stage)
    own = {
        "train_tokens": train,
        "val_tokens": val,
        "train_bytes": text_bytes - val_bytes,
        "val_bytes": val_bytes,
        "separator": EOT if tokenizer.eos_id is not None and reader.documents > 1 else None,
        "documents": reader.documents,
        "forced_cuts": cutter.forced,
        "inputs": reader.inputs,
    }
    return write_meta(stage, own, tokenizer, dtype, config, started)
