"""A q4_0 MoE GGUF file's expert stacks read as gptkit's int4 stacks (issue 55): Int4Experts holding the file's very
Q4_0 blocks (never a float copy), written back bit for bit, giving the logits of the same blocks read as floats, and
decoded by the fused CPU step. The blocks are random bytes, not ones gptkit's quantiser makes: quantising their
dequantised values again gives other blocks (what writing did before), so the round trip can tell."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import greedy_with_and_without_fused_step

from gptkit.decoding import fused
from gptkit.decoding.step import inference
from gptkit.formats.gguf import export_gguf, load_gguf, q4_0_blocks
from gptkit.model import GPT
from gptkit.moe import ExpertWeights, moe_layers
from gptkit.native import library
from gptkit.quantization import Int4Experts, Int4Linear
from gptkit.tokenizer import ByteTokenizer
from tests.formats.test_gguf_moe import CONFIGS, random_model

gguf = pytest.importorskip("gguf")
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
needs_kernels = pytest.mark.skipif(not library.load(), reason="this CPU has neither AVX2 nor AVX-512")


def random_blocks(shape: tuple[int, ...], generator: torch.Generator) -> np.ndarray:
    """Random Q4_0 blocks for a (E, out, in) tensor: uniform nibbles, fp16 scales of either sign about llama.cpp's
    for weights of std 0.3 (largest of 32 about 0.75, d = 0.75 / 8), as GGUF rows (E, out, in / 32 * 18)."""
    rows, width = int(np.prod(shape[:-1])), shape[-1]
    packed = torch.randint(0, 256, (rows, width // 2), dtype=torch.uint8, generator=generator)
    scales = (torch.randn(rows, width // 32, generator=generator) * 0.1).to(torch.float16)
    return q4_0_blocks(packed, scales).reshape(*shape[:-1], -1)


def q4_file(arch: str, folder: Path, replace: dict[str, np.ndarray] | None = None) -> Path:
    """gptkit's q4_0 file of a random model of arch, written again with each expert stack's blocks random (and the
    tensors in replace, as float32, in place of its own)."""
    written = export_gguf(random_model(CONFIGS[arch]), folder / "gptkit.gguf", ByteTokenizer(), "q4_0")
    reader = gguf.GGUFReader(str(written))
    out = folder / "random-experts.gguf"
    writer = gguf.GGUFWriter(str(out), arch)
    for name, field in reader.fields.items():
        if not name.startswith(("GGUF.", "general.architecture")):
            value_type = field.types[0]
            sub = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), value_type, sub_type=sub)
    generator = torch.Generator().manual_seed(2)
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        data, kind = np.asarray(tensor.data), tensor.tensor_type
        if replace and tensor.name in replace:
            data, kind = np.ascontiguousarray(replace[tensor.name], dtype=np.float32), gguf.GGMLQuantizationType.F32
        elif tensor.name.split(".")[-2] in EXPERT_TENSORS:
            data = random_blocks(shape, generator)
        writer.add_tensor(tensor.name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def raw_tensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """A GGUF file's tensors: name -> (type, raw bytes or values as stored)."""
    return {t.name: (t.tensor_type.name, np.asarray(t.data)) for t in gguf.GGUFReader(str(path)).tensors}


def float_reading(model: GPT) -> GPT:
    """model with each Int4Experts replaced by the float stack of the values its blocks stand for (how the reader
    read a q4_0 expert stack before)."""
    for layer in moe_layers(model):
        for child in ("fc", "proj"):
            stack = getattr(layer, child)
            n = stack.weight.size(0)
            floats = ExpertWeights(n, stack.in_features, stack.out_features, stack.bias is not None)
            with torch.no_grad():
                floats.weight.copy_(torch.stack([stack.dequantized_expert(e, torch.float32) for e in range(n)]))
            setattr(layer, child, floats)
    return model.eval()


@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe"])
def test_q4_0_expert_stacks_are_read_as_int4_stacks_and_written_back_bit_for_bit(arch, tmp_path):
    path = q4_file(arch, tmp_path)
    model, tokenizer = load_gguf(path)
    for layer in moe_layers(model):
        assert type(layer.fc) is Int4Experts and type(layer.proj) is Int4Experts
        assert layer.router.weight.dtype == torch.float32
        if layer.shared is not None:  # Qwen2-MoE's shared expert: dense Q4_0 matrices, as Int4Linear
            assert type(layer.shared.fc) is Int4Linear and type(layer.shared.proj) is Int4Linear
    again = export_gguf(model, tmp_path / "again.gguf", tokenizer, "q4_0")
    before, after = raw_tensors(path), raw_tensors(again)
    assert before.keys() == after.keys()
    for name, (kind, data) in before.items():
        if name == "token_embd.weight":  # a quantised gptkit model keeps its embedding float: written as f32
            assert after[name][0] == "F32"
            values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind])
            assert np.array_equal(after[name][1], values)
            continue
        assert after[name][0] == kind, name
        assert np.array_equal(after[name][1], data), name  # every Q4_0 block the file held, the experts' too


def test_the_stacks_hold_the_files_bytes_not_a_float_copy(tmp_path):
    path = q4_file("qwen3moe", tmp_path)
    model, _ = load_gguf(path)
    tensors = raw_tensors(path)
    for i, layer in enumerate(moe_layers(model)):
        for stack, names in ((layer.fc, EXPERT_TENSORS[:2]), (layer.proj, EXPERT_TENSORS[2:])):
            held = stack.weight.nbytes + stack.scales.nbytes  # (output rows a multiple of 8: no padded group)
            assert held == sum(tensors[f"blk.{i}.{name}.weight"][1].nbytes for name in names)
            assert held * 32 == stack.weight.size(0) * stack.out_features * stack.in_features * 18  # 18 bytes per 32


# The q4 reading's logits against the float reading's (the same blocks as float stacks; every other layer the same).
# A prompt of 12 tokens takes the grouped path: each expert's product over its dequantised weight in fp32, as the float
# stack's (measured: equal bits on both architectures; the limit allows for another order of the sums). A decode step
# takes the routed path, where the q4 kernel rounds the activations to int8 per block of 32 as llama.cpp does:
# measured up to 1.5e-2 of the largest logit (0 with GPTKIT_CPU_KERNELS=0, where it multiplies the dequantised
# weight); the limit is 2 times that.
@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe"])
def test_the_q4_readings_logits_equal_the_float_readings(arch, tmp_path):
    path = q4_file(arch, tmp_path)
    model, reference = load_gguf(path)[0], float_reading(load_gguf(path)[0])
    generator = torch.Generator().manual_seed(3)
    for shape, limit in (((2, 12), 1e-5), ((1, 1), 3e-2)):
        ids = torch.randint(0, model.config.vocab_size, shape, generator=generator)
        with inference(model):
            got, want = model(ids), reference(ids)
        assert float((got - want).abs().max() / want.abs().max()) <= limit


@needs_kernels
@pytest.mark.parametrize("arch", ["qwen2moe", "qwen3moe"])
def test_the_fused_step_decodes_the_read_stacks_to_the_eager_steps_greedy_tokens(arch, tmp_path, monkeypatch):
    model, _ = load_gguf(q4_file(arch, tmp_path))
    assert fused.uncovered(model) is None
    runs = greedy_with_and_without_fused_step(model, [[1, 2, 3, 4]], 24, monkeypatch)
    assert runs[True] == runs[False] and len(runs[True][0]) >= 24


def test_a_stack_whose_pieces_are_not_all_q4_0_is_read_as_floats(tmp_path):
    up = np.random.default_rng(0).normal(0, 0.3, (4, 32, 64)).astype(np.float32)  # blk.0's up experts in float32
    path = q4_file("qwen3moe", tmp_path, {"blk.0.ffn_up_exps.weight": up})
    model, _ = load_gguf(path)
    fc = model.blocks[0].mlp.fc
    assert type(fc) is ExpertWeights and type(model.blocks[0].mlp.proj) is Int4Experts
    assert torch.equal(fc.weight[:, 32:], torch.from_numpy(up))  # [gate; up] along the rows: up as written
    gate = raw_tensors(path)["blk.0.ffn_gate_exps.weight"][1]
    values = gguf.quants.dequantize(gate, gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(fc.weight[:, :32].detach().numpy(), values)  # gate: its blocks' values


def test_q8_0_expert_stacks_are_read_as_floats(tmp_path):
    # Q8_0's scale per block of 32 has no place in Int8Experts' one scale per row: the values are read exactly
    model = random_model(CONFIGS["qwen3moe"])
    path = export_gguf(model, tmp_path / "m.gguf", ByteTokenizer(), "q8_0")
    back, _ = load_gguf(path)
    stack = back.blocks[1].mlp.proj
    assert type(stack) is ExpertWeights
    data = raw_tensors(path)["blk.1.ffn_down_exps.weight"][1]
    assert np.array_equal(stack.weight.detach().numpy(), gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q8_0))


def test_convert_from_gguf_keeps_the_int4_stacks_in_the_model_directory(tmp_path):
    from gptkit.cli import main
    from gptkit.formats.quantized import load_quantized_dir

    path = q4_file("qwen3moe", tmp_path)
    assert main(["convert", "--from-gguf", str(path), "--out", str(tmp_path / "model")]) == 0
    saved, (read, _) = load_quantized_dir(tmp_path / "model"), load_gguf(path)
    assert type(saved.blocks[0].mlp.fc) is Int4Experts
    want = read.state_dict()
    assert saved.state_dict().keys() == want.keys()
    assert all(torch.equal(tensor, want[name]) for name, tensor in saved.state_dict().items())
