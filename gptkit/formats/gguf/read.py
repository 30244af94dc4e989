"""A GGUF file of one of the llama.cpp architectures gptkit maps (archs.ARCHS) read as a gptkit model and tokenizer,
refusing any tensor or metadata key it does not map."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptkit.config import ModelConfig
from gptkit.errors import ConfigError
from gptkit.formats.gguf.archs import ARCHS, TOKENIZER_KEYS, Arch, rope_rows, split_tensors, tensor_names
from gptkit.formats.gguf.header import gguf_package, open_gguf, read_fields
from gptkit.formats.gguf.hparams import config_from_keys
from gptkit.formats.gguf.q4_0 import q4_0_parts
from gptkit.formats.gguf.vocab import GGUFError, tokenizer_from_fields
from gptkit.model import GPT
from gptkit.q4_blocks import dequantize_q4
from gptkit.quantization import Int4Experts, Int4Linear
from gptkit.tokenizer import Tokenizer
from gptkit.weights import load_state_into


def load_gguf(
    path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> tuple[GPT, Tokenizer]:
    """(model, tokenizer) of a GGUF file of one of the llama.cpp architectures gptkit maps (archs.ARCHS): layers whose
    weights are Q4_0 as Int4Linear, expert stacks whose weights are Q4_0 as Int4Experts, every other tensor
    dequantised (Q8_0 too: its scale per block of 32 has no place in Int8Linear's one scale per row)."""
    gguf = gguf_package()
    path = Path(path)
    reader = open_gguf(path)
    fields = read_fields(reader, path)
    name = fields.get("general.architecture")
    if name not in ARCHS:
        raise GGUFError(f"{path} holds a {name!r} model; gptkit reads GGUF's {', '.join(ARCHS)} architectures")
    arch = ARCHS[name]
    _check_keys(fields, arch, path)
    tensors, q4 = {}, {}
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))
        data = np.asarray(tensor.data)
        if tensor.tensor_type == gguf.GGMLQuantizationType.Q4_0 and len(shape) == 3:
            # an expert stack (E, out, in): kept as its blocks, never dequantised (a float copy is 7x the bytes);
            # a meta tensor stands in for its shape until _int4_stacks puts the blocks in its place
            packed, scales = q4_0_parts(data.reshape(shape[0] * shape[1], -1))  # rows (E * out, in / 32 * 18)
            # (E * out, in / 2) and (E * out, in / 32) -> (E, out, in / 2) and (E, out, in / 32)
            q4[tensor.name] = packed.view(*shape[:2], -1), scales.view(*shape[:2], -1)
            tensors[tensor.name] = torch.empty(shape, device="meta")
            continue
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
    _dequantize_mixed_stacks(tensors, q4, config, arch)
    state = _gptkit_state(tensors, config, arch, path)
    if config.tie_embeddings:
        state.pop("lm_head.weight")  # load_state_into ties the head to the embedding
    with torch.device("meta"):
        model = GPT(config)
        _int4_stacks(model, state, q4, arch)
    model = load_state_into(model, state, str(path))  # shapes, and NaN or infinite weights, refused by name
    model = model.to(device=device, dtype=dtype) if (device is not None or dtype is not None) else model
    _int4_layers(model, q4, arch)
    return model.eval(), tokenizer_from_fields(fields, path)


def _int4_layers(model: GPT, q4: dict[str, tuple[torch.Tensor, torch.Tensor]], arch: Arch) -> None:
    """Replace each linear layer whose GGUF tensors are all Q4_0 by an Int4Linear over those bits, its rows arranged
    as _gptkit_state arranges the float weights."""
    config = model.config
    names, split = tensor_names(config, arch), split_tensors(config, arch)
    head = "output.weight" if not config.tie_embeddings else "token_embd.weight"
    parts: dict[str, list[tuple[str, int]]] = {"lm_head": [(head, 0)]}  # layer -> (GGUF tensor, heads to reorder)
    for i in range(config.n_layer):
        dense = ("mlp.fc", "mlp.proj")
        if config.is_moe_layer(i):  # its mlp.fc and mlp.proj are expert stacks (_int4_stacks); a shared expert is dense
            dense = ("mlp.shared.fc", "mlp.shared.proj") if config.moe_shared_hidden is not None else ()
        for layer in ("attn.qkv", "attn.proj", *dense):
            weight = f"blocks.{i}.{layer}.weight"
            pieces = [(names[weight], 0)] if weight in names else [(piece.name, piece.heads) for piece in split[weight]]
            parts[f"blocks.{i}.{layer}"] = pieces
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


def _expert_stacks(config: ModelConfig, arch: Arch) -> dict[str, list[str]]:
    """Each expert stack's gptkit module name (blocks.{i}.mlp.fc, .proj) -> its GGUF tensors, stacked in order."""
    names, split = tensor_names(config, arch), split_tensors(config, arch)
    stacks = {}
    for i in range(config.n_layer):
        if config.is_moe_layer(i):
            for stack in (f"blocks.{i}.mlp.fc", f"blocks.{i}.mlp.proj"):
                weight = f"{stack}.weight"
                stacks[stack] = [names[weight]] if weight in names else [piece.name for piece in split[weight]]
    return stacks


def _dequantize_mixed_stacks(
    tensors: dict[str, torch.Tensor], q4: dict[str, tuple[torch.Tensor, torch.Tensor]], config: ModelConfig, arch: Arch
) -> None:
    """Dequantise the Q4_0 expert tensors of a stack whose other pieces are not Q4_0 (gate Q4_0 beside up Q8_0): the
    stack is then read as floats, as any other tensor type is."""
    for pieces in _expert_stacks(config, arch).values():
        if all(name in q4 for name in pieces):
            continue
        for name in pieces:
            if name in q4 and tensors[name].is_meta:
                packed, scales = q4.pop(name)  # (E, out, in / 2), (E, out, in / 32)
                rows = dequantize_q4(packed.flatten(0, 1), scales.flatten(0, 1))  # (E * out, in)
                tensors[name] = rows.view(tensors[name].shape)  # (E, out, in)


def _int4_stacks(
    model: GPT, state: dict[str, torch.Tensor], q4: dict[str, tuple[torch.Tensor, torch.Tensor]], arch: Arch
) -> None:
    """Replace each expert stack (on the meta model) whose GGUF tensors are all Q4_0 by an Int4Experts, and its
    state's float stand-in by those blocks, stacked as _gptkit_state stacks float pieces: the file's very bits."""
    for stack, pieces in _expert_stacks(model.config, arch).items():
        if not all(name in q4 for name in pieces):
            continue
        packed, scales = (torch.cat(column, dim=1) for column in zip(*(q4[name] for name in pieces)))
        state[f"{stack}.weight"], state[f"{stack}.scales"] = packed, scales  # (E, out, in / 2), (E, out, in / 32)
        parent_name, _, child = stack.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        n, out, width = old.weight.shape
        setattr(parent, child, Int4Experts(n, width, out, old.bias is not None))


def gguf_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer a GGUF file carries (its tensors are not read)."""
    return tokenizer_from_fields(read_fields(open_gguf(path), Path(path)), Path(path))


def gguf_chat_template(path: str | Path) -> str | None:
    """The chat template a GGUF file carries (tokenizer.chat_template), or None."""
    key = "tokenizer.chat_template"
    return read_fields(open_gguf(path), Path(path), (key,)).get(key)


def _check_keys(fields: dict[str, Any], arch: Arch, path: Path) -> None:
    """Refuse, naming it, the first metadata key that is neither mapped onto the model nor inert."""
    for key in fields:
        if key.startswith(("GGUF.", "general.")) or key in TOKENIZER_KEYS:  # GGUF.*: the reader's header fields
            continue
        if key.startswith(f"{arch.name}.") and key.removeprefix(f"{arch.name}.") in arch.keys:
            continue
        raise GGUFError(
            f"{path}: metadata {key!r} is not one gptkit maps onto a GGUF {arch.name} model; read without it "
            "the model would compute something else, so the file is refused"
        )


def _config(fields: dict[str, Any], tensors: dict[str, torch.Tensor], arch: Arch, path: Path) -> ModelConfig:
    """The ModelConfig a GGUF file's hyperparameters and tensors describe."""
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path} has no tensor token_embd.weight (the token embedding)")
    tie = "output.weight" not in tensors
    if not tie and arch.extras.get("tied"):
        raise GGUFError(f"{path} holds output.weight, which llama.cpp's {arch.name} never reads (it ties the output)")
    if arch.needs_output and not tie and torch.equal(tensors["output.weight"], tensors["token_embd.weight"]):
        tie = True  # a tied head written a second time because the graph requires output.weight: the same logits

    def get(key: str, default: Any = None) -> Any:
        value = fields.get(f"{arch.name}.{key}", default)
        if value is None:
            raise GGUFError(f"{path} has no {arch.name + '.' + key!r}")
        return value

    divisors = tensors["rope_freqs.weight"].tolist() if "rope_freqs.weight" in tensors else None
    vocab_size = int(tensors["token_embd.weight"].shape[0])
    try:
        return config_from_keys(arch, get, vocab_size, tie, divisors)
    except GGUFError as err:
        raise GGUFError(f"{path}: {err}") if not str(err).startswith(str(path)) else err from None


def _gptkit_state(
    tensors: dict[str, torch.Tensor], config: ModelConfig, arch: Arch, path: Path
) -> dict[str, torch.Tensor]:
    """GGUF's tensors under gptkit's names and layout (split tensors stacked, q/k rows back to rotate-half pairs)."""
    names = {theirs: ours for ours, theirs in tensor_names(config, arch).items()}
    split = split_tensors(config, arch)
    pieces = {piece.name for parts in split.values() for piece in parts}
    used = {"rope_freqs.weight"} if arch.rope_freqs else set()
    unmapped = [name for name in tensors if name not in names and name not in pieces and name not in used]
    if unmapped:  # dropped, it would leave the model computing something else (Llama 3's rope_freqs.weight)
        raise GGUFError(
            f"{path} holds tensor {unmapped[0]}, which gptkit does not map onto a GGUF {arch.name} model; "
            "the file is refused rather than read without it"
        )
    state = {names[name]: tensor for name, tensor in tensors.items() if name in names}
    for ours, parts in split.items():
        found = [tensors.get(piece.name) for piece in parts]
        if all(t is None for t in found) and ours.endswith(".bias"):
            continue
        missing = [piece.name for piece, t in zip(parts, found) if t is None]
        if missing:
            raise GGUFError(f"{path} has no tensor {missing[0]}")
        arranged = [rope_rows(t, piece.heads, False) if piece.heads else t for piece, t in zip(parts, found)]
        state[ours] = torch.cat(arranged, dim=parts[0].dim)
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)
        state["lm_head.weight"] = state["tok_emb.weight"]
    with torch.device("meta"):  # the names and shapes only
        expected = GPT(config).state_dict()
    for i in range(config.n_layer):  # a bias the architecture lacks (Qwen2's output projection) is zero
        bias = f"blocks.{i}.attn.proj.bias"
        if arch.no_proj_bias and bias in expected and bias not in state:
            state[bias] = torch.zeros(expected[bias].shape)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise GGUFError(f"{path} lacks the tensor gptkit calls {missing[0]!r}")
    extra = sorted(set(state) - set(expected))
    if extra:  # a bias or norm the architecture allows but this model's config has no place for
        raise GGUFError(f"{path} holds {extra[0]!r}, which a gptkit {arch.name} model of this shape does not have")
    return {name: state[name] for name in expected}
