"""Whether a model's block products give a row the same bits whatever rows stand beside it, on this machine.

prefill_waves runs the chunks of several prompts in one forward, which keeps each prompt's bits only if every product
x @ W.T a chunk passes through gives its rows the bits they get alone. Whether it does is up to the GEMM library's
kernel and thread split for each shape, which differ between CPUs (AVX2, AVX-512, AMX) and thread counts, so it is
checked here rather than assumed: each distinct linear layer of the blocks (LoRA updates included; the LM head is left
out, waves never run it) multiplies a random chunk alone and the same chunk inside 2 and max_rows chunks, through the
layer's own forward, and every bit must agree, for whole chunks and for the shortest last chunks that run together.
The answer is kept on the model per thread count and served adapters.

Cost: GPT-2 small's four products over 1 + 2 + 32 rows of 64 and of 17 tokens (40 GFLOP, most of it in the 32
rows of 64) took 0.75 to 1.9 s on one core of a 2-core AVX2 EPYC that other processes shared (an fp32 GEMM of
GPT-2's fc ran at 16 to 25 GFLOP/s there; indicative only); a tiny test model, milliseconds. Once per model and
thread count: a later call reads the stored answer (microseconds).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from gptkit.adapters import LoRALinear
from gptkit.decoding.step import PREFILL_CHUNK
from gptkit.model import GPT
from gptkit.multi_lora import AdapterSet, adapters_version

log = logging.getLogger(__name__)

# The shortest last chunk (tokens) that prefill_waves runs beside others. Alone, shorter ones may take another kernel
# than the rows together: gptkit's GEMV up to native.ops.GEMV_MAX_ROWS (8) rows, and MKL's own small products, whose
# bits for a chunk of 2, 3, 5-7 or 9-11 tokens changed beside other chunks with 2 threads on a 2-core AVX2 EPYC (none
# from 12 to 64 tokens, GPT-2 small's shapes, 2 to 32 chunks); odd, as multiples of 4 and 8 passed where others did not.
SHORTEST_SHARED_LAST = 17
# The tokens a row of a wave holds that the probe checks: a whole chunk, and the shortest last chunk run together.
LENGTHS = (PREFILL_CHUNK, SHORTEST_SHARED_LAST)
_VERDICTS = "_gptkit_wave_probe"  # in the model's __dict__: {key: verdict}, so that it lives and dies with the model


def rows_independent(model: GPT, max_rows: int) -> bool:
    """True where every block product of model gives a chunk's rows the same bits alone as beside up to max_rows - 1
    other chunks, with this process's threads; checked once per model, thread count, weights and adapters."""
    # Kept on the model object, whose layers' shapes never change; an adapter served or removed changes the version.
    key = (torch.get_num_threads(), adapters_version(model), max_rows)
    verdicts = model.__dict__.setdefault(_VERDICTS, {})
    if key not in verdicts:
        layers = distinct_products(model).items()
        failed = next((name for name, layer in layers if not _layer_independent(layer, max_rows)), None)
        if failed is not None:
            log.info(
                "prefill waves off: %s gives a row other bits beside other rows here (%d threads); each prompt's "
                "chunks run alone",
                failed,
                torch.get_num_threads(),
            )
        verdicts[key] = failed is None
    return verdicts[key]


def distinct_products(model: GPT) -> dict[str, nn.Module]:
    """One block layer (by module name) for each distinct product shape a chunk passes through: nn.Linear, and the
    LoRA wrappers as a whole (their base and update together)."""
    chosen: dict[tuple, tuple[str, nn.Module]] = {}
    inside: set[int] = set()
    for name, module in model.blocks.named_modules(prefix="blocks"):
        if id(module) in inside:  # a wrapper's own base, probed within the wrapper's forward
            continue
        if isinstance(module, (AdapterSet, LoRALinear)):
            inside.add(id(module.base))
        elif not isinstance(module, nn.Linear):
            continue
        shapes = tuple((n, tuple(t.shape), t.dtype) for n, t in _tensors(module))
        chosen.setdefault((type(module), shapes), (name, module))
    return dict(chosen.values())


def _tensors(layer: nn.Module) -> list[tuple[str, Tensor]]:
    """The layer's parameters and an AdapterSet's adapters (kept outside its parameters)."""
    tensors = list(layer.named_parameters())
    if isinstance(layer, AdapterSet):
        for k, (a, b, _) in sorted(layer.updates.items()):
            tensors += [(f"{k}.A", a), (f"{k}.B", b)]
    return tensors


@torch.no_grad()
def _layer_independent(layer: nn.Module, max_rows: int) -> bool:
    """Whether one random chunk's product is bitwise the same alone as inside 2 and max_rows chunks (not first)."""
    weight = next(layer.parameters())
    width = layer.in_features if isinstance(layer, nn.Linear) else layer.base.in_features
    x = torch.randn(
        max_rows, PREFILL_CHUNK, width, generator=torch.Generator().manual_seed(0)
    )  # (rows, PREFILL_CHUNK, in)
    x = x.to(weight.device, weight.dtype)
    adapters = sorted(layer.updates) if isinstance(layer, AdapterSet) else [0]
    for adapter in adapters:
        for length in LENGTHS:
            chunks = x[:, :length].contiguous()  # (rows, length, in)
            for rows in sorted({min(2, max_rows), max_rows} - {1}):
                at = rows // 2  # not first: a kernel may treat the start of the buffer apart
                alone = _forward(layer, chunks[at : at + 1], adapter)
                beside = _forward(layer, chunks[:rows], adapter)[at : at + 1]
                if not torch.equal(alone, beside):
                    return False
    return True


def _forward(layer: nn.Module, x: Tensor, adapter: int) -> Tensor:
    """layer(x), every row of x using adapter where layer is an AdapterSet (as multi_lora.rows_using sets it)."""
    if not isinstance(layer, AdapterSet) or not adapter:
        return layer(x)
    saved, layer.groups = layer.groups, [(adapter, torch.arange(x.size(0), device=x.device))]
    try:
        return layer(x)
    finally:
        layer.groups = saved
