"""int8 and int4 mixture-of-experts models (gptkit.quantization's Int8Experts and Int4Experts): quantize() converts the
expert stacks and keeps routers float, the eager step stays near the float model, the fused CPU step (csrc/moe_step.h)
takes the quantised stacks and gives the eager step's logits and greedy tokens, and a saved quantised MoE model loads
back to the same logits."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy_with_and_without_fused_step

from gptkit import moe
from gptkit.decoding import fused
from gptkit.decoding.step import inference
from gptkit.errors import ConfigError
from gptkit.formats.quantized import load_quantized_dir, save_quantized_dir
from gptkit.native import library
from gptkit.quantization import Int4Experts, Int8Experts, is_quantized, quantization_method, quantize
from tests.decoding.test_moe_decode import (
    MOE_FAMILIES,
    assert_row_zero_alone_equals_beside_mates,
    eager_and_fused,
    moe_model,
    needs_kernels,
)

STACKS = {"int8": Int8Experts, "int4": Int4Experts}


@pytest.fixture
def fused_chosen(monkeypatch):
    """The fused step as if measured faster here, at one row and at every batch size."""
    wide = {f"fused_step_{rows}_rows": True for rows in fused.WIDE_ROWS}
    if library.load():
        monkeypatch.setitem(library.STATE, "choices", dict(library.choices(), fused_step=True, **wide))


def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with inference(model):
        out = model(ids)
    return (out[0] if isinstance(out, tuple) else out).float()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantize_converts_the_expert_stacks_and_keeps_routers_and_gates_float(method) -> None:
    model = quantize(moe_model("qwen2-moe-like"), method)
    layers = moe.moe_layers(model)
    assert layers and is_quantized(model) and quantization_method(model) == method
    for layer in layers:
        assert type(layer.fc) is STACKS[method] and type(layer.proj) is STACKS[method]
        assert layer.router.weight.dtype == torch.float32 and layer.shared_gate.weight.dtype == torch.float32
    with pytest.raises(ConfigError, match="already quantised") as refused:  # what is still refused: twice
        quantize(model, method)
    assert "\n" not in str(refused.value)


# Eager int8/int4 logits against the fp32 model's, relative to its largest logit, over a 10-token prompt (the grouped
# path) and decode-sized inputs (the routed path). Measured over MOE_FAMILIES (their routers and final norm scaled up,
# which magnifies every difference): int8 up to 5.4e-2, int4 up to 1.5e-1 (Q4_0's step is 16 times int8's). The dense
# tests bound each product's error per element (tests/decoding/test_quantize.py); these limits are 2 times the
# measured figures, and greedy tokens are not asserted (a quantised model may choose otherwise where logits are close).
EAGER_LIMIT = {"int8": 0.11, "int4": 0.3}


@pytest.mark.parametrize("name", list(MOE_FAMILIES))
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantised_moe_logits_lie_near_the_float_models(name, method) -> None:
    reference = moe_model(name)
    model = quantize(moe_model(name), method)
    g = torch.Generator().manual_seed(5)
    for shape in ((2, 10), (1, 1), (2, 1)):
        ids = torch.randint(0, reference.config.vocab_size, shape, generator=g)
        want, got = logits_of(reference, ids), logits_of(model, ids)
        assert float((got - want).abs().max() / want.abs().max()) <= EAGER_LIMIT[method]


@needs_kernels
@pytest.mark.parametrize("name", list(MOE_FAMILIES))
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 2])
def test_the_fused_step_takes_quantised_stacks_and_gives_the_eager_logits(name, method, rows, fused_chosen) -> None:
    """Rows whose routed slots fit the eager routed path (N * k at most E), so that both paths run the same int8 and
    q4 kernels, activations rounded to int8 per block of 32 on both. Measured: up to 4.2e-3 of the largest logit
    apart (qwen3-moe-like int8, where a rounded activation lands on the other side of a step; 2e-7 elsewhere), greedy
    tokens equal; the limit is the dense quantised one of tests/decoding/test_fused.py."""
    model = quantize(moe_model(name), method)
    assert fused.uncovered(model) is None
    eager, native = eager_and_fused(model, rows)  # asserts that the fused step was taken
    assert float((native - eager).abs().max() / eager.abs().max()) <= 1e-2
    assert torch.equal(native.argmax(-1), eager.argmax(-1))


@needs_kernels
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_bf16_models_quantised_stacks_decode_as_the_eager_step(method, fused_chosen) -> None:
    """bf16 activations between the eager step's operators, fp32 in the fused step (as for bf16 weights,
    tests/decoding/test_moe_decode.py). Measured on qwen2-moe-like at 2 rows: 7.8e-3 (int8) and 1.07e-2 (int4) of the
    largest logit apart, greedy tokens equal; the limit is about 2.3 times the larger."""
    model = quantize(moe_model("qwen2-moe-like", torch.bfloat16), method)
    eager, native = eager_and_fused(model, 2)
    assert float((native - eager).abs().max() / eager.abs().max()) <= 2.5e-2


@needs_kernels
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_rows_quantised_fused_logits_do_not_depend_on_the_rows_beside_it(method, fused_chosen) -> None:
    model = quantize(moe_model("qwen2-moe-like"), method)
    step = fused.step_for(model)
    assert step is not None
    config = model.config
    mates = torch.randint(0, config.vocab_size, (12, 7), generator=torch.Generator().manual_seed(3))
    assert_row_zero_alone_equals_beside_mates(model, step, mates)


@needs_kernels
@pytest.mark.parametrize("name", ["mixtral-like", "qwen3-moe-like"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_greedy_tokens_of_a_quantised_moe_model_through_the_fused_step_equal_the_eager_ones(
    name, method, monkeypatch
) -> None:
    model = quantize(moe_model(name), method)
    runs = greedy_with_and_without_fused_step(model, [[1, 2, 3, 4]], 32, monkeypatch)
    assert runs[True] == runs[False] and len(runs[True][0]) >= 32


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_saved_quantised_moe_model_loads_back_with_the_same_stacks_and_logits(method, tmp_path) -> None:
    model = quantize(moe_model("gelu-biased-shared"), method)
    save_quantized_dir(model, tmp_path / "q")
    loaded = load_quantized_dir(tmp_path / "q")
    assert quantization_method(loaded) == method
    for layer in moe.moe_layers(loaded):
        assert type(layer.fc) is STACKS[method] and layer.router.weight.dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    assert torch.equal(logits_of(loaded, ids), logits_of(model, ids))


def test_an_int4_moe_models_q4_0_gguf_holds_its_very_expert_weights(tmp_path) -> None:
    """Writing a q4_0 file repacks the int4 stacks' blocks; the reader gives them back as int4 stacks
    (tests/formats/test_gguf_moe_q4.py: blocks gptkit's quantiser would not make), routers float32 throughout."""
    pytest.importorskip("gguf")
    from gptkit.formats.gguf import export_gguf, load_gguf
    from gptkit.tokenizer import ByteTokenizer
    from tests.formats.test_gguf_moe import CONFIGS, random_model

    model = quantize(random_model(CONFIGS["qwen3moe"]), "int4")
    back, _ = load_gguf(export_gguf(model, tmp_path / "m.gguf", ByteTokenizer(), "q4_0"))
    want, got = model.state_dict(), back.state_dict()
    for name in ("blocks.0.mlp.fc.weight", "blocks.0.mlp.fc.scales", "blocks.1.mlp.proj.weight"):
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name])
    assert got["blocks.0.mlp.router.weight"].dtype == torch.float32
    assert torch.equal(got["blocks.0.mlp.router.weight"], want["blocks.0.mlp.router.weight"])
