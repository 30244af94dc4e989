"""A GGUF file of llama.cpp's gpt2 or llama architecture read as a gptkit model and tokenizer, refusing any tensor
or metadata key it does not map."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptkit.config import ModelConfig
from gptkit.errors import ConfigError
from gptkit.formats.gguf.archs import ARCH_KEYS, LLAMA_FUSED, TOKENIZER_KEYS, rope_rows, tensor_names
from gptkit.formats.gguf.header import gguf_package, open_gguf, read_fields
from gptkit.formats.gguf.q4_0 import q4_0_parts
from gptkit.formats.gguf.vocab import GGUFError, tokenizer_from_fields
from gptkit.model import GPT
from gptkit.quantization import Int4Linear
from gptkit.tokenizer import Tokenizer
from gptkit.weights import load_state_into


def load_gguf(
    path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> tuple[GPT, Tokenizer]:
    """(model, tokenizer) of a GGUF file of llama.cpp's gpt2 or llama architecture: layers whose weights are Q4_0 as
    Int4Linear, every other tensor dequantised."""
    gguf = gguf_package()
    path = Path(path)
    reader = open_gguf(path)
    fields = read_fields(reader, path)
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
                raise GGUFError(
                    f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which the gguf "
                    "package cannot dequantise"
                ) from None
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
    names = {ours: theirs for ours, theirs in tensor_names(config, arch).items()}
    head = "output.weight" if not config.tie_embeddings else "token_embd.weight"
    parts: dict[str, list[tuple[str, int]]] = {"lm_head": [(head, 0)]}  # layer -> (GGUF tensor, heads to reorder)
    for i in range(config.n_layer):
        for layer in ("attn.proj", "mlp.proj") + (("attn.qkv", "mlp.fc") if arch == "gpt2" else ()):
            parts[f"blocks.{i}.{layer}"] = [(names[f"blocks.{i}.{layer}.weight"], 0)]
        if arch == "llama":
            parts[f"blocks.{i}.attn.qkv"] = [
                (f"blk.{i}.attn_q.weight", config.n_head),
                (f"blk.{i}.attn_k.weight", config.n_kv_head),
                (f"blk.{i}.attn_v.weight", 0),
            ]
            parts[f"blocks.{i}.mlp.fc"] = [(f"blk.{i}.ffn_gate.weight", 0), (f"blk.{i}.ffn_up.weight", 0)]
    for layer, pieces in parts.items():
        if not all(name in q4 for name, _ in pieces):
            continue
        arranged = [
            tuple(rope_rows(t, heads, to_gguf=False) if heads else t for t in q4[name]) for name, heads in pieces
        ]
        packed, scales = (torch.cat(column) for column in zip(*arranged))
        parent_name, _, child = layer.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        new = Int4Linear.from_q4(packed, scales, old.bias).to(old.weight.device)
        setattr(parent, child, new)


def gguf_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer a GGUF file carries (its tensors are not read)."""
    return tokenizer_from_fields(read_fields(open_gguf(path), Path(path)), Path(path))


def gguf_chat_template(path: str | Path) -> str | None:
    """The chat template a GGUF file carries (tokenizer.chat_template), or None."""
    key = "tokenizer.chat_template"
    return read_fields(open_gguf(path), Path(path), (key,)).get(key)


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
    get = lambda key, default=None: _field(fields, f"{arch}.{key}", path, default)
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path} has no tensor token_embd.weight (the token embedding)")
    n_head = int(get("attention.head_count"))
    common = dict(
        vocab_size=int(tensors["token_embd.weight"].shape[0]),
        block_size=int(get("context_length")),
        n_layer=int(get("block_count")),
        n_head=n_head,
        n_embd=int(get("embedding_length")),
        ffn_hidden=int(get("feed_forward_length")),
        norm_position="pre",
        tie_embeddings="output.weight" not in tensors,
    )
    if arch == "gpt2":
        if "output.weight" in tensors and torch.equal(tensors["output.weight"], tensors["token_embd.weight"]):
            common["tie_embeddings"] = True  # llama.cpp's converter writes GPT-2's tied head a second time
        return ModelConfig(
            **common,
            activation="gelu_tanh",
            norm="layernorm",
            position="learned",
            norm_eps=_decimal(get("attention.layer_norm_epsilon")),
            lm_head_bias=False,
        )
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
    return ModelConfig(
        **common,
        n_kv_head=n_kv,
        activation="swiglu",
        norm="rmsnorm",
        position="rope",
        norm_eps=_decimal(get("attention.layer_norm_rms_epsilon")),
        rope_theta=_decimal(get("rope.freq_base", 10000.0)),
        attn_bias=False,
        mlp_bias=False,
        norm_bias=False,
        lm_head_bias=False,
    )


def _gptkit_state(
    tensors: dict[str, torch.Tensor], config: ModelConfig, arch: str, path: Path
) -> dict[str, torch.Tensor]:
    """GGUF's tensors under gptkit's names and layout (q/k rows back to rotate-half pairs, q/k/v fused)."""
    names = {theirs: ours for ours, theirs in tensor_names(config, arch).items()}
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
            get = lambda part: tensors.get(f"blk.{i}.{part}.weight")
            missing = [part for part in LLAMA_FUSED if get(part) is None]
            if missing:
                raise GGUFError(f"{path} has no tensor blk.{i}.{missing[0]}.weight")
            q, k = rope_rows(get("attn_q"), config.n_head, False), rope_rows(get("attn_k"), config.n_kv_head, False)
            state[f"blocks.{i}.attn.qkv.weight"] = torch.cat([q, k, get("attn_v")])
            state[f"blocks.{i}.mlp.fc.weight"] = torch.cat([get("ffn_gate"), get("ffn_up")])
    with torch.device("meta"):  # the names only
        expected = set(GPT(config).state_dict())
    missing = sorted(expected - set(state))
    if missing:
        raise GGUFError(f"{path} lacks the tensor gptkit calls {missing[0]!r}")
    return {name: state[name] for name in expected}
