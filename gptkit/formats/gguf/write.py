"""A gptkit model written as a GGUF file llama.cpp runs: its tensors under llama.cpp's names and layout, its
hyperparameters, tokenizer and chat template."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptkit.atomic import atomic_write
from gptkit.config import ModelConfig
from gptkit.formats.gguf.archs import Arch, rope_rows, router_names, split_tensors, tensor_names
from gptkit.formats.gguf.gelu import MAX_CHANGE, PROBE_LENGTH, PROBE_ROWS, tanh_gelu_change
from gptkit.formats.gguf.header import gguf_package
from gptkit.formats.gguf.hparams import FLOAT_KEYS, architecture, config_keys, rope_divisors
from gptkit.formats.gguf.q4_0 import q4_0_blocks
from gptkit.formats.gguf.vocab import GGUFError, inert_merge, tokenizer_vocab
from gptkit.layers import RMSNorm
from gptkit.model import GPT
from gptkit.quantization import Int4Experts, Int4Linear, dequantized_state, is_quantized, quantize_q4
from gptkit.tokenizer import Tokenizer
from gptkit.weights import real_vocab_state

logger = logging.getLogger(__name__)
FILE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
LLAMA_FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "bf16": 32}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*
EMBEDDINGS = ("token_embd.weight", "position_embd.weight")


def gguf_tensors(model: GPT, q4_blocks: bool = False, added_tokens: int = 0) -> dict[str, torch.Tensor]:
    """The model's weights under llama.cpp's names and layout (float32, on the CPU; quantised layers dequantised).

    q4_blocks: int4 layers and expert stacks come as their own Q4_0 blocks instead (uint8, a row of bytes per weight
    row), so that writing them is a repacking: quantising their dequantised values again would change weights whose
    scales were fitted (llama-quantize with an importance matrix) rather than taken from each block's largest value.
    added_tokens: zero rows appended to the embedding and the output for tokens the file adds (a zero output row
    gives its token the logit 0 whatever the input)."""
    config = model.config
    arch = architecture(config)
    state = {name: t.detach().float().cpu() for name, t in dequantized_state(model).items()}
    if q4_blocks:
        for module_name, module in model.named_modules():
            if isinstance(module, Int4Linear):
                packed, scales = module.plain()
                state[f"{module_name}.weight"] = torch.from_numpy(q4_0_blocks(packed.cpu(), scales.cpu()))
            elif isinstance(module, Int4Experts):  # each expert's rows as Int4Linear's: (E, out, in / 32 * 18)
                packed, scales = (t.cpu().flatten(0, 1) for t in module.plain())  # (E * out, in / 2), (E * out, ...)
                rows = torch.from_numpy(q4_0_blocks(packed, scales))  # (E * out, in / 32 * 18)
                state[f"{module_name}.weight"] = rows.view(module.weight.size(0), module.out_features, -1)
    state = real_vocab_state(state, config)  # a padded vocabulary's extra rows are never used: not written
    if config.tie_embeddings and not arch.needs_output and not is_quantized(model):
        state.pop("lm_head.weight")  # llama.cpp reads the embedding as the output when output is absent
    for module_name, module in model.named_modules():
        if isinstance(module, RMSNorm) and config.norm_gain_offset:  # llama.cpp multiplies by the stored gain
            state[f"{module_name}.weight"] = state[f"{module_name}.weight"] + config.norm_gain_offset
    _zero_biases(state, config, arch)
    names, split = tensor_names(config, arch), split_tensors(config, arch)
    out = {}
    for name, tensor in state.items():
        if name in names:
            out[names[name]] = tensor
        elif name in split:
            pieces = split[name]
            rows = tensor.split([piece.rows for piece in pieces], dim=pieces[0].dim)
            for piece, part in zip(pieces, rows):
                out[piece.name] = rope_rows(part, piece.heads, to_gguf=True) if piece.heads else part.contiguous()
        else:
            raise GGUFError(f"tensor {name} has no place in a GGUF {arch.name} model")
    divisors = rope_divisors(config) if arch.rope_freqs else None
    if divisors is not None:
        out["rope_freqs.weight"] = torch.tensor(divisors, dtype=torch.float32)
    for name in ("token_embd.weight", "output.weight"):
        if added_tokens and name in out:
            rows = out[name]
            out[name] = torch.cat([rows, rows.new_zeros(added_tokens, rows.shape[1])])
    return out


def _zero_biases(state: dict[str, torch.Tensor], config: ModelConfig, arch: Arch) -> None:
    """Biases the architecture has and the model lacks written as zeros (gpt2 and GPT-NeoX have every one, Qwen2
    q/k/v's); one the architecture lacks must be zero (Qwen2's output projection) and is left out."""
    for i in range(config.n_layer):
        for layer, flag in (("attn.qkv", "attn_bias"), ("attn.proj", "attn_bias"), ("mlp.fc", "mlp_bias")):
            bias = f"blocks.{i}.{layer}.bias"
            if layer == "attn.proj" and arch.no_proj_bias:
                if bias in state and state.pop(bias).any():
                    raise GGUFError(f"{bias} is not zero: llama.cpp's {arch.name} has no output projection bias")
            elif arch.fixed.get(flag) and bias not in state:
                state[bias] = torch.zeros(state[f"blocks.{i}.{layer}.weight"].shape[0])
        if arch.fixed.get("norm_bias"):
            for norm in ("norm1", "norm2"):
                state.setdefault(f"blocks.{i}.{norm}.bias", torch.zeros(config.n_embd))
        if arch.fixed.get("mlp_bias") and f"blocks.{i}.mlp.proj.bias" not in state:
            state[f"blocks.{i}.mlp.proj.bias"] = torch.zeros(config.n_embd)
    if arch.fixed.get("norm_bias"):
        state.setdefault("norm_f.bias", torch.zeros(config.n_embd))


def export_gguf(
    model: GPT,
    path: str | Path,
    tokenizer: Tokenizer | None,
    file_type: str = "f32",
    chat_template: str | None = None,
    name: str = "gptkit",
) -> Path:
    """Write model (and its tokenizer, end-of-text id and chat template) as a GGUF file llama.cpp runs."""
    gguf = gguf_package()
    if file_type not in FILE_TYPES:
        raise GGUFError(f"--type {file_type!r} is not one of {', '.join(FILE_TYPES)}")
    if tokenizer is None:
        raise GGUFError("the model has no tokenizer to embed; llama.cpp needs one in the file")
    config = model.config
    arch = architecture(config)
    vocab = tokenizer_vocab(tokenizer)
    tokens, types, merges = vocab.tokens, vocab.types, vocab.merges
    if len(tokens) - vocab.added != config.vocab_size:
        raise GGUFError(
            f"the tokenizer has {len(tokens) - vocab.added} tokens and the model {config.vocab_size} "
            "embeddings; llama.cpp needs one token per embedding"
        )
    if config.activation == "gelu":
        _check_tanh_gelu(model)
    tensors = gguf_tensors(model, q4_blocks=file_type == "q4_0", added_tokens=vocab.added)
    path = Path(path)

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), arch.name)
        writer.add_name(name)
        writer.add_file_type(LLAMA_FILE_TYPES[file_type])
        for key, value in config_keys(config, arch).items():
            _add_key(gguf, writer, f"{arch.name}.{key}", value)
        if arch.name != "gpt2":
            writer.add_vocab_size(len(tokens))
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(vocab.pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges or [inert_merge(tokens, types)])
        if vocab.eos_id is not None:
            writer.add_eos_token_id(vocab.eos_id)
        bos = tokenizer.prompt_bos_id()
        writer.add_add_bos_token(bos is not None)
        if bos is not None:
            writer.add_bos_token_id(bos)
        if chat_template:
            writer.add_chat_template(chat_template)
        float32 = router_names(config) | (set(EMBEDDINGS) if is_quantized(model) else set())
        for tensor_name, tensor in tensors.items():
            # embeddings are looked up, never multiplied; a rounded router could route a token elsewhere
            kind = "f32" if tensor_name in float32 else file_type
            data, raw_type = _encoded(gguf, tensor.numpy(), kind)
            writer.add_tensor(tensor_name, data, raw_dtype=raw_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    atomic_write(path, write)
    return path


def _add_key(gguf: Any, writer: Any, key: str, value: Any) -> None:
    """One metadata key in GGUF's type for it: float32 for the floats, uint32 for counts, a list of flags as bools."""
    kinds = gguf.GGUFValueType
    if isinstance(value, list):
        writer.add_key_value(key, value, kinds.ARRAY, sub_type=kinds.BOOL)
    elif isinstance(value, bool):
        writer.add_key_value(key, value, kinds.BOOL)
    elif isinstance(value, str):
        writer.add_key_value(key, value, kinds.STRING)
    elif key.split(".", 1)[1] in FLOAT_KEYS:
        writer.add_key_value(key, float(value), kinds.FLOAT32)
    else:
        writer.add_key_value(key, int(value), kinds.UINT32)


def _check_tanh_gelu(model: GPT) -> None:
    """Warn how much an exact-GELU model's logits change as llama.cpp computes it (tanh GELU); refuse past
    MAX_CHANGE."""
    change = tanh_gelu_change(model)
    if change > MAX_CHANGE:
        raise GGUFError(
            f"activation 'gelu' cannot be written as GGUF: llama.cpp computes GELU as its tanh approximation, which "
            f"changes this model's logits by up to {change:.3g} (more than {MAX_CHANGE}); train with "
            "--model.activation gelu_tanh to export to llama.cpp"
        )
    logger.warning(
        "exact GELU written as llama.cpp's tanh approximation (the only GELU it computes): on %d x %d random tokens "
        "this model's logits change by at most %.2g",
        PROBE_ROWS,
        min(model.config.block_size, PROBE_LENGTH),
        change,
    )


def _encoded(gguf: Any, array: np.ndarray, file_type: str) -> tuple[np.ndarray, Any]:
    """A tensor's data in the file's type: vectors stay float32 (as llama.cpp's converter keeps norms and biases),
    matrices take the file type (q8_0 and q4_0 where rows are whole 32-value blocks, else float16)."""
    kinds = gguf.GGMLQuantizationType
    if array.dtype == np.uint8:  # an int4 layer's own Q4_0 blocks (gguf_tensors' q4_blocks)
        return array, kinds.Q4_0
    if array.ndim == 1 or file_type == "f32":
        return array.astype(np.float32), kinds.F32
    target = {"f16": kinds.F16, "bf16": kinds.BF16, "q8_0": kinds.Q8_0, "q4_0": kinds.Q4_0}[file_type]
    if target in (kinds.Q8_0, kinds.Q4_0) and array.shape[-1] % 32:
        target = kinds.F16
    if target == kinds.F16:
        return array.astype(np.float16), kinds.F16
    if target == kinds.Q4_0:  # gptkit's own Q4_0 (what an int4 model holds), in GGUF's blocks
        rows = torch.from_numpy(array).reshape(-1, array.shape[-1])  # experts' (E, out, in) -> (E * out, in)
        return q4_0_blocks(*quantize_q4(rows)).reshape(*array.shape[:-1], -1), target
    return gguf.quants.quantize(array.astype(np.float32), target), target
