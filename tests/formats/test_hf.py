"""Conversion from and to Hugging Face: logits, greedy generation, round trips, refusals (tiny random models)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import VARIANTS

import gptkit
from gptkit.cli import main as cli_main
from gptkit.config import ModelConfig
from gptkit.errors import GptkitError
from gptkit.formats.hf import export_hf, gpt_from_hf_model, hf_model_from_gpt, load_hf
from gptkit.formats.modeldir import load_model_dir, save_model_dir
from gptkit.loading import load
from gptkit.model import GPT
from gptkit.weights import WeightsError, model_state

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

NO_SPECIALS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
# Odd sizes on purpose: width 48 with 3 heads, intermediate sizes that are multiples of nothing useful.
HF_CONFIGS = {
    "gpt2-tied": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(
            vocab_size=99,
            n_positions=48,
            n_embd=48,
            n_head=3,
            n_layer=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **NO_SPECIALS,
        ),
    ),
    "gpt2-untied-gelu": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(
            vocab_size=71,
            n_positions=48,
            n_embd=40,
            n_head=5,
            n_layer=2,
            n_inner=73,
            activation_function="gelu",
            tie_word_embeddings=False,
            layer_norm_epsilon=1e-6,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **NO_SPECIALS,
        ),
    ),
    "llama-gqa-untied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=99,
            hidden_size=48,
            num_attention_heads=6,
            num_key_value_heads=2,
            num_hidden_layers=2,
            intermediate_size=77,
            max_position_embeddings=64,
            rope_theta=500.0,
            rms_norm_eps=1e-5,
            **NO_SPECIALS,
        ),
    ),
    "llama-mqa-tied-bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=83,
            hidden_size=48,
            num_attention_heads=4,
            num_key_value_heads=1,
            num_hidden_layers=2,
            intermediate_size=61,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            **NO_SPECIALS,
        ),
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            vocab_size=99,
            hidden_size=48,
            num_attention_heads=6,
            num_key_value_heads=3,
            num_hidden_layers=2,
            intermediate_size=53,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            **NO_SPECIALS,
        ),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(
            vocab_size=99,
            hidden_size=48,
            num_attention_heads=6,
            num_key_value_heads=2,
            num_hidden_layers=2,
            intermediate_size=77,
            max_position_embeddings=64,
            sliding_window=None,
            **NO_SPECIALS,
        ),
    ),
    # q_norm/k_norm over head_dim, biases on all four attention projections.
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            vocab_size=99,
            hidden_size=48,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=8,
            num_hidden_layers=2,
            intermediate_size=53,
            max_position_embeddings=64,
            attention_bias=True,
            rms_norm_eps=1e-5,
            **NO_SPECIALS,
        ),
    ),
}


def make_hf(name: str, seed: int = 0) -> torch.nn.Module:
    """A tiny HF model with every parameter random (biases and norm gains too, so each mapping is tested)."""
    config_class, model_class, kwargs = HF_CONFIGS[name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**kwargs))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def random_ids(vocab: int, shape=(2, 19), seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def assert_same_logits(hf_model, model: GPT, vocab: int, device: torch.device | str = "cpu") -> None:
    ids = random_ids(vocab, (2, min(19, model.config.block_size))).to(device)
    with torch.no_grad():
        expected, got = hf_model(ids).logits, model(ids)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def greedy_hf(hf_model, prompt: list[int], n: int) -> list[int]:
    out = hf_model.generate(
        torch.tensor([prompt], device=hf_model.device),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def greedy_gptkit(model: GPT, prompt: list[int], n: int) -> list[int]:
    from gptkit.decoding.api import generate_ids

    return generate_ids(model, prompt, max_new_tokens=n, temperature=0)


@pytest.fixture(scope="module", params=list(HF_CONFIGS))
def hf_dir(request, tmp_path_factory) -> tuple[str, torch.nn.Module, Path]:
    path = tmp_path_factory.mktemp(request.param)
    hf_model = make_hf(request.param)
    hf_model.save_pretrained(path)
    return request.param, hf_model, path


def test_import_directory_gives_hf_logits_and_greedy_tokens(hf_dir, device) -> None:
    name, hf_model, path = hf_dir
    model, tokenizer = load_hf(path, device=device)
    assert tokenizer is None
    hf_model = copy.deepcopy(hf_model).to(device)  # the fixture's own model stays on the CPU for the other tests
    vocab = hf_model.config.vocab_size
    assert_same_logits(hf_model, model, vocab, device)
    prompt = random_ids(vocab, (1, 8), seed=3)[0].tolist()
    assert greedy_gptkit(model, prompt, 32) == greedy_hf(hf_model, prompt, 32)


def test_in_memory_import_matches_directory_import(hf_dir) -> None:
    _, hf_model, path = hf_dir
    from_dir, _ = load_hf(path)
    from_memory = gpt_from_hf_model(hf_model)
    assert from_memory.config == from_dir.config
    for (a, x), (b, y) in zip(model_state(from_memory).items(), model_state(from_dir).items()):
        assert a == b and torch.equal(x, y), a


def test_import_maps_config_fields() -> None:
    gpt2 = gpt_from_hf_model(make_hf("gpt2-untied-gelu")).config
    assert (gpt2.activation, gpt2.ffn_hidden, gpt2.norm_eps, gpt2.tie_embeddings) == ("gelu", 73, 1e-6, False)
    assert (gpt2.block_size, gpt2.n_head, gpt2.n_embd, gpt2.position) == (48, 5, 40, "learned")
    llama = gpt_from_hf_model(make_hf("llama-gqa-untied")).config
    assert (llama.n_kv_head, llama.rope_theta, llama.norm_eps, llama.ffn_hidden) == (2, 500.0, 1e-5, 77)
    assert (llama.attn_bias, llama.mlp_bias, llama.tie_embeddings, llama.norm) == (False, False, False, "rmsnorm")
    qwen = gpt_from_hf_model(make_hf("qwen2"))
    assert qwen.config.attn_bias and not qwen.config.mlp_bias and qwen.config.tie_embeddings
    assert not qwen.blocks[0].attn.proj.bias.any()  # Qwen2's o_proj has no bias: held as zeros
    qwen3 = gpt_from_hf_model(make_hf("qwen3"))
    assert (qwen3.config.qk_norm, qwen3.config.attn_bias, qwen3.config.mlp_bias, qwen3.config.vocab_multiple) == (
        True,
        True,
        False,
        1,
    )
    assert qwen3.blocks[0].attn.q_norm.weight.shape == (8,) and qwen3.blocks[0].attn.proj.bias.any()


EXPORTABLE = {
    "gpt2": VARIANTS["gpt2"],
    "llama-gqa": VARIANTS["llama-gqa"],
    "nanogpt-no-bias": VARIANTS["nanogpt-no-bias"],  # exact gelu, no biases: GPT-2 with zero biases
    "relu-learned-odd": dict(
        VARIANTS["gpt2"],
        n_embd=48,
        n_head=3,
        activation="relu",
        ffn_hidden=70,
        tie_embeddings=False,
        norm_eps=1e-6,
        attn_bias=False,
    ),
    "llama-mqa-tied-bias": dict(
        VARIANTS["llama-gqa"],
        n_embd=48,
        n_head=4,
        n_kv_head=1,
        ffn_hidden=61,
        tie_embeddings=True,
        attn_bias=True,
        mlp_bias=True,
        rope_theta=300.0,
        dropout=0.1,
    ),
    "qwen3-qk-norm": dict(VARIANTS["llama-gqa"], qk_norm=True, attn_bias=True, zero_init_proj=True),
    "relu2-learned": dict(VARIANTS["gpt2"], activation="relu2"),  # transformers' ACT2FN["relu2"]: relu(x)^2
}
EXPORTED_AS = {"learned": "GPT2LMHeadModel", "rope": "LlamaForCausalLM", "qk_norm": "Qwen3ForCausalLM"}


def random_gpt(config: ModelConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


@pytest.mark.parametrize("name", list(EXPORTABLE))
def test_export_loads_in_transformers_with_same_logits_and_round_trips(name, tmp_path) -> None:
    model = random_gpt(ModelConfig(**EXPORTABLE[name]))
    export_hf(model, tmp_path / "hf")
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf_model).__name__ == EXPORTED_AS["qk_norm" if model.config.qk_norm else model.config.position]
    assert_same_logits(hf_model, model, model.config.vocab_size)
    back, _ = load_hf(tmp_path / "hf")
    assert back.config == model.config  # bias flags and dropout survive through the recorded config
    original, returned = model_state(model), model_state(back)
    assert list(original) == list(returned)
    for key in original:
        assert torch.equal(original[key], returned[key]), key


def test_export_greedy_generation_matches_transformers(tmp_path) -> None:
    model = random_gpt(ModelConfig(**dict(EXPORTABLE["llama-mqa-tied-bias"], block_size=64)))
    hf_model = hf_model_from_gpt(model)
    prompt = [5, 1, 4, 1, 5, 9, 2, 6]
    assert greedy_hf(hf_model, prompt, 32) == greedy_gptkit(model, prompt, 32)


def test_zero_bias_of_edited_model_is_kept_when_nonzero(tmp_path) -> None:
    model = random_gpt(ModelConfig(**EXPORTABLE["nanogpt-no-bias"]))
    export_hf(model, tmp_path / "hf")
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        hf_model.transformer.h[0].attn.c_attn.bias[3] = 0.5  # now the biases compute something
    back = gpt_from_hf_model(hf_model)
    assert back.config.attn_bias and back.config.mlp_bias  # the recorded bias-free config no longer applies
    assert_same_logits(hf_model, back, model.config.vocab_size)


@pytest.mark.parametrize(
    "name, reason",
    [
        ("original-decoder", "position 'sinusoidal'"),
        ("gpt1-style", "norm_position"),
        ("mqa-no-position", "position 'none'"),
        ("untied-head-bias", "lm_head_bias"),
        ("rmsnorm-post-rope", "norm_position 'post'"),
    ],
)
def test_export_refuses_what_no_family_computes(name, reason, tmp_path) -> None:
    config = dict(VARIANTS[name])
    with pytest.raises(GptkitError, match=reason) as err:
        export_hf(GPT(ModelConfig(**config)), tmp_path / "hf")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "hf" / "config.json").exists()


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(VARIANTS["llama-gqa"], logit_softcap=30.0), "logit_softcap 30.0 cannot be exported as llama: .*Gemma 2"),
        (dict(VARIANTS["gpt2"], logit_softcap=30.0), "logit_softcap 30.0 cannot be exported"),
        (dict(VARIANTS["gpt2"], qk_norm=True), "qk_norm cannot be exported as gpt2"),
        (dict(VARIANTS["llama-gqa"], activation="relu2"), "activation 'relu2' cannot be exported as llama"),
    ],
)
def test_export_refuses_recipe_options_no_layout_computes(changes, match, tmp_path) -> None:
    with pytest.raises(GptkitError, match=match) as err:
        export_hf(GPT(ModelConfig(**changes)), tmp_path / "hf")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "hf" / "config.json").exists()


@pytest.mark.parametrize("name", ["gpt2", "qwen3-qk-norm"])
def test_export_of_a_padded_vocabulary_writes_the_real_rows_only(name, tmp_path) -> None:
    model = random_gpt(ModelConfig(**dict(EXPORTABLE[name], vocab_multiple=16)))
    assert model.tok_emb.weight.shape[0] == 64
    again = load_model_dir(save_model_dir(model, tmp_path / "dir"))  # a gptkit directory keeps the padded rows
    assert again.config == model.config and torch.equal(again.tok_emb.weight, model.tok_emb.weight)
    export_hf(model, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 50
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf_model.get_input_embeddings().weight.shape == (50, 32)
    assert_same_logits(hf_model, model, 50)
    back, _ = load_hf(tmp_path / "hf")
    assert back.config == ModelConfig(**dict(model.config.to_dict(), vocab_multiple=1))  # imports are unpadded
    assert_same_logits(hf_model, back, 50)


def test_export_refuses_gqa_with_learned_positions(tmp_path) -> None:
    with pytest.raises(GptkitError, match="n_kv_head 2 .*grouped-query"):
        export_hf(GPT(ModelConfig(**dict(VARIANTS["gpt2"], n_kv_head=2))), tmp_path)


def save_edited(tmp_path: Path, name: str, **changes) -> Path:
    """Save HF model `name` and apply changes to its config.json."""
    path = tmp_path / "edited"
    make_hf(name).save_pretrained(path)
    data = json.loads((path / "config.json").read_text())
    data.update(changes)
    (path / "config.json").write_text(json.dumps(data))
    return path


def hf_config_error(tmp_path: Path, name: str, match: str, **changes) -> None:
    """Save HF model `name`, edit its config.json, and expect a one-line error matching `match`."""
    with pytest.raises(GptkitError, match=match) as err:
        load_hf(save_edited(tmp_path, name, **changes))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "name, changes, match",
    [
        (
            "llama-gqa-untied",
            dict(rope_parameters={"rope_type": "proportional", "factor": 2.0, "rope_theta": 1e4}),
            "RoPE scaling 'proportional'",
        ),
        (
            "llama-gqa-untied",
            dict(rope_parameters=None, rope_theta=1e4, rope_scaling={"rope_type": "llama3"}),
            "rope_scaling.factor is required for rope_type llama3",
        ),
        # Beside a plain rope_parameters: transformers reads rope_scaling first.
        (
            "llama-gqa-untied",
            dict(rope_scaling={"rope_type": "linear", "factor": 4.0, "mrope_section": [2, 2]}),
            "unknown rope_scaling field 'mrope_section'",
        ),
        ("llama-gqa-untied", dict(rope_parameters={"rope_type": "default", "factor": 4.0}), "RoPE setting 'factor'"),
        ("llama-gqa-untied", dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        ("llama-gqa-untied", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (
            "qwen2",
            dict(use_sliding_window=True, sliding_window=8, layer_types=["full_attention", "chunked_attention"]),
            "layer type 'chunked_attention'",
        ),
        (
            "qwen2",
            dict(use_sliding_window=False, sliding_window=8, layer_types=["full_attention", "sliding_attention"]),
            "layer_types names sliding layers but no window is set",
        ),
        ("gpt2-tied", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
        ("gpt2-tied", dict(activation_function="quick_gelu"), "activation_function 'quick_gelu'"),
        ("gpt2-tied", dict(architectures=["GPT2DoubleHeadsModel"]), "architecture GPT2DoubleHeadsModel"),
        ("gpt2-tied", dict(architectures=["FalconForCausalLM"], model_type="falcon"), "FalconForCausalLM"),
    ],
)
def test_import_refuses_what_gptkit_cannot_compute(name, changes, match, tmp_path) -> None:
    hf_config_error(tmp_path, name, match, **changes)


@pytest.mark.parametrize(
    "name, changes",
    [
        ("qwen2", dict(use_sliding_window=False, sliding_window=16)),  # as most Qwen2 configs: a window switched off
        ("qwen2", dict(use_sliding_window=True, sliding_window=16)),  # but layer_types has no sliding layer
        ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2, layer_types=None)),
        ("llama-gqa-untied", dict(rope_parameters={"rope_type": "default"}, rope_theta=300.0)),  # theta beside it
    ],
)
def test_settings_that_apply_to_no_layer_are_accepted(name, changes, tmp_path) -> None:
    path = save_edited(tmp_path, name, **changes)
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = random_ids(99, (2, 40))  # longer than the window
    with torch.no_grad():
        torch.testing.assert_close(load_hf(path)[0](ids), reference(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["gpt2-untied-gelu", "llama-gqa-untied"])
def test_tied_config_with_a_different_head_in_the_file_imports_untied(name, tmp_path) -> None:
    path = save_edited(tmp_path, name, tie_word_embeddings=True)
    reference = AutoModelForCausalLM.from_pretrained(path).eval()  # transformers keeps both, with a warning
    model, _ = load_hf(path)
    assert not model.config.tie_embeddings
    assert_same_logits(reference, model, reference.config.vocab_size)


def test_tied_head_stored_twice_stays_tied(tmp_path) -> None:
    hf_model = make_hf("llama-mqa-tied-bias")
    hf_model.save_pretrained(tmp_path)
    rewrite_weights(tmp_path, lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"].clone()}))
    model, _ = load_hf(tmp_path)
    assert model.config.tie_embeddings and model.lm_head.weight is model.tok_emb.weight
    assert_same_logits(hf_model, model, 83)


@pytest.fixture
def gpt2_dir(tmp_path) -> Path:
    path = tmp_path / "gpt2"
    make_hf("gpt2-untied-gelu").save_pretrained(path)
    return path


def test_truncated_and_corrupt_safetensors_are_one_line_errors(gpt2_dir) -> None:
    weights = gpt2_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(GptkitError, match="model.safetensors.*(truncated or corrupt)") as err:
        load_hf(gpt2_dir)
    assert "\n" not in str(err.value)
    weights.write_bytes(b"\xff" * 8 + data[8:])  # a header length no file can have
    with pytest.raises(GptkitError, match="model.safetensors.*(truncated or corrupt)"):
        load_hf(gpt2_dir)


def rewrite_weights(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(path / "model.safetensors")
    edit(state)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(gpt2_dir) -> None:
    rewrite_weights(gpt2_dir, lambda s: s.pop("transformer.h.1.mlp.c_fc.weight"))
    with pytest.raises(GptkitError, match="lacks tensor 'transformer.h.1.mlp.c_fc.weight'"):
        load_hf(gpt2_dir)


def test_shape_mismatch_is_named(gpt2_dir) -> None:
    rewrite_weights(gpt2_dir, lambda s: s.update({"transformer.h.0.attn.c_attn.weight": torch.zeros(40, 119)}))
    with pytest.raises(GptkitError, match=r"'transformer.h.0.attn.c_attn.weight' has shape \(40, 119\).*\(40, 120\)"):
        load_hf(gpt2_dir)


def test_unexpected_tensor_is_refused(gpt2_dir) -> None:
    rewrite_weights(gpt2_dir, lambda s: s.update({"transformer.h.0.crossattention.c_attn.weight": torch.zeros(2)}))
    with pytest.raises(GptkitError, match="crossattention"):
        load_hf(gpt2_dir)


def test_integer_tensor_is_a_one_line_error(tmp_path) -> None:
    make_hf("llama-gqa-untied").save_pretrained(tmp_path / "hf")
    rewrite_weights(tmp_path / "hf", lambda s: s.update({"model.norm.weight": torch.ones(48, dtype=torch.int32)}))
    with pytest.raises(GptkitError, match="'model.norm.weight' has dtype torch.int32") as err:
        load_hf(tmp_path / "hf")
    assert "\n" not in str(err.value)
    # The same in a gptkit directory.
    save_model_dir(random_gpt(ModelConfig(**VARIANTS["llama-gqa"])), tmp_path / "gptkit")
    rewrite_weights(tmp_path / "gptkit", lambda s: s.update({"norm_f.weight": torch.ones(32, dtype=torch.int32)}))
    with pytest.raises(WeightsError, match="'norm_f.weight' has dtype torch.int32, the model needs floating") as err:
        load_model_dir(tmp_path / "gptkit")
    assert "\n" not in str(err.value)


def test_mixed_dtypes_import_in_one_dtype(tmp_path) -> None:
    """bf16 weights with fp32 norms, a common layout: the embedding's dtype, or the one asked for."""
    make_hf("llama-gqa-untied").to(torch.bfloat16).save_pretrained(tmp_path)
    rewrite_weights(tmp_path, lambda s: s.update({k: v.float() for k, v in s.items() if "norm" in k}))
    model, _ = load_hf(tmp_path)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    as_float, _ = load_hf(tmp_path, dtype=torch.float32)
    assert {p.dtype for p in as_float.parameters()} == {torch.float32}
    for (name, x), y in zip(model_state(model).items(), model_state(as_float).values()):
        assert torch.equal(x, y.to(torch.bfloat16)), name
    assert model(random_ids(99)).dtype == torch.bfloat16  # mixed dtypes would fail in the first matmul
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert_same_logits(reference, as_float, 99)


def test_sharded_safetensors_and_pytorch_bin_import(tmp_path) -> None:
    hf_model = make_hf("llama-gqa-untied")
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert_same_logits(hf_model, load_hf(tmp_path / "sharded")[0], 99)
    half, _ = load_hf(tmp_path / "sharded", dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    # A pytorch_model.bin as older transformers wrote it, read with weights_only=True.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(tmp_path / "sharded" / "config.json", bin_dir)
    torch.save(hf_model.state_dict(), bin_dir / "pytorch_model.bin")
    assert_same_logits(hf_model, load_hf(bin_dir)[0], 99)
    (bin_dir / "pytorch_model.bin").write_bytes(b"not a zip and not a pickle")
    with pytest.raises(GptkitError, match="pytorch_model.bin is not a readable PyTorch weights file"):
        load_hf(bin_dir)


def test_original_gpt2_names_without_prefix_and_mask_buffers(tmp_path) -> None:
    """OpenAI's GPT-2 files name tensors wte.weight, h.0.attn.bias (a causal mask buffer), ... without a prefix."""
    hf_model = make_hf("gpt2-tied")
    hf_model.save_pretrained(tmp_path)
    n = hf_model.config.n_positions

    def legacy(state: dict) -> None:
        for key in list(state):
            state[key.removeprefix("transformer.")] = state.pop(key)
        for i in range(2):
            state[f"h.{i}.attn.bias"] = torch.ones(1, 1, n, n).tril()
            state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)

    rewrite_weights(tmp_path, legacy)
    assert_same_logits(hf_model, load_hf(tmp_path)[0], 99)


def test_gptkit_load_of_hf_directory_returns_model_and_tokenizer(tmp_path) -> None:
    from gptkit.tokenizer import BPETokenizer

    text = "the quick brown fox jumps over the lazy dog. " * 20
    bpe = BPETokenizer.train([text], vocab_size=300)
    hf_model = make_hf("llama-gqa-untied")
    hf_model.resize_token_embeddings(bpe.vocab_size)
    hf_model.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text(bpe.hf.to_str())
    model, tokenizer = load(tmp_path)
    ids = tokenizer.encode("the lazy fox")
    assert tokenizer.decode(ids) == "the lazy fox"
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits
    torch.testing.assert_close(model(torch.tensor([ids])), expected, atol=1e-4, rtol=0)


def test_eos_ids_of_the_hf_configs_end_generation_as_in_transformers(tmp_path) -> None:
    from gptkit.decoding.api import generate_ids
    from gptkit.tokenizer import BPETokenizer

    bpe = BPETokenizer.train(
        ["the quick brown fox jumps over the lazy dog. " * 20], vocab_size=300, specials=["<|endoftext|>", "<|im_end|>"]
    )
    im_end = bpe.hf.token_to_id("<|im_end|>")
    hf_model = make_hf("llama-gqa-untied")
    hf_model.resize_token_embeddings(bpe.vocab_size)
    with torch.no_grad():
        hf_model.get_output_embeddings().weight.normal_(0.0, 0.2)
    prompt = bpe.encode("the lazy")
    free = greedy_hf(hf_model, prompt, 12)
    second_eos = free[4]  # the greedy text reaches it, so generation must end there
    hf_model.generation_config.eos_token_id = [im_end, second_eos]
    hf_model.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text(bpe.hf.to_str())
    # A chat model's tokenizer_config names its end of turn, not <|endoftext|>, as the eos token.
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    model, tokenizer = load(tmp_path / "hf")
    assert tokenizer.eos_ids == (im_end, second_eos)
    expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert expected[0, -1] == second_eos
    for beams in (1, 2):
        got = generate_ids(model, prompt, max_new_tokens=12, temperature=0, num_beams=beams, eos_id=tokenizer.eos_ids)
        hf = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, num_beams=beams, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert got == (hf[:-1] if hf[-1] in tokenizer.eos_ids else hf)  # gptkit returns no eos token
    # The list survives an import into a gptkit directory and an export back to Hugging Face.
    save_model_dir(model, tmp_path / "gptkit", tokenizer=tokenizer)
    assert load(tmp_path / "gptkit")[1].eos_ids == (im_end, second_eos)
    gptkit.export_hf(tmp_path / "gptkit", tmp_path / "back")  # a directory: loaded, then exported
    assert json.loads((tmp_path / "back" / "config.json").read_text())["eos_token_id"] == [im_end, second_eos]
    with pytest.raises(GptkitError, match="eos_id must be a token id"):
        generate_ids(model, prompt, max_new_tokens=2, eos_id=["x"])


def tokenizers_under_test():
    from gptkit.tokenizer import EOT, BPETokenizer, ByteTokenizer, CharTokenizer

    text = "Hello, wörld! ünïcode ✓ and a\nnew line\twith tab  spaces." + EOT + "after"
    return text, {
        "char": CharTokenizer.train([text.replace(EOT, "")], specials=[EOT]),
        "byte": ByteTokenizer(),
        "bpe": BPETokenizer.train([text * 5], vocab_size=300),
    }


@pytest.mark.parametrize("kind", ["char", "byte", "bpe"])
def test_exported_tokenizer_loads_in_autotokenizer_and_agrees(kind, tmp_path) -> None:
    text, tokenizers = tokenizers_under_test()
    tokenizer = tokenizers[kind]
    model = random_gpt(ModelConfig(**dict(VARIANTS["gpt2"], vocab_size=tokenizer.vocab_size)))
    export_hf(model, tmp_path, tokenizer=tokenizer)
    hf_tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer.encode(text)
    assert hf_tok.encode(text, add_special_tokens=False) == ids
    assert hf_tok.decode(ids) == tokenizer.decode(ids) == text
    assert hf_tok.eos_token_id == tokenizer.eos_id is not None
    assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] == tokenizer.eos_id


def test_cli_convert_both_ways_and_errors(tmp_path, capsys) -> None:
    hf_model = make_hf("llama-mqa-tied-bias")
    hf_model.save_pretrained(tmp_path / "hf")
    assert cli_main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "model")]) == 0
    model = load_model_dir(tmp_path / "model")
    assert_same_logits(hf_model, model, 83)
    assert cli_main(["convert", "--to-hf", str(tmp_path / "model"), "--out", str(tmp_path / "back")]) == 0
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert_same_logits(back, model, 83)
    capsys.readouterr()

    def fails(*argv: str, match: str) -> None:
        assert cli_main(["convert", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and match in err, err

    nowhere = str(tmp_path / "nowhere")
    fails("--from-hf", nowhere, "--out", str(tmp_path / "x"), match="nowhere is not a directory")
    fails("--to-hf", str(tmp_path / "model"), "--out", str(tmp_path / "back"), match="not empty")
    sinusoidal = GPT(ModelConfig(**VARIANTS["original-decoder"]))
    save_model_dir(sinusoidal, tmp_path / "sin")
    fails(
        "--to-hf", str(tmp_path / "sin"), "--out", str(tmp_path / "y"), match="position 'sinusoidal' cannot be exported"
    )
    save_model_dir(GPT(ModelConfig(**dict(VARIANTS["llama-gqa"], logit_softcap=30.0))), tmp_path / "capped")
    fails(
        "--to-hf", str(tmp_path / "capped"), "--out", str(tmp_path / "w"), match="logit_softcap 30.0 cannot be exported"
    )
    rewrite_weights(tmp_path / "hf", lambda s: s.update({"model.norm.weight": torch.ones(47)}))
    fails("--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "z"), match="'model.norm.weight' has shape")
