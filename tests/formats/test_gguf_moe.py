"""GGUF for mixtures of experts (issue 55): llama.cpp's llama with experts (Mixtral), qwen2moe (a shared expert),
qwen3moe and olmoe. llama.cpp's own converter's file of a tiny random transformers model gives transformers' logits
in gptkit; gptkit's export of the same model holds the converter's tensors and hyperparameters; and what llama.cpp's
graphs compute otherwise (a dense layer among expert ones, renormalised weights where it keeps softmax's) is refused
by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gptkit.config import ModelConfig
from gptkit.formats.gguf import GGUFError, export_gguf, gguf_tensors, load_gguf
from gptkit.model import GPT
from gptkit.tokenizer import BPETokenizer, ByteTokenizer
from tests.formats.test_gguf import TEXT, llama_cpp_converter
from tests.formats.test_gguf_families import CONVERT

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
V = 300
SHAPE = {
    "vocab_size": V,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "num_experts_per_tok": 2,
}
# Each family as llama.cpp's graph computes it: its qwen2moe and olmoe keep softmax's top-k weights, its qwen3moe
# renormalises them (norm_topk_prob; llama.cpp fixes both per architecture, no key says it).
FAMILIES = {
    "mixtral": ("MixtralConfig", "llama", dict(SHAPE, num_local_experts=4)),
    "qwen2moe": (
        "Qwen2MoeConfig",
        "qwen2moe",
        dict(SHAPE, num_experts=4, moe_intermediate_size=40, shared_expert_intermediate_size=56, norm_topk_prob=False),
    ),
    "qwen3moe": (
        "Qwen3MoeConfig",
        "qwen3moe",
        dict(SHAPE, num_experts=4, moe_intermediate_size=32, head_dim=24, norm_topk_prob=True),
    ),
    # llama.cpp's olmoe norms keys over the whole width: it loads no grouped-query OLMoE (gptkit refuses to write one)
    "olmoe": (
        "OlmoeConfig",
        "olmoe",
        dict(SHAPE, num_key_value_heads=4, num_experts=4, norm_topk_prob=False, eos_token_id=None),
    ),
}
# Keys gptkit writes that llama.cpp's converter leaves to their defaults here (the same values).
OUR_EXTRA_KEYS = {"vocab_size", "attention.key_length", "attention.value_length", "rope.dimension_count"}


def hf_family(fields: tuple[str, dict], folder: Path) -> tuple[torch.nn.Module, Path]:
    """A tiny random transformers model (weights larger than its init's, so that routing matters), saved with a BPE
    tokenizer."""
    from gptkit.formats.hf.tokenizer import write_hf_tokenizer

    class_name, arguments = fields
    torch.manual_seed(0)
    config = getattr(transformers, class_name)(**arguments)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm = param.dim() == 1 and "bias" not in name
            param.normal_(1.0 if is_norm else 0.0, 0.1 if is_norm else 0.2)
    model.save_pretrained(folder)
    write_hf_tokenizer(BPETokenizer.train([TEXT], V), folder)
    return model, folder


def converted(hf_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """llama.cpp's convert_hf_to_gguf.py's file of hf_dir."""
    converter = llama_cpp_converter()
    if converter is None:
        pytest.skip("llama.cpp's converter is not unpacked (make test does it: make llama-converter)")
    command = [sys.executable, "-c", CONVERT, str(converter.parent), str(hf_dir), "--outfile", str(out)]
    done = subprocess.run([*command, "--outtype", outtype], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def file_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], np.ndarray]]:
    """A GGUF file's tensors as the gguf package reads them: name -> (type, shape as torch orders it, raw data)."""
    return {
        t.name: (t.tensor_type.name, tuple(int(n) for n in reversed(t.shape.tolist())), np.asarray(t.data))
        for t in gguf.GGUFReader(str(path)).tensors
    }


def arch_keys(path: Path, arch: str) -> dict[str, object]:
    """A GGUF file's "<arch>.*" metadata, without the prefix."""
    fields = gguf.GGUFReader(str(path)).fields
    return {key.removeprefix(f"{arch}."): f.contents() for key, f in fields.items() if key.startswith(f"{arch}.")}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpps_file_of_each_moe_family_gives_transformers_logits_and_ours_matches_it(family, tmp_path):
    from gptkit.formats.hf import gpt_from_hf_model

    class_name, arch, arguments = FAMILIES[family]
    hf, hf_dir = hf_family((class_name, arguments), tmp_path / "hf")
    theirs = converted(hf_dir, tmp_path / "theirs.gguf")
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(1))
    model, tokenizer = load_gguf(theirs)
    assert model.config.n_experts == 4
    with torch.no_grad():
        want = hf(ids).logits
        # fp32 on both sides: measured 0 (qwen3moe, olmoe) to 1.9e-6 (qwen2moe); a token routed to another expert
        # would differ by about 0.1
        torch.testing.assert_close(model(ids), want, atol=1e-4, rtol=0)
    # gptkit's export of the same model (imported from transformers, not read from their file) holds their file's
    # tensors, bit for bit, in the same types, and their hyperparameters
    ours = export_gguf(gpt_from_hf_model(hf), tmp_path / "ours.gguf", tokenizer, "f32")
    mine, reference = file_tensors(ours), file_tensors(theirs)
    assert mine.keys() == reference.keys()
    for name, (kind, shape, data) in reference.items():
        assert mine[name][:2] == (kind, shape), name
        assert np.array_equal(mine[name][2], data), name
    our_keys, their_keys = arch_keys(ours, arch), arch_keys(theirs, arch)
    assert set(our_keys) - set(their_keys) <= OUR_EXTRA_KEYS
    assert {key: our_keys[key] for key in their_keys} == their_keys
    back, _ = load_gguf(ours)
    with torch.no_grad():
        torch.testing.assert_close(back(ids), want, atol=1e-4, rtol=0)  # as above


@pytest.mark.slow
def test_ours_q8_0_file_types_each_tensor_as_llama_cpps_converter_does(tmp_path):
    class_name, _, arguments = FAMILIES["qwen2moe"]
    hf, hf_dir = hf_family((class_name, arguments), tmp_path / "hf")
    theirs = converted(hf_dir, tmp_path / "theirs.gguf", "q8_0")
    model, tokenizer = load_gguf(theirs)
    ours = export_gguf(model, tmp_path / "ours.gguf", tokenizer, "q8_0")
    kinds = {name: kind for name, (kind, _, _) in file_tensors(theirs).items()}
    assert {name: kind for name, (kind, _, _) in file_tensors(ours).items()} == kinds
    assert kinds["blk.0.ffn_gate_exps.weight"] == "Q8_0" and kinds["blk.0.ffn_gate_inp.weight"] == "F32"


# gptkit configs of each architecture, built directly (no transformers, no converter): the fast cases.
LLAMA = dict(
    vocab_size=257,
    block_size=32,
    n_layer=2,
    n_head=4,
    n_kv_head=2,
    n_embd=64,
    ffn_hidden=64,
    norm="rmsnorm",
    position="rope",
    activation="swiglu",
    attn_bias=False,
    mlp_bias=False,
    norm_bias=False,
    tie_embeddings=False,
    n_experts=4,
    n_experts_per_token=2,
)
CONFIGS = {
    "llama": dict(LLAMA, moe_aux_loss=0.01, moe_z_loss=0.001),  # training's losses: written as nothing
    "qwen2moe": dict(
        LLAMA, attn_bias=True, moe_ffn_hidden=32, moe_shared_hidden=96, moe_shared_gate=True, moe_renormalize=False
    ),
    "qwen3moe": dict(LLAMA, qk_norm=True, head_dim=24, moe_ffn_hidden=32),
    # llama.cpp's olmoe norms keys over the model's width: no grouped-query keys (test_gguf_write: refused)
    "olmoe": dict(LLAMA, n_kv_head=4, qk_norm=True, qk_norm_scope="width", moe_renormalize=False),
}


def random_model(fields: dict) -> GPT:
    torch.manual_seed(0)
    model = GPT(ModelConfig(**fields)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0, 0.0 if name.endswith("attn.proj.bias") else 0.3)  # Qwen2's output projection: none
    return model


@pytest.mark.parametrize("arch", CONFIGS)
def test_each_moe_architectures_export_reads_back_with_the_same_logits(arch, tmp_path):
    model = random_model(CONFIGS[arch])
    path = export_gguf(model, tmp_path / "m.gguf", ByteTokenizer(), "f32")
    assert gguf.GGUFReader(str(path)).fields["general.architecture"].contents() == arch
    written = file_tensors(path)
    for name, tensor in gguf_tensors(model).items():  # what the gguf package reads is what gptkit wrote
        assert np.array_equal(written[name][2].reshape(written[name][1]), tensor.numpy()), name
    assert written["blk.1.ffn_gate_exps.weight"][1] == (4, model.config.expert_hidden, 64)
    assert written["blk.1.ffn_down_exps.weight"][1] == (4, 64, model.config.expert_hidden)
    back, _ = load_gguf(path)
    ids = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))  # the same float32 weights in the same places
    assert back.config.moe_renormalize == model.config.moe_renormalize
    assert back.config.moe_aux_loss == 0.0


@pytest.mark.parametrize("file_type, tolerance", [("q8_0", 0.1), ("q4_0", 1.0)])
def test_quantised_expert_stacks_are_written_in_the_file_type_and_routers_in_float32(file_type, tolerance, tmp_path):
    model = random_model(CONFIGS["qwen3moe"])
    path = export_gguf(model, tmp_path / "m.gguf", ByteTokenizer(), file_type)
    written = file_tensors(path)
    assert written["blk.0.ffn_up_exps.weight"][0] == file_type.upper()
    assert written["blk.0.ffn_down_exps.weight"][0] == file_type.upper()
    assert written["blk.0.ffn_gate_inp.weight"][0] == "F32"
    back, _ = load_gguf(path)
    ids = torch.randint(0, 257, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = model(ids), back(ids)
    # measured largest logit differences on this model: q8_0 0.032, q4_0 0.39 (its logits' std is 0.64)
    assert (got - want).abs().max() < tolerance
    assert torch.equal(back.blocks[0].mlp.router.weight, model.blocks[0].mlp.router.weight)


@pytest.mark.parametrize(
    "arch, change, message",
    [
        ("llama", {"moe_renormalize": False}, "moe_renormalize False cannot be written as GGUF: llama.cpp's llama"),
        ("olmoe", {"moe_renormalize": True}, "moe_renormalize True cannot be written as GGUF: llama.cpp's olmoe"),
        ("llama", {"moe_ffn_hidden": 32}, "moe_ffn_hidden 32 cannot be written as GGUF"),
        ("qwen3moe", {"moe_layer_step": 2}, "moe_layer_step 2 cannot be written as GGUF: every layer of llama.cpp's"),
        ("qwen3moe", {"moe_dense_layers": [0]}, r"moe_dense_layers \[0\] cannot be written as GGUF"),
        ("qwen2moe", {"moe_shared_gate": False}, "moe_shared_gate False cannot be written as GGUF"),
    ],
)
def test_what_llama_cpps_expert_graphs_compute_otherwise_is_refused_by_field(arch, change, message, tmp_path):
    model = random_model({**CONFIGS[arch], **change})
    with pytest.raises(GGUFError, match=message):
        export_gguf(model, tmp_path / "m.gguf", ByteTokenizer(), "f32")
    assert not (tmp_path / "m.gguf").exists()


def rewritten(path: Path, out: Path, key: tuple[str, bool] | None, tensors: dict[str, np.ndarray]) -> Path:
    """path's GGUF file written again with a bool key added and tensors replacing (and adding to) its own."""
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if not name.startswith(("GGUF.", "general.architecture")):
            value_type = field.types[0]
            sub = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), value_type, sub_type=sub)
    if key is not None:
        writer.add_bool(*key)
    own = {name: data.reshape(shape) for name, (_, shape, data) in file_tensors(path).items()}
    for name, data in (own | tensors).items():
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_an_expert_key_the_reader_does_not_map_is_refused_by_name(tmp_path):
    path = export_gguf(random_model(CONFIGS["qwen3moe"]), tmp_path / "m.gguf", ByteTokenizer(), "f32")
    changed = rewritten(path, tmp_path / "x.gguf", ("qwen3moe.expert_weights_norm", False), {})  # llama.cpp: unread
    with pytest.raises(GGUFError, match="metadata 'qwen3moe.expert_weights_norm' is not one gptkit maps"):
        load_gguf(changed)


def test_a_dense_layer_among_expert_layers_is_refused_by_its_tensor(tmp_path):
    # llama.cpp's expert architectures have experts in every layer (its converter refuses Qwen2-MoE's
    # mlp_only_layers: "Can not map tensor 'model.layers.1.mlp.down_proj.weight'")
    path = export_gguf(random_model(CONFIGS["qwen3moe"]), tmp_path / "m.gguf", ByteTokenizer(), "f32")
    dense = {"blk.1.ffn_down.weight": np.zeros((64, 64)), "blk.1.ffn_gate.weight": np.zeros((64, 64))}
    with pytest.raises(GGUFError, match=r"holds tensor blk\.1\.ffn_down\.weight, which gptkit does not map"):
        load_gguf(rewritten(path, tmp_path / "x.gguf", None, dense))


def test_gptkit_convert_takes_an_moe_model_to_gguf_and_back(tmp_path, capsys):
    from gptkit.cli import main
    from gptkit.formats.modeldir import save_model_dir
    from gptkit.loading import load

    model = random_model(CONFIGS["qwen2moe"])
    source = save_model_dir(model, tmp_path / "model", tokenizer=ByteTokenizer())
    out = tmp_path / "m.gguf"
    assert main(["convert", "--to-gguf", str(source), "--out", str(out), "--type", "f32"]) == 0
    assert main(["convert", "--from-gguf", str(out), "--out", str(tmp_path / "back")]) == 0
    back, _ = load(tmp_path / "back")
    ids = torch.randint(0, 257, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))
    assert back.config.moe_shared_hidden == 96 and back.config.n_experts == 4
    dense_layer = random_model({**CONFIGS["olmoe"], "moe_layer_step": 2})
    changed = save_model_dir(dense_layer, tmp_path / "dense-layer", tokenizer=ByteTokenizer())
    capsys.readouterr()
    assert main(["convert", "--to-gguf", str(changed), "--out", str(tmp_path / "x.gguf")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # (earlier lines: the kernel timings' log, if any)
    assert "moe_layer_step 2 cannot be written as GGUF" in last and not (tmp_path / "x.gguf").exists()
