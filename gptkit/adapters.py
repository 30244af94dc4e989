"""LoRA: low-rank adapters wrapped around a model's linear layers from outside, with PEFT's semantics.

A wrapped layer computes base(x) + dropout(x) A^T B^T * alpha / r, with A (r, in) initialised as nn.Linear
initialises a weight (PEFT's default) and B (out, r) at zero, so that an untrained adapter changes nothing. The
model itself knows nothing of adapters: add_lora swaps its block layers for LoRALinear wrappers, merge_lora folds
them back into plain weights. gptkit fuses q, k, v (and SwiGLU's gate and up) into one layer: one adapter covers
the fused layer, which PEFT expresses for separate layers as the same A with each layer's rows of B.

A low-level module, like gptkit.quantization: the layer itself, not a format or a training method. The LoRA
directory (adapters on disk) is gptkit.formats.lora.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gptkit.errors import ConfigError, GptkitError
from gptkit.settings import check_range

# Which block layers each target name adapts (paths inside a gptkit Block).
TARGETS: dict[str, tuple[str, ...]] = {
    "attention": ("attn.qkv", "attn.proj"),
    "mlp": ("mlp.fc", "mlp.proj"),
    "all": ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"),
}


class LoRALinear(nn.Module):
    """A linear layer (nn.Linear or gptkit's Int8Linear, frozen) plus a trainable low-rank update."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.base = base
        device = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's own weight init, as PEFT uses for A
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        if not self.enabled:
            return y
        update = F.linear(F.linear(self.dropout(x).to(self.lora_A.dtype), self.lora_A), self.lora_B)
        return y + (update * self.scaling).to(y.dtype)

    def delta_weight(self) -> Tensor:
        """The update as a weight (out, in): B A alpha / r."""
        return (self.lora_B @ self.lora_A) * self.scaling

    def extra_repr(self) -> str:
        return f"rank={self.lora_A.size(0)}, scaling={self.scaling:g}"


def unwrap_model(model: nn.Module) -> nn.Module:
    """The GPT under a torch.compile or DDP wrapper."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


def target_paths(targets: str) -> tuple[str, ...]:
    """The block layers a target name (attention, mlp, all) adapts."""
    if targets not in TARGETS:
        raise ConfigError(f"finetune.lora_targets must be one of {', '.join(TARGETS)}, got {targets!r}")
    return TARGETS[targets]


def check_lora(rank: int, alpha: float, dropout: float, targets: str) -> None:
    """A ConfigError naming the first LoRA setting out of its range (a run's, or a LoRA directory's)."""
    check_range("finetune.lora_rank", rank, low=1)
    check_range("finetune.lora_alpha", alpha, low=0.0, low_open=True)
    check_range("finetune.lora_dropout", dropout, low=0.0, high=1.0, high_open=True)
    target_paths(targets)


def add_lora(model: nn.Module, rank: int, alpha: float, dropout: float, targets: str) -> nn.Module:
    """Freeze every weight of model and wrap its target layers in adapters (in place); returns model."""
    check_lora(rank, alpha, dropout, targets)
    gpt = unwrap_model(model)
    if adapters(gpt):
        raise ConfigError("the model already has LoRA adapters")
    paths = target_paths(targets)
    check_expert_targets(gpt, paths, targets)
    for param in gpt.parameters():
        param.requires_grad_(False)
    wrap_block_layers(gpt, paths, lambda name, layer: LoRALinear(layer, rank, alpha, dropout))
    return model


def check_expert_targets(model: nn.Module, paths: tuple[str, ...], targets: str) -> None:
    """Refuse targets that reach a mixture of experts' expert weights: LoRA adapts one matrix per layer, and an
    expert layer holds E of them (E, out, in) (LoRA on experts is not built yet; the attention layers adapt alike)."""
    from gptkit.moe import ExpertWeights  # here, not above: the optimiser imports this module without the model

    for index, block in enumerate(unwrap_model(model).blocks):
        for path in paths:
            parent_path, _, attribute = path.rpartition(".")
            layer = getattr(block.get_submodule(parent_path), attribute)
            if isinstance(layer, ExpertWeights):
                raise ConfigError(
                    f"finetune.lora_targets {targets!r} reaches blocks.{index}.{path}, a mixture of experts' "
                    f"{layer.weight.size(0)} expert weights, which LoRA does not adapt yet: set it to attention"
                )


def wrap_block_layers(model: nn.Module, paths: tuple[str, ...], wrap: Callable[[str, nn.Module], nn.Module]) -> None:
    """Replace each block's layer at each of paths (e.g. "attn.qkv") by wrap(its module name, the layer), in place."""
    for index, block in enumerate(unwrap_model(model).blocks):
        for path in paths:
            parent_path, _, attribute = path.rpartition(".")
            parent = block.get_submodule(parent_path)
            setattr(parent, attribute, wrap(f"blocks.{index}.{path}", getattr(parent, attribute)))


def adapters(model: nn.Module) -> dict[str, LoRALinear]:
    """Every adapter of model by its module name (e.g. "blocks.0.attn.qkv")."""
    return {name: m for name, m in unwrap_model(model).named_modules() if isinstance(m, LoRALinear)}


def lora_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapters' weights: "<module>.lora_A" (r, in) and "<module>.lora_B" (out, r)."""
    state = {}
    for name, adapter in adapters(model).items():
        state[f"{name}.lora_A"] = adapter.lora_A.detach()
        state[f"{name}.lora_B"] = adapter.lora_B.detach()
    return state


@torch.no_grad()
def load_lora_state(model: nn.Module, state: dict[str, Tensor], source: str) -> None:
    """Copy saved adapter weights into model's adapters, naming any missing, extra or misshapen tensor."""
    own = {f"{name}.{part}": getattr(a, part) for name, a in adapters(model).items() for part in ("lora_A", "lora_B")}
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        name = (missing or extra)[0]
        raise GptkitError(f"{source}: adapter tensor {name!r} is {'missing' if missing else 'unexpected'}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise GptkitError(
                f"{source}: adapter tensor {name!r} has shape {tuple(tensor.shape)}, the model needs "
                f"{tuple(own[name].shape)}"
            )
        own[name].copy_(tensor)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within the block, model computes as its base (every adapter off)."""
    found = list(adapters(model).values())
    for adapter in found:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in found:
            adapter.enabled = True


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its layer's weight (W + B A alpha / r) and unwrap it; returns the plain model."""
    gpt = unwrap_model(model)
    for name, adapter in adapters(gpt).items():
        weight = adapter.base.weight
        if not weight.is_floating_point():
            raise GptkitError("adapters cannot be merged into int8 weights; load the base model in float first")
        weight.add_(adapter.delta_weight().to(weight.dtype))
        parent_path, _, attribute = name.rpartition(".")
        setattr(gpt.get_submodule(parent_path), attribute, adapter.base)
    return model


def fingerprint(state: dict[str, Tensor]) -> str:
    """A hash of a model's weights (names, shapes, dtypes and bytes), telling one base model from another."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        tensor = state[name].detach().contiguous().cpu()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(tensor.view(torch.uint8).numpy().data if tensor.numel() else b"")
    return digest.hexdigest()


def peft_adapter(
    lora: dict[str, Tensor],
    hf_modules: dict[str, list[tuple[str, int | None]]],
    settings: dict[str, Any],
    base_model: str | None,
    fan_in_fan_out: bool,
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(adapter_config.json, adapter_model.safetensors tensors) in PEFT's LoRA format.

    hf_modules maps each gptkit block layer to the Hugging Face modules holding it, with the rows of the layer's
    output each takes, in order (None: all): one module for GPT-2's fused c_attn, three for Llama's q, k, v.
    fan_in_fan_out says the HF modules store weights transposed (GPT-2's Conv1D).
    """
    tensors: dict[str, Tensor] = {}
    suffixes: set[str] = set()
    for name in sorted({key.rpartition(".")[0] for key in lora}):
        a, b = lora[f"{name}.lora_A"], lora[f"{name}.lora_B"]
        parts = hf_modules[name]
        for (module, _), b_rows in zip(parts, b.split([rows or b.size(0) for _, rows in parts])):
            tensors[f"base_model.model.{module}.lora_A.weight"] = a.clone()
            tensors[f"base_model.model.{module}.lora_B.weight"] = b_rows.clone()
            suffixes.add(".".join(module.split(".")[-2:]))  # e.g. attn.c_attn: PEFT matches a dotted suffix
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": settings["rank"],
        "lora_alpha": settings["alpha"],
        "lora_dropout": settings["dropout"],
        "target_modules": sorted(suffixes),
        "fan_in_fan_out": fan_in_fan_out,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    return config, tensors
