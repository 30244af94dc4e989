"""Many LoRA adapters over one base model, each batch row choosing its own: one server, one batch, many fine-tunes.

serve_adapter() wraps the base's adapted layers in AdapterSet layers (once) and adds one adapter's A and B to each;
within rows_using(model, adapters), row i of every forward gets adapter adapters[i] (0: the base alone). A layer
computes base(x) for every row, then for each adapter in use, on that adapter's rows only, x A^T B^T alpha / r: the
same arithmetic as a LoRALinear, so a row decodes as the merged model would (up to float rounding), whatever
other adapters share its batch. (vLLM batches adapters this way on GPUs; llama.cpp applies one set per batch.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gptkit.adapters import target_paths, unwrap_model, wrap_block_layers
from gptkit.errors import GptkitError


class AdapterSet(nn.Module):
    """A frozen linear layer plus any number of low-rank updates, each applied to the rows that chose it."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.updates: dict[int, tuple[Tensor, Tensor, float]] = {}  # adapter -> (A (r, in), B (out, r), alpha / r)
        self.groups: list[tuple[int, Tensor]] = []  # (adapter, its rows) for the forward under way

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)  # (B, T, out)
        for adapter, rows in self.groups:
            update = self.updates.get(adapter)
            if update is None:  # that adapter leaves this layer alone
                continue
            a, b, scaling = update
            delta = F.linear(F.linear(x.index_select(0, rows).to(a.dtype), a), b) * scaling  # (n, T, out)
            y = y.index_add(0, rows, delta.to(y.dtype))
        return y

    def extra_repr(self) -> str:
        return f"adapters={sorted(self.updates)}"


def adapter_sets(model: nn.Module) -> dict[str, AdapterSet]:
    """Every AdapterSet of model by module name."""
    return {name: m for name, m in unwrap_model(model).named_modules() if isinstance(m, AdapterSet)}


@torch.no_grad()
def serve_adapter(
    model: nn.Module, index: int, state: dict[str, Tensor], settings: dict[str, object], source: str
) -> None:
    """Add adapter number `index` (state: "<module>.lora_A"/"lora_B" tensors, settings: its lora_config) to model,
    wrapping the layers it adapts in AdapterSet layers first where they are not yet."""
    if index < 1:
        raise GptkitError(f"adapter numbers start at 1 (0 is the base), got {index}")
    rank, scaling = int(settings["rank"]), float(settings["alpha"]) / int(settings["rank"])
    device = unwrap_model(model).tok_emb.weight.device

    def add(name: str, layer: nn.Module) -> AdapterSet:
        layer = layer if isinstance(layer, AdapterSet) else AdapterSet(layer)
        a, b = state.get(f"{name}.lora_A"), state.get(f"{name}.lora_B")
        if (
            a is None
            or b is None
            or tuple(a.shape) != (rank, layer.base.in_features)
            or tuple(b.shape) != (layer.base.out_features, rank)
        ):
            raise GptkitError(f"{source}: adapter tensors for {name} are missing or misshapen for this base")
        layer.updates[index] = (a.to(device, torch.float32), b.to(device, torch.float32), scaling)
        return layer

    _changed(model)
    wrap_block_layers(model, target_paths(str(settings["targets"])), add)


def remove_adapter(model: nn.Module, index: int) -> None:
    """Drop adapter `index` from every layer (its number may be reused)."""
    _changed(model)
    for layer in adapter_sets(model).values():
        layer.updates.pop(index, None)


# Kept in the model's __dict__ (not attributes: a module's attributes are its parameters and children), so that the
# fused decode step reads them in constant time at every step instead of walking the model's modules.
_VERSION, _ROWS = "_gptkit_adapters_version", "_gptkit_row_adapters"


def _changed(model: nn.Module) -> None:
    gpt = unwrap_model(model)
    gpt.__dict__[_VERSION] = gpt.__dict__.get(_VERSION, 0) + 1


def adapters_version(model: nn.Module) -> int:
    """A number that changes whenever an adapter is served or removed (0: never)."""
    return unwrap_model(model).__dict__.get(_VERSION, 0)


def row_adapters(model: nn.Module) -> Tensor | None:
    """Each row's adapter number (int64, on the CPU) within rows_using, where some row has one; else None."""
    return unwrap_model(model).__dict__.get(_ROWS)


@contextlib.contextmanager
def rows_using(model: nn.Module, adapters: list[int]) -> Iterator[None]:
    """Within the block, row i of model's forward passes applies adapter adapters[i] (0: none)."""
    if not any(adapters):
        yield
        return
    layers = list(adapter_sets(model).values())
    served = {k for layer in layers for k in layer.updates}
    unknown = sorted(set(adapters) - served - {0})
    if unknown:  # else its rows would silently decode on the base
        raise GptkitError(f"adapter {unknown[0]} is not served on this model (served: {sorted(served)})")
    gpt = unwrap_model(model)
    chosen = torch.tensor(adapters)
    groups = [
        (int(k), (chosen == k).nonzero()[:, 0].to(gpt.tok_emb.weight.device))
        for k in chosen.unique().tolist()
        if k != 0
    ]
    for layer in layers:
        layer.groups = groups
    gpt.__dict__[_ROWS] = chosen
    try:
        yield
    finally:
        for layer in layers:
            layer.groups = []
        gpt.__dict__.pop(_ROWS, None)
