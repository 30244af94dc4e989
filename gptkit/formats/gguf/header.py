"""A GGUF file opened through the gguf package, its header and the layout of its tensors checked first, and its
metadata read as Python values: every problem is a one-line GGUFError naming the file (and tensor or key)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.formats.gguf.vocab import GGUFError


def gguf_package() -> Any:
    try:
        import gguf
    except ImportError:
        raise GGUFError("GGUF needs the gguf package: pip install 'gptkit[gguf]'") from None
    return gguf


def is_gguf_file(path: str | Path) -> bool:
    """Whether path is a file that starts with GGUF's magic bytes."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def open_gguf(path: str | Path) -> Any:
    """A gguf.GGUFReader over path, its header and the layout of its tensors checked first: the reader maps bytes
    as the header says, so a truncated file otherwise fails in numpy ("cannot reshape array of size ...") and a
    wrong type field reads as garbage weights. Any problem is a one-line GGUFError naming the file (and tensor)."""
    gguf = gguf_package()
    path = Path(path)

    class CheckedReader(gguf.GGUFReader):  # hooks into two internal steps, alike in gguf 0.10 (our oldest) to 0.19
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > len(self.data):  # numpy would hand back a short slice, which fails later with its own words
                raise GGUFError(
                    f"{path} is truncated or its header is corrupt: the header runs to byte {end:,} of a "
                    f"{len(self.data):,}-byte file; download or convert it again"
                )
            return super()._get(offset, dtype, count, override_order)

        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            tensors = [_tensor_entry(gguf, path, field) for field in fields]
            _check_layout(path, tensors, int(start_offs), len(self.data), int(self.alignment))
            super()._build_tensors(start_offs, fields)

    try:
        return CheckedReader(str(path))
    except UnicodeDecodeError:
        raise GGUFError(
            f"{path} is not a readable GGUF file: its header holds a name that is not UTF-8 text (a damaged file?)"
        ) from None
    except (ValueError, OSError, IndexError, KeyError) as err:  # the gguf package's own checks (magic, version, ...)
        raise GGUFError(f"{path} is not a readable GGUF file: {err}") from None


def _tensor_entry(gguf: Any, path: Path, field: Any) -> tuple[str, str, tuple[int, ...], int, int]:
    """(name, type name, shape as gptkit orders it, data offset, data bytes) of a tensor's entry in the header."""
    _, name_bytes, _, dims, raw_type, offset = field.parts
    name = bytes(name_bytes).decode("utf-8", errors="replace")
    shape = tuple(int(n) for n in reversed(dims.tolist()))
    try:
        kind = gguf.GGMLQuantizationType(int(raw_type[0]))
        block, type_size = gguf.GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):
        raise GGUFError(
            f"{path}: tensor {name} has type {int(raw_type[0])}, which the gguf package does not know "
            "(a corrupt header, or a newer type: upgrade gguf)"
        ) from None
    if shape and shape[-1] % block:
        raise GGUFError(
            f"{path}: tensor {name} ({kind.name.lower()}, shape {list(shape)}) has rows that are not whole "
            f"{block}-value blocks; its type or shape field is wrong"
        )
    return name, kind.name.lower(), shape, int(offset[0]), math.prod(shape) // block * type_size


def _check_layout(
    path: Path, tensors: list[tuple[str, str, tuple[int, ...], int, int]], start: int, size: int, alignment: int
) -> None:
    """Refuse, naming the tensor, data that do not fill the bytes the header gives them. GGUF (and llama.cpp's
    loader) packs tensors in header order, each padded to the alignment: a type or shape field that claims fewer or
    more bytes than the data hold shows as the next tensor starting elsewhere, and a truncated file as a tensor
    running past its end."""
    expected = 0
    for i, (name, kind, shape, offset, length) in enumerate(tensors):
        described = f"{path}: tensor {name} ({kind}, shape {list(shape)}) needs {length:,} bytes"
        if offset != expected:
            if i == 0:
                raise GGUFError(f"{path}: tensor {name} starts at data offset {offset:,}, not 0: the header is corrupt")
            previous, kind_before, shape_before, offset_before, length_before = tensors[i - 1]
            raise GGUFError(
                f"{path}: tensor {previous} ({kind_before}, shape {list(shape_before)}) needs "
                f"{length_before:,} bytes but the next tensor starts {offset - offset_before:,} bytes "
                "after it: its type or shape field does not match its data"
            )
        if start + offset + length > size:
            raise GGUFError(
                f"{described} but the file ends {max(size - start - offset, 0):,} bytes into it: the file "
                "is truncated; download or convert it again"
            )
        expected = offset + -(-length // alignment) * alignment
    if tensors and size - (start + tensors[-1][3] + tensors[-1][4]) >= alignment:
        name, kind, shape, offset, length = tensors[-1]
        raise GGUFError(
            f"{path}: tensor {name} ({kind}, shape {list(shape)}) needs {length:,} bytes but "
            f"{size - start - offset:,} bytes follow it to the end of the file: its type or shape field "
            "does not match its data (or something was appended to the file)"
        )


def read_fields(reader: Any, path: Path, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The file's metadata (or those of keys it holds) as Python values; a value that does not decode is a
    GGUFError naming its key."""
    fields = {}
    for name, field in reader.fields.items():
        if keys is not None and name not in keys:
            continue
        try:
            fields[name] = field.contents()
        except (ValueError, IndexError) as err:  # UnicodeDecodeError is a ValueError
            raise GGUFError(
                f"{path}: metadata {name!r} is corrupt ({type(err).__name__}); the file is damaged"
            ) from None
    return fields
