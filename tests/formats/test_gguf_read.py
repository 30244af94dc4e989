"""Reading GGUF: a tensor or metadata key that gptkit does not map to its model is refused by name, never dropped
(a Llama 3 file's rope_freqs.weight dropped is Llama 3 without its RoPE scaling)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import VARIANTS

from gptkit.cli import main
from gptkit.config import ModelConfig
from gptkit.formats.gguf import GGUFError, export_gguf, load_gguf
from gptkit.model import GPT
from gptkit.tokenizer import ByteTokenizer

gguf = pytest.importorskip("gguf")


def tiny_llama_file(folder: Path) -> Path:
    torch.manual_seed(0)
    model = GPT(ModelConfig(**{**VARIANTS["llama-gqa"], "vocab_size": 257})).eval()
    return export_gguf(model, folder / "m.gguf", ByteTokenizer(), "f32")


def rewritten(source: Path, out: Path, fields: dict[str, tuple[Any, Any]], tensors: dict[str, np.ndarray]) -> Path:
    """source with fields (key -> (value, GGUFValueType)) and f32 tensors added, through the gguf package."""
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":  # the header's own, written by the writer
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    for name, (value, kind) in fields.items():
        writer.add_key_value(name, value, kind)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    for name, array in tensors.items():
        writer.add_tensor(name, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_a_copy_of_an_exported_file_loads_as_the_original(tmp_path):
    path = tiny_llama_file(tmp_path)
    copy = rewritten(path, tmp_path / "copy.gguf", {}, {})
    ids = torch.randint(0, 257, (1, 9))
    with torch.no_grad():
        assert torch.equal(load_gguf(copy)[0](ids), load_gguf(path)[0](ids))


@pytest.mark.parametrize("name, rows", [("blk.0.ffn_gate_inp.weight", 4), ("rope_freqs.weight", 4)])
def test_a_tensor_gptkit_does_not_map_is_refused_by_name_not_dropped(name, rows, tmp_path, capsys):
    # an expert router (a MoE llama) is no tensor gptkit's llama has; rope_freqs.weight (Llama 3's RoPE scaling as
    # per-frequency divisors) is one llama.cpp's gpt2 never reads
    variant = "llama-gqa" if name.startswith("blk") else "gpt2"
    torch.manual_seed(0)
    model = GPT(ModelConfig(**{**VARIANTS[variant], "vocab_size": 257})).eval()
    source = export_gguf(model, tmp_path / "m.gguf", ByteTokenizer(), "f32")
    path = rewritten(source, tmp_path / "x.gguf", {}, {name: np.ones((rows, 32) if name.startswith("blk") else rows)})
    with pytest.raises(GGUFError, match=f"tensor {name}"):
        load_gguf(path)
    assert main(["convert", "--from-gguf", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert name in err and err.count("\n") == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "key, value, kind",
    [
        ("llama.rope.scaling.type", "longrope", "STRING"),  # Phi-3's: its rope_factors_long/short tensors
        ("llama.rope.scaling.made_up", 1.0, "FLOAT32"),  # a key llama.cpp itself does not define
        ("llama.rope.scaling.attn_factor", 0.5, "FLOAT32"),
        ("llama.attention.sliding_window", 4, "UINT32"),
        ("llama.expert_shared_count", 1, "UINT32"),  # a key gptkit maps onto no model
    ],
)
def test_metadata_gptkit_does_not_map_is_refused_by_name(key, value, kind, tmp_path, capsys):
    path = rewritten(tiny_llama_file(tmp_path), tmp_path / "x.gguf", {key: (value, gguf.GGUFValueType[kind])}, {})
    with pytest.raises(GGUFError, match=f"metadata '{key}'"):
        load_gguf(path)
    assert main(["generate", str(path), "--prompt", "a", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert key in err and err.count("\n") == 1


def test_metadata_that_changes_nothing_computed_is_accepted(tmp_path):
    inert = {
        "general.license": ("mit", gguf.GGUFValueType.STRING),
        "tokenizer.ggml.padding_token_id": (0, gguf.GGUFValueType.UINT32),
    }
    path = rewritten(tiny_llama_file(tmp_path), tmp_path / "x.gguf", inert, {})
    assert load_gguf(path)[0].config.n_layer == VARIANTS["llama-gqa"]["n_layer"]
