"""YaRN in GGUF (gptkit.formats.gguf.rope): llama.cpp's converter's file of a transformers Qwen3 with YaRN gives
transformers' logits in gptkit past the original context, gptkit's own yarn file reads back alike (and through the gguf
package with llama.cpp's keys), llama.cpp decodes it as gptkit does, and what llama.cpp computes otherwise is refused
by name."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gptkit.config import RopeScaling
from gptkit.formats.gguf import GGUFError, export_gguf, load_gguf
from gptkit.positions import attention_factor
from gptkit.tokenizer import BPETokenizer, ByteTokenizer
from tests.formats.test_gguf import TEXT
from tests.formats.test_gguf_families import CONFIGS, LLAMA, converted, random_model
from tests.formats.test_gguf_read import rewritten, tiny_llama_file
from tests.formats.test_llama_cpp_runtime import ATOL, F32_ATOL, check_same_decode, llama_cpp_binary

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
V = 300
# rope_theta 10 and head_dim 32 put YaRN's ramp over dimensions 0 to 7 of 16 (not all at one end), and an original
# context of 16 puts most of the 64 positions past it.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
QWEN3 = {
    "vocab_size": V,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 64,
    "rope_parameters": {**YARN, "rope_theta": 10.0},
}
# gptkit configs (block_size 32: the runtime test's prompt and new tokens) with YaRN over an original context of 16.
SMALL = {"rope_scaling": {**YARN}, "rope_theta": 10.0}
FAMILIES = {
    "qwen3": dict(CONFIGS["qwen3"][1], head_dim=16, **SMALL),
    "llama": dict(LLAMA, **SMALL),  # interleaved pairs in llama.cpp
    "gptneox": dict(CONFIGS["gptneox"][1], **SMALL),  # partial rotary: the ramp over the rotated dimensions only
    "gemma2": dict(CONFIGS["gemma2"][1], **SMALL),  # its sliding layers take the full layers' RoPE in llama.cpp
}
ORIGINAL = {"original_max_position_embeddings": 8}
ATTENTION = {
    "derived": {},
    "given": {"attention_factor": 1.3},
    "mscale": {"mscale": 1.0, "mscale_all_dim": 0.5},  # DeepSeek's ratio, written as the factor it computes
}


def hf_qwen3(folder: Path, rope: dict) -> torch.nn.Module:
    """A tiny random transformers Qwen3 with rope's parameters, saved with a BPE tokenizer in folder."""
    from gptkit.formats.hf.tokenizer import write_hf_tokenizer

    torch.manual_seed(0)
    config = transformers.Qwen3Config(**{**QWEN3, "rope_parameters": rope})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm = param.dim() == 1
            param.normal_(1.0 if is_norm else 0.0, 0.1 if is_norm else 0.2)
    model.save_pretrained(folder)
    write_hf_tokenizer(BPETokenizer.train([TEXT], V), folder)
    return model


@pytest.mark.slow  # llama.cpp's converter: about a minute on a busy core
def test_llama_cpps_file_of_a_yarn_qwen3_gives_transformers_logits_past_the_original_context(tmp_path):
    hf = hf_qwen3(tmp_path / "hf", QWEN3["rope_parameters"])
    path = converted(tmp_path / "hf", tmp_path / "c.gguf")
    fields = {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items() if ".rope.scaling." in k}
    assert fields == {
        "qwen3.rope.scaling.type": "yarn",
        "qwen3.rope.scaling.factor": 4.0,
        "qwen3.rope.scaling.original_context_length": 16,
    }
    model, _ = load_gguf(path)
    assert model.config.rope_scaling == RopeScaling("yarn", 4.0, 16)
    ids = torch.randint(0, V, (2, 64))
    with torch.no_grad():
        # fp32 on both sides; measured 0 (and 2.4 with the attention factor left at 1, 8.6 with the original context
        # read as context_length)
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_llama_cpps_file_whose_yarn_attn_factor_its_qwen3_ignores_is_refused_by_name(tmp_path):
    # the converter writes HF's attention_factor as yarn_attn_factor, which llama.cpp's qwen3 never reads: it
    # scales by 0.1 ln(4) + 1 = 1.139, transformers by 1.3
    hf_qwen3(tmp_path / "hf", {**QWEN3["rope_parameters"], "attention_factor": 1.3})
    path = converted(tmp_path / "hf", tmp_path / "c.gguf")
    with pytest.raises(
        GGUFError,
        match="metadata 'qwen3.rope.scaling.yarn_attn_factor' is 1.3, but llama.cpp's qwen3 reads no such key",
    ):
        load_gguf(path)


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("family", FAMILIES)
def test_gptkits_yarn_file_reads_back_alike_with_llama_cpps_keys(family, attention, tmp_path):
    fields = dict(FAMILIES[family], rope_scaling={**YARN, **ATTENTION[attention]})
    model = random_model(fields)
    path = export_gguf(model, tmp_path / "m.gguf", ByteTokenizer(), "f32")
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    keys = {k.removeprefix(f"{arch}."): f.contents() for k, f in reader.fields.items() if ".rope.scaling." in k}
    want = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 16}
    assert {k: keys[k] for k in want} == want
    # llama.cpp scales cos and sin by attn_factor times its own 0.1 ln(factor) + 1 (src/llama-context.cpp)
    derived = 0.1 * math.log(4.0) + 1
    attn = keys.get("rope.scaling.attn_factor", 1.0)
    assert attn * derived == pytest.approx(attention_factor(model.config, 0), rel=1e-6)
    assert (attn == 1.0) == (attention == "derived")
    back, _ = load_gguf(path)
    ids = torch.randint(0, 257, (2, 32))
    with torch.no_grad():
        # an attention factor read back as attn_factor (float32) times the derived one: 1e-7 relative apart
        torch.testing.assert_close(back(ids), model(ids), atol=1e-5, rtol=1e-5)
    assert json.dumps(back.config.to_dict(), sort_keys=True)


@pytest.mark.parametrize("family", ["qwen3", "llama", "gptneox"])
def test_llama_cpp_decodes_gptkits_yarn_file_as_gptkit_does(family, tmp_path):
    llama_cpp_binary("llama-greedy")
    model = random_model(dict(FAMILIES[family], rope_scaling={**YARN, "attention_factor": 1.3}))
    check_same_decode(model, "f32", tmp_path, ATOL.get(family, F32_ATOL))  # GPT-NeoX: llama.cpp's GELU table


@pytest.mark.parametrize(
    "family, scaling, message",
    [
        ("qwen3", {"rope_type": "dynamic", "factor": 4.0}, "rope_scaling 'dynamic' cannot be written as GGUF"),
        ("qwen3", {**YARN, "beta_fast": 16.0}, "rope_scaling.beta_fast 16.0 cannot be written as GGUF: llama.cpp's"),
        ("qwen3", {**YARN, "beta_slow": 2.0}, "rope_scaling.beta_slow 2.0 cannot be written as GGUF"),
        ("qwen3", {**YARN, "truncate": False}, "rope_scaling.truncate False cannot be written as GGUF"),
        (
            "gemma3",
            YARN,
            "rope_scaling 'yarn' cannot be written as GGUF: llama.cpp's gemma3 scales its sliding layers' cos",
        ),
        ("olmo2", {"rope_type": "linear", "factor": 2.0}, "llama.cpp's olmo2 leaves its sliding layers unscaled"),
        ("phi3", {**YARN, "rope_type": "longrope", "short_factor": [1.0, 1.0], "long_factor": [2.0, 2.0]}, "phi3"),
        (
            "llama3",
            {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4, **ORIGINAL},
            "rope_scaling.long_factor cannot be written as GGUF",
        ),
        (  # longrope's attention factor derived from block_size / original: sqrt(1 + ln 4 / ln 8)
            "llama3",
            {"rope_type": "longrope", "short_factor": [2.0] * 4, "long_factor": [2.0] * 4, **ORIGINAL},
            "rope_scaling 'longrope' cannot be written as GGUF: llama.cpp's llama scales cos and sin by none",
        ),
    ],
)
def test_what_llama_cpp_computes_otherwise_is_refused_by_field(family, scaling, message, tmp_path):
    fields = dict(CONFIGS[family][1], rope_scaling=scaling)
    if family == "olmo2":
        fields.update(sliding_window=4, layer_types=["sliding", "full"] * 2)
    with pytest.raises(GGUFError, match=message):
        export_gguf(random_model(fields), tmp_path / "m.gguf", ByteTokenizer(), "f32")
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize(
    "added, message",
    [
        (
            {"llama.rope.scaling.type": ("yarn", "STRING"), "llama.rope.scaling.yarn_beta_fast": (16.0, "FLOAT32")},
            "'llama.rope.scaling.yarn_beta_fast' is 16.0, but llama.cpp's llama reads no such key",
        ),
        ({"llama.rope.scaling.attn_factor": (0.5, "FLOAT32")}, "'llama.rope.scaling.attn_factor' is 0.5 with 'linear'"),
    ],
)
def test_a_yarn_key_llama_cpp_computes_otherwise_is_refused_by_name(added, message, tmp_path):
    source = tiny_llama_file(tmp_path)
    path = rewritten(source, tmp_path / "x.gguf", {k: (v, gguf.GGUFValueType[t]) for k, (v, t) in added.items()}, {})
    with pytest.raises(GGUFError, match=message):
        load_gguf(path)


@pytest.mark.parametrize("family, kind", [("olmo2", "linear"), ("gemma3", "yarn")])
def test_a_file_whose_sliding_layers_llama_cpp_scales_otherwise_is_refused(family, kind, tmp_path):
    fields = dict(CONFIGS[family][1])
    if family == "olmo2":
        fields.update(sliding_window=4, layer_types=["sliding", "full"] * 2)
    source = export_gguf(random_model(fields), tmp_path / "m.gguf", ByteTokenizer(), "f32")
    added = {f"{family}.rope.scaling.type": (kind, "STRING"), f"{family}.rope.scaling.factor": (2.0, "FLOAT32")}
    path = rewritten(source, tmp_path / "x.gguf", {k: (v, gguf.GGUFValueType[t]) for k, (v, t) in added.items()}, {})
    with pytest.raises(GGUFError, match=f"'{family}.rope.scaling.type' '{kind}' with sliding layers: llama.cpp's"):
        load_gguf(path)
