"""What the GGUF writer puts in a file where llama.cpp's graph is strict: a tied head written out where the graph
requires output.weight, grouped-query keys refused where it norms keys over the model's width, and a score scale
equal to the architecture's own default accepted (gptkit.formats.gguf.write and hparams)."""

from __future__ import annotations

import math

import pytest
import torch

from gptkit.config import ModelConfig
from gptkit.formats.gguf import GGUFError, export_gguf, load_gguf
from gptkit.model import GPT
from gptkit.presets import PRESETS
from gptkit.tokenizer import ByteTokenizer
from tests.formats.test_gguf_families import CONFIGS, random_model
from tests.formats.test_gguf_moe import CONFIGS as MOE_CONFIGS
from tests.formats.test_gguf_moe import random_model as random_moe_model

gguf = pytest.importorskip("gguf")
IDS = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(1))


def file_tensors(path) -> dict[str, torch.Tensor]:
    """The file's tensors (float32 ones only here) by GGUF name."""
    reader = gguf.GGUFReader(str(path))
    return {t.name: torch.from_numpy(t.data.copy()).reshape(tuple(reversed(t.shape.tolist()))) for t in reader.tensors}


def tiny_gemma3_preset(**change) -> dict:
    """gemma3-1b's fields at tiny sizes, keeping its heads of 256 and its attn_scale 256**-0.5."""
    fields = dict(PRESETS["gemma3-1b"], vocab_size=257, block_size=32, n_layer=6, n_embd=64, ffn_hidden=96)
    fields.update(sliding_window=4, embedding_scale=math.sqrt(64), layer_types=["sliding"] * 5 + ["full"])
    return dict(fields, **change)


@pytest.mark.parametrize("family", ["gptneox", "olmo2"])
def test_a_tied_head_is_written_as_a_copy_where_llama_cpps_graph_requires_output(family, tmp_path):
    model = random_model(dict(CONFIGS[family][1], tie_embeddings=True))
    path = export_gguf(model, tmp_path / "m.gguf", ByteTokenizer(), "f32")
    written = file_tensors(path)
    assert torch.equal(written["output.weight"], written["token_embd.weight"])
    back, _ = load_gguf(path)
    assert back.config.tie_embeddings  # equal tensors in a file of such an architecture read back as one, tied
    with torch.no_grad():
        assert torch.equal(back(IDS), model(IDS))


def test_a_tied_head_is_left_out_where_llama_cpp_falls_back_to_the_embedding(tmp_path):
    model = random_model(dict(CONFIGS["qwen3"][1], tie_embeddings=True))
    path = export_gguf(model, tmp_path / "m.gguf", ByteTokenizer(), "f32")
    assert "output.weight" not in file_tensors(path)
    assert load_gguf(path)[0].config.tie_embeddings


def test_grouped_query_olmoe_is_refused_naming_n_kv_head(tmp_path):
    model = random_moe_model(dict(MOE_CONFIGS["olmoe"], n_kv_head=2))
    with pytest.raises(GGUFError, match=r"^n_kv_head 2 cannot be written as GGUF: llama.cpp's olmoe norms the keys"):
        export_gguf(model, tmp_path / "m.gguf", ByteTokenizer(), "f32")
    assert not (tmp_path / "m.gguf").exists()


def test_gemma3_presets_attn_scale_equal_to_the_default_is_written(tmp_path):
    assert PRESETS["gemma3-1b"]["attn_scale"] == 256**-0.5 and PRESETS["gemma3-1b"]["head_dim"] == 256
    torch.manual_seed(0)
    model = GPT(ModelConfig(**tiny_gemma3_preset())).eval()
    path = export_gguf(model, tmp_path / "m.gguf", ByteTokenizer(), "f32")
    back, _ = load_gguf(path)
    assert back.config.attn_scale is None  # llama.cpp's default 1/sqrt(head_dim): the same scores
    with torch.no_grad():
        assert torch.equal(back(IDS), model(IDS))


def test_gemma3_with_another_attn_scale_is_still_refused(tmp_path):
    model = GPT(ModelConfig(**tiny_gemma3_preset(attn_scale=0.1))).eval()
    with pytest.raises(GGUFError, match="attn_scale 0.1 cannot be written as GGUF"):
        export_gguf(model, tmp_path / "m.gguf", ByteTokenizer(), "f32")
