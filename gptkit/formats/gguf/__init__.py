"""llama.cpp's GGUF file: a gptkit model written as one (`convert --to-gguf`) and read back from one.

GGUF (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) holds key-value metadata (architecture,
hyperparameters, tokenizer) and named tensors; the `gguf` package maintained with llama.cpp reads and writes
it. Two of llama.cpp's architectures compute what a gptkit model computes, and only those are written:
- gpt2: learned positions, LayerNorm, GELU (tanh approximation), pre-norm blocks, fused q/k/v, multi-head;
- llama: RoPE (rotate-half pairs), RMSNorm, SwiGLU, pre-norm, grouped-query attention, no biases.
llama.cpp's llama rotates interleaved pairs (x_{2i}, x_{2i+1}) where gptkit, like Hugging Face's Llama, rotates
(x_i, x_{i+d/2}); the rows of the q and k weights are reordered per head so that both compute the same scores,
as llama.cpp's own converter reorders Hugging Face's.

The tokenizer goes in as llama.cpp's byte-level BPE ("gpt2" model), written and read by its vocab module.
A token that vocabulary adds (a char tokenizer's end-of-text token) gets a zero row in the embedding and the output,
so that its logit is 0 and the model's own tokens keep their logits. Reading accepts the gpt2 and llama
architectures with any tensor type the `gguf` package can dequantise.

GELU: every llama.cpp architecture computes it as the tanh approximation (ggml_gelu, whatever the architecture;
its exact erf form, ggml_gelu_erf, serves only the multimodal encoders), so a model with exact GELU is refused.

Q4_0 is gptkit's int4 (gptkit.quantization.Int4Linear holds the same blocks): writing an int4 model as q4_0 repacks
its bits, and reading a Q4_0 file keeps every layer whose weights are all Q4_0 as an Int4Linear (decoded by
gptkit's int4 kernels); other tensors are dequantised. A quantised model keeps its own LM head (output.weight) and
writes its embedding tables in f32, as gptkit holds them, so that llama.cpp computes what gptkit computes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptkit.atomic import atomic_write
from gptkit.config import ModelConfig
from gptkit.errors import ConfigError
from gptkit.weights import load_state_into, real_vocab_state
from gptkit.model import GPT
from gptkit.quantization import Int4Linear, dequantized_state, is_quantized, quantize_q4
from gptkit.formats.gguf.vocab import GGUFError, inert_merge, tokenizer_from_fields, tokenizer_vocab
from gptkit.tokenizer import Tokenizer

FILE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
LLAMA_FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "bf16": 32}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*
EMBEDDINGS = ("token_embd.weight", "position_embd.weight")
LLAMA_FUSED = ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")  # llama's tensors that gptkit holds fused
# Reading refuses any metadata key it does not map (a key dropped is a model computed otherwise: Llama 3's RoPE
# scaling, a sliding window). Accepted unread: the file's description (general.*) and the tokenizer's keys, which
# change no logit (vocab reads the tokens, merges, types, pre-tokenizer and end-of-text id).
TOKENIZER_GGML_KEYS = (
    "model pre tokens token_type merges eos_token_id bos_token_id add_bos_token add_eos_token padding_token_id "
    "unknown_token_id seperator_token_id eot_token_id eom_token_id"
).split()
TOKENIZER_KEYS = frozenset({f"tokenizer.ggml.{key}" for key in TOKENIZER_GGML_KEYS} | {"tokenizer.chat_template"})
# The hyperparameters _config reads, per architecture (the key after "<arch>.").
SHAPE_KEYS = ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count")
ARCH_KEYS = {
    "gpt2": frozenset({*SHAPE_KEYS, "attention.layer_norm_epsilon", "vocab_size"}),
    "llama": frozenset(
        {
            *SHAPE_KEYS,
            *("attention.head_count_kv", "attention.layer_norm_rms_epsilon", "attention.key_length"),
            *("attention.value_length", "rope.freq_base", "rope.dimension_count", "rope.scaling.type", "vocab_size"),
        }
    ),
}


def _gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise GGUFError("GGUF needs the gguf package: pip install 'gptkit[gguf]'") from None
    return gguf


# ----------------------------------------------------------------------------------------------- the layout


def architecture(config: ModelConfig) -> str:
    """The llama.cpp architecture computing exactly what config does, or a GGUFError saying why none does."""

    def refuse(field: str, why: str) -> GGUFError:
        return GGUFError(f"{field} {getattr(config, field)!r} cannot be written as GGUF: {why}")

    if config.norm_position != "pre":
        raise refuse("norm_position", "llama.cpp's gpt2 and llama normalise before attention and MLP (pre-norm)")
    if config.lm_head_bias:
        raise refuse("lm_head_bias", "llama.cpp's gpt2 and llama have no output bias")
    if config.logit_softcap is not None:
        raise refuse("logit_softcap", "llama.cpp's gpt2 and llama do not soft-cap their logits (only its gemma2 does, "
                     "which differs in more)")
    if config.qk_norm:
        raise refuse("qk_norm", "llama.cpp's gpt2 and llama have no q/k norms")
    if config.position == "learned":
        if config.norm != "layernorm":
            raise refuse("norm", "llama.cpp's gpt2 (learned positions) uses LayerNorm")
        if config.activation == "gelu":
            raise refuse("activation", "llama.cpp computes GELU as its tanh approximation in every architecture "
                         "(no erf GELU); train with --model.activation gelu_tanh to export to llama.cpp")
        if config.activation != "gelu_tanh":
            raise refuse("activation", "llama.cpp's gpt2 computes GELU's tanh approximation (gelu_tanh)")
        if config.n_kv_head != config.n_head:
            raise refuse("n_kv_head", "llama.cpp's gpt2 has no grouped-query attention")
        return "gpt2"
    if config.position == "rope":
        for field, value, why in (("norm", "rmsnorm", "RMSNorm"), ("activation", "swiglu", "SwiGLU")):
            if getattr(config, field) != value:
                raise refuse(field, f"llama.cpp's llama (RoPE) uses {why}")
        for field in ("attn_bias", "mlp_bias"):
            if getattr(config, field):
                raise refuse(field, "llama.cpp's llama has no biases in its projections")
        return "llama"
    raise refuse("position", "llama.cpp computes learned positions (gpt2) or RoPE (llama) only")


def _tensor_names(config: ModelConfig, arch: str) -> dict[str, str]:
    """gptkit's tensor name -> GGUF's, for the names that map one to one (q/k/v and gate/up are split)."""
    names = {"tok_emb.weight": "token_embd.weight", "norm_f.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}  # fmt: skip
    per_block = {"norm1": "attn_norm", "attn.proj": "attn_output", "norm2": "ffn_norm", "mlp.proj": "ffn_down"}
    if arch == "gpt2":
        names.update({"pos_emb.weight": "position_embd.weight", "norm_f.bias": "output_norm.bias"})
        per_block.update({"attn.qkv": "attn_qkv", "mlp.fc": "ffn_up"})
    for i in range(config.n_layer):
        for ours, theirs in per_block.items():
            for part in ("weight", "bias") if arch == "gpt2" else ("weight",):
                names[f"blocks.{i}.{ours}.{part}"] = f"blk.{i}.{theirs}.{part}"
    return names


def _rope_rows(weight: torch.Tensor, heads: int, to_gguf: bool) -> torch.Tensor:
    """A q or k weight's rows reordered within each head between rotate-half pairs (gptkit, Hugging Face) and
    llama.cpp's interleaved pairs (to_gguf), or back."""
    rows = weight.shape[0]
    half = rows // heads // 2
    if to_gguf:  # per head: [first halves; second halves] -> pairs side by side
        return weight.reshape(heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
    return weight.reshape(heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def gguf_tensors(model: GPT, q4_blocks: bool = False, added_tokens: int = 0) -> dict[str, torch.Tensor]:
    """The model's weights under llama.cpp's names and layout (float32, on the CPU; quantised layers dequantised).

    q4_blocks: int4 layers come as their own Q4_0 blocks instead (uint8, a row of bytes per weight row), so that
    writing them is a repacking: quantising their dequantised values again would change weights whose scales
    were fitted (llama-quantize with an importance matrix) rather than taken from each block's largest value.
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
    state = real_vocab_state(state, config)  # a padded vocabulary's extra rows are never used: not written
    if config.tie_embeddings and arch == "llama" and not is_quantized(model):
        state.pop("lm_head.weight")  # llama.cpp's llama reads the embedding as the output when output is absent
    if arch == "gpt2":  # llama.cpp's gpt2 has every bias: absent ones are zeros
        for name, t in list(state.items()):
            if name.endswith(".weight") and name.replace(".weight", ".bias") not in state and t.dim() <= 2 \
                    and not name.startswith(("tok_emb", "pos_emb", "lm_head")):  # fmt: skip
                state[name.replace(".weight", ".bias")] = torch.zeros(t.shape[0])
    names = _tensor_names(config, arch)
    out = {}
    for name, tensor in state.items():
        if name in names:
            out[names[name]] = tensor
            continue
        block, _, rest = name.partition(".")[2].partition(".")
        if rest == "attn.qkv.weight":
            hd = config.head_dim
            q, k, v = tensor.split([config.n_head * hd, config.n_kv_head * hd, config.n_kv_head * hd])
            out[f"blk.{block}.attn_q.weight"] = _rope_rows(q, config.n_head, to_gguf=True)
            out[f"blk.{block}.attn_k.weight"] = _rope_rows(k, config.n_kv_head, to_gguf=True)
            out[f"blk.{block}.attn_v.weight"] = v
        elif rest == "mlp.fc.weight":
            gate, up = tensor.chunk(2)
            out[f"blk.{block}.ffn_gate.weight"], out[f"blk.{block}.ffn_up.weight"] = gate, up
        else:
            raise GGUFError(f"tensor {name} has no place in a GGUF {arch} model")
    for name in ("token_embd.weight", "output.weight"):
        if added_tokens and name in out:
            rows = out[name]
            out[name] = torch.cat([rows, rows.new_zeros(added_tokens, rows.shape[1])])
    return out


# ----------------------------------------------------------------------------------------------- writing


def export_gguf(model: GPT, path: str | Path, tokenizer: Tokenizer | None, file_type: str = "f32",
                chat_template: str | None = None, name: str = "gptkit") -> Path:  # fmt: skip
    """Write model (and its tokenizer, end-of-text id and chat template) as a GGUF file llama.cpp runs."""
    gguf = _gguf()
    if file_type not in FILE_TYPES:
        raise GGUFError(f"--type {file_type!r} is not one of {', '.join(FILE_TYPES)}")
    if tokenizer is None:
        raise GGUFError("the model has no tokenizer to embed; llama.cpp needs one in the file")
    config = model.config
    arch = architecture(config)
    vocab = tokenizer_vocab(tokenizer)
    tokens, types, merges = vocab.tokens, vocab.types, vocab.merges
    if len(tokens) - vocab.added != config.vocab_size:
        raise GGUFError(f"the tokenizer has {len(tokens) - vocab.added} tokens and the model {config.vocab_size} "
                        "embeddings; llama.cpp needs one token per embedding")  # fmt: skip
    tensors = gguf_tensors(model, q4_blocks=file_type == "q4_0", added_tokens=vocab.added)
    path = Path(path)

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), arch)
        writer.add_name(name)
        writer.add_file_type(LLAMA_FILE_TYPES[file_type])
        writer.add_context_length(config.block_size)
        writer.add_embedding_length(config.n_embd)
        writer.add_block_count(config.n_layer)
        writer.add_feed_forward_length(config.ffn_hidden)
        writer.add_head_count(config.n_head)
        if arch == "gpt2":
            writer.add_layer_norm_eps(config.norm_eps)
        else:
            writer.add_head_count_kv(config.n_kv_head)
            writer.add_layer_norm_rms_eps(config.norm_eps)
            writer.add_rope_freq_base(config.rope_theta)
            writer.add_rope_dimension_count(config.head_dim)
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
        quantized = is_quantized(model)
        for tensor_name, tensor in tensors.items():
            kind = "f32" if quantized and tensor_name in EMBEDDINGS else file_type  # looked up, never multiplied
            data, raw_type = _encoded(gguf, tensor.numpy(), kind)
            writer.add_tensor(tensor_name, data, raw_dtype=raw_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    atomic_write(path, write)
    return path


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
        return q4_0_blocks(*quantize_q4(torch.from_numpy(array))), target
    return gguf.quants.quantize(array.astype(np.float32), target), target


def q4_0_blocks(packed: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """Int4Linear's (packed (N, K / 2), fp16 scales (N, K / 32)) as GGUF's Q4_0 rows: per block of 32, the fp16
    scale's two bytes, then the 16 bytes of nibbles (N, K / 32 * 18)."""
    n, blocks = scales.shape
    d = scales.numpy().astype("<f2").view(np.uint8).reshape(n, blocks, 2)
    qs = packed.numpy().reshape(n, blocks, 16)
    return np.concatenate([d, qs], axis=-1).reshape(n, blocks * 18)


def q4_0_parts(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF's Q4_0 rows (N, K / 32 * 18) back as Int4Linear's packed nibbles and fp16 scales."""
    n = blocks.shape[0]
    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(n, -1, 18)
    scales = np.ascontiguousarray(raw[..., :2]).view("<f2").reshape(n, -1)
    packed = np.ascontiguousarray(raw[..., 2:]).reshape(n, -1)
    return torch.from_numpy(packed.copy()), torch.from_numpy(scales.astype(np.float16))


# ----------------------------------------------------------------------------------------------- reading


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
    gguf = _gguf()
    path = Path(path)

    class CheckedReader(gguf.GGUFReader):  # hooks into two internal steps, alike in gguf 0.10 (our oldest) to 0.19
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > len(self.data):  # numpy would hand back a short slice, which fails later with its own words
                raise GGUFError(f"{path} is truncated or its header is corrupt: the header runs to byte {end:,} of a "
                                f"{len(self.data):,}-byte file; download or convert it again")  # fmt: skip
            return super()._get(offset, dtype, count, override_order)

        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            tensors = [_tensor_entry(gguf, path, field) for field in fields]
            _check_layout(path, tensors, int(start_offs), len(self.data), int(self.alignment))
            super()._build_tensors(start_offs, fields)

    try:
        return CheckedReader(str(path))
    except UnicodeDecodeError:
        raise GGUFError(f"{path} is not a readable GGUF file: its header holds a name that is not UTF-8 text (a "
                        "damaged file?)") from None  # fmt: skip
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
        raise GGUFError(f"{path}: tensor {name} has type {int(raw_type[0])}, which the gguf package does not know "
                        "(a corrupt header, or a newer type: upgrade gguf)") from None  # fmt: skip
    if shape and shape[-1] % block:
        raise GGUFError(f"{path}: tensor {name} ({kind.name.lower()}, shape {list(shape)}) has rows that are not whole "
                        f"{block}-value blocks; its type or shape field is wrong")  # fmt: skip
    return name, kind.name.lower(), shape, int(offset[0]), math.prod(shape) // block * type_size


def _check_layout(path: Path, tensors: list[tuple[str, str, tuple[int, ...], int, int]], start: int, size: int,
                  alignment: int) -> None:  # fmt: skip
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
            raise GGUFError(f"{path}: tensor {previous} ({kind_before}, shape {list(shape_before)}) needs "
                            f"{length_before:,} bytes but the next tensor starts {offset - offset_before:,} bytes "
                            "after it: its type or shape field does not match its data")  # fmt: skip
        if start + offset + length > size:
            raise GGUFError(f"{described} but the file ends {max(size - start - offset, 0):,} bytes into it: the file "
                            "is truncated; download or convert it again")  # fmt: skip
        expected = offset + -(-length // alignment) * alignment
    if tensors and size - (start + tensors[-1][3] + tensors[-1][4]) >= alignment:
        name, kind, shape, offset, length = tensors[-1]
        raise GGUFError(f"{path}: tensor {name} ({kind}, shape {list(shape)}) needs {length:,} bytes but "
                        f"{size - start - offset:,} bytes follow it to the end of the file: its type or shape field "
                        "does not match its data (or something was appended to the file)")  # fmt: skip


def _fields(reader: Any, path: Path, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The file's metadata (or those of keys it holds) as Python values; a value that does not decode is a
    GGUFError naming its key."""
    fields = {}
    for name, field in reader.fields.items():
        if keys is not None and name not in keys:
            continue
        try:
            fields[name] = field.contents()
        except (ValueError, IndexError) as err:  # UnicodeDecodeError is a ValueError
            raise GGUFError(f"{path}: metadata {name!r} is corrupt ({type(err).__name__}); the file is "
                            "damaged") from None
    return fields


def load_gguf(path: str | Path, dtype: torch.dtype | None = None,
              device: torch.device | str | None = None) -> tuple[GPT, Tokenizer]:  # fmt: skip
    """(model, tokenizer) of a GGUF file of llama.cpp's gpt2 or llama architecture: layers whose weights are Q4_0 as
    Int4Linear, every other tensor dequantised."""
    gguf = _gguf()
    path = Path(path)
    reader = open_gguf(path)
    fields = _fields(reader, path)
    arch = fields.get("general.architecture")
    if arch not in ("gpt2", "llama"):
        raise GGUFError(f"{path} holds a {arch!r} model; gptkit reads GGUF's gpt2 and llama architectures")
    _check_keys(fields, arch, path)
    tensors, q4 = {}, {}
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))
        data = np.asarray(tensor.data)
        if tensor.tensor_type == gguf.GGMLQuantizationType.Q4_0 and len(shape) == 2:
            q4[tensor.name] = q4_0_parts(data.reshape(shape[0], -1))
        if tensor.tensor_type != gguf.GGMLQuantizationType.F32:
            try:
                data = gguf.quants.dequantize(data, tensor.tensor_type)
            except NotImplementedError:
                raise GGUFError(f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which the gguf "
                                "package cannot dequantise") from None  # fmt: skip
        tensors[tensor.name] = torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))  # owned, not mapped
    try:
        config = _config(fields, tensors, arch, path)
    except ConfigError as err:  # hyperparameters no model can have: say which file holds them
        raise GGUFError(f"{path}: {err}") from None
    state = _gptkit_state(tensors, config, arch, path)
    if config.tie_embeddings:
        state.pop("lm_head.weight")  # load_state_into ties the head to the embedding
    with torch.device("meta"):
        model = GPT(config)
    model = load_state_into(model, state, str(path))  # shapes, and NaN or infinite weights, refused by name
    model = model.to(device=device, dtype=dtype) if (device is not None or dtype is not None) else model
    _int4_layers(model, q4, arch)
    return model.eval(), tokenizer_from_fields(fields, path)


def _int4_layers(model: GPT, q4: dict[str, tuple[torch.Tensor, torch.Tensor]], arch: str) -> None:
    """Replace each linear layer whose GGUF tensors are all Q4_0 by an Int4Linear over those bits, its rows arranged
    as _gptkit_state arranges the float weights."""
    config = model.config
    names = {ours: theirs for ours, theirs in _tensor_names(config, arch).items()}
    head = "output.weight" if not config.tie_embeddings else "token_embd.weight"
    parts: dict[str, list[tuple[str, int]]] = {"lm_head": [(head, 0)]}  # layer -> (GGUF tensor, heads to reorder)
    for i in range(config.n_layer):
        for layer in ("attn.proj", "mlp.proj") + (("attn.qkv", "mlp.fc") if arch == "gpt2" else ()):
            parts[f"blocks.{i}.{layer}"] = [(names[f"blocks.{i}.{layer}.weight"], 0)]
        if arch == "llama":
            parts[f"blocks.{i}.attn.qkv"] = [(f"blk.{i}.attn_q.weight", config.n_head),
                                             (f"blk.{i}.attn_k.weight", config.n_kv_head),
                                             (f"blk.{i}.attn_v.weight", 0)]
            parts[f"blocks.{i}.mlp.fc"] = [(f"blk.{i}.ffn_gate.weight", 0), (f"blk.{i}.ffn_up.weight", 0)]
    for layer, pieces in parts.items():
        if not all(name in q4 for name, _ in pieces):
            continue
        arranged = [tuple(_rope_rows(t, heads, to_gguf=False) if heads else t for t in q4[name])
                    for name, heads in pieces]  # fmt: skip
        packed, scales = (torch.cat(column) for column in zip(*arranged))
        parent_name, _, child = layer.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        new = Int4Linear.from_q4(packed, scales, old.bias).to(old.weight.device)
        setattr(parent, child, new)


def gguf_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer a GGUF file carries (its tensors are not read)."""
    return tokenizer_from_fields(_fields(open_gguf(path), Path(path)), Path(path))


def gguf_chat_template(path: str | Path) -> str | None:
    """The chat template a GGUF file carries (tokenizer.chat_template), or None."""
    key = "tokenizer.chat_template"
    return _fields(open_gguf(path), Path(path), (key,)).get(key)


def _check_keys(fields: dict[str, Any], arch: str, path: Path) -> None:
    """Refuse, naming it, the first metadata key that is neither mapped onto the model nor inert."""
    for key in fields:
        if key.startswith(("GGUF.", "general.")) or key in TOKENIZER_KEYS:  # GGUF.*: the reader's header fields
            continue
        if key.startswith(f"{arch}.") and key.removeprefix(f"{arch}.") in ARCH_KEYS[arch]:
            continue
        raise GGUFError(
            f"{path}: metadata {key!r} is not one gptkit maps onto a GGUF {arch} model; read without it "
            "the model would compute something else, so the file is refused"
        )


def _field(fields: dict[str, Any], key: str, path: Path, default: Any = None) -> Any:
    value = fields.get(key, default)
    if value is None:
        raise GGUFError(f"{path} has no {key!r}")
    return value


def _decimal(value: Any) -> float:
    """A float32 from the file as the shortest decimal that rounds to it (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(value)))


def _config(fields: dict[str, Any], tensors: dict[str, torch.Tensor], arch: str, path: Path) -> ModelConfig:
    """The ModelConfig a GGUF file's hyperparameters describe, refusing what gptkit cannot compute alike."""
    get = lambda key, default=None: _field(fields, f"{arch}.{key}", path, default)  # noqa: E731
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path} has no tensor token_embd.weight (the token embedding)")
    n_head = int(get("attention.head_count"))
    common = dict(vocab_size=int(tensors["token_embd.weight"].shape[0]), block_size=int(get("context_length")),
                  n_layer=int(get("block_count")), n_head=n_head, n_embd=int(get("embedding_length")),
                  ffn_hidden=int(get("feed_forward_length")), norm_position="pre",
                  tie_embeddings="output.weight" not in tensors)  # fmt: skip
    if arch == "gpt2":
        if "output.weight" in tensors and torch.equal(tensors["output.weight"], tensors["token_embd.weight"]):
            common["tie_embeddings"] = True  # llama.cpp's converter writes GPT-2's tied head a second time
        return ModelConfig(**common, activation="gelu_tanh", norm="layernorm", position="learned",
                           norm_eps=_decimal(get("attention.layer_norm_epsilon")), lm_head_bias=False)  # fmt: skip
    if fields.get("llama.rope.scaling.type") not in (None, "none"):
        scaling = fields["llama.rope.scaling.type"]
        raise GGUFError(f"{path}: metadata 'llama.rope.scaling.type' is {scaling!r}; gptkit reads llama without it")
    n_kv = int(get("attention.head_count_kv", n_head))
    head_dim = common["n_embd"] // n_head
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        if int(get(key, head_dim)) != head_dim:
            raise GGUFError(
                f"{path}: metadata 'llama.{key}' is {int(get(key))}, not the head size {head_dim} "
                "(embedding_length / head_count), which gptkit's llama needs"
            )
    return ModelConfig(**common, n_kv_head=n_kv, activation="swiglu", norm="rmsnorm", position="rope",
                       norm_eps=_decimal(get("attention.layer_norm_rms_epsilon")),
                       rope_theta=_decimal(get("rope.freq_base", 10000.0)),
                       attn_bias=False, mlp_bias=False, norm_bias=False, lm_head_bias=False)  # fmt: skip


def _gptkit_state(tensors: dict[str, torch.Tensor], config: ModelConfig, arch: str, path: Path) -> dict[str, torch.Tensor]:
    """GGUF's tensors under gptkit's names and layout (q/k rows back to rotate-half pairs, q/k/v fused)."""
    names = {theirs: ours for ours, theirs in _tensor_names(config, arch).items()}
    fused = {f"blk.{i}.{part}.weight" for i in range(config.n_layer) for part in LLAMA_FUSED} if arch == "llama" else ()
    unmapped = [name for name in tensors if name not in names and name not in fused]
    if unmapped:  # dropped, it would leave the model computing something else (Llama 3's rope_freqs.weight)
        raise GGUFError(
            f"{path} holds tensor {unmapped[0]}, which gptkit does not map onto a GGUF {arch} model; "
            "the file is refused rather than read without it"
        )
    state: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name in names:
            state[names[name]] = tensor
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)
        state["lm_head.weight"] = state["tok_emb.weight"]
    if arch == "llama":
        for i in range(config.n_layer):
            get = lambda part: tensors.get(f"blk.{i}.{part}.weight")  # noqa: E731
            missing = [part for part in LLAMA_FUSED if get(part) is None]
            if missing:
                raise GGUFError(f"{path} has no tensor blk.{i}.{missing[0]}.weight")
            q, k = _rope_rows(get("attn_q"), config.n_head, False), _rope_rows(get("attn_k"), config.n_kv_head, False)
            state[f"blocks.{i}.attn.qkv.weight"] = torch.cat([q, k, get("attn_v")])
            state[f"blocks.{i}.mlp.fc.weight"] = torch.cat([get("ffn_gate"), get("ffn_up")])
    with torch.device("meta"):  # the names only
        expected = set(GPT(config).state_dict())
    missing = sorted(expected - set(state))
    if missing:
        raise GGUFError(f"{path} lacks the tensor gptkit calls {missing[0]!r}")
    return {name: state[name] for name in expected}
