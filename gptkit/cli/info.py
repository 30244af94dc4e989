"""`gptkit info`: a model's parameter breakdown, FLOPs per token and KV-cache size."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from gptkit.config import ModelConfig
from gptkit.errors import GptkitError

# Shown by `gptkit --help`, which imports no command's dependencies.
HELP = "parameter breakdown, FLOPs per token and KV-cache size of a model"
LONG_CONTEXT = 8192  # the second context the KV cache's size is given at
WEIGHT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "int8": 1.0, "int4": 18 / 32}  # bytes a weight


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `info` sub-command."""
    parser = subparsers.add_parser(
        "info",
        help=HELP,
        description="Print the parameter breakdown, FLOPs per token and KV-cache bytes of a preset, "
        "a config JSON file or a model directory.",
    )
    parser.add_argument(
        "model", metavar="PRESET_OR_CONFIG", help="a preset name (e.g. gpt2), a JSON file or a model dir"
    )
    parser.add_argument("--context", type=int, default=None, help="context length for FLOPs (default: block_size)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(run=run)


def describe(name: str, context: int | None = None) -> dict[str, Any]:
    """Everything `info` reports, as a JSON-able dict."""
    from gptkit.accounting import (
        DTYPE_BYTES,
        active_params,
        decode_weight_bytes,
        forward_flops_per_token,
        kv_cache_bytes,
        param_breakdown,
        training_flops_per_token,
    )

    config = ModelConfig.load(name)
    context = config.block_size if context is None else context
    params = param_breakdown(config).to_dict()
    return {
        "model": name,
        "config": config.to_dict(),
        "padded_vocab_size": config.padded_vocab_size,  # the embedding's and the LM head's rows
        "params": params,
        "total": params["total"],
        "active": active_params(config),  # per token: the total less the experts a router did not choose
        "flops_per_token": {
            "context": context,
            "forward": forward_flops_per_token(config, context),
            "training": training_flops_per_token(config, context),
        },
        # What a batch-1 decode step streams: every weight it multiplies by, once (the routed experts only); int8
        # leaves its per-row scales out, int4 counts llama.cpp's q4_0 blocks (18 bytes a 32 weights).
        "weight_bytes_per_decoded_token": {
            dtype: round(decode_weight_bytes(config, nbytes)) for dtype, nbytes in WEIGHT_BYTES.items()
        },
        "kv_cache_bytes_per_1024_tokens": {
            dtype: kv_cache_bytes(config, batch_size=1, context=1024, dtype=dtype) for dtype in DTYPE_BYTES
        },
        # Not 8 x the above where layers have sliding windows: a windowed layer holds at most W positions.
        f"kv_cache_bytes_at_{LONG_CONTEXT}_tokens": {
            dtype: kv_cache_bytes(config, batch_size=1, context=LONG_CONTEXT, dtype=dtype) for dtype in DTYPE_BYTES
        },
        "layer_windows": [config.layer_window(i) for i in range(config.n_layer)],
        "switches": switches(config),
        "training_precision": training_precision(name),
    }


def training_precision(name: str) -> str | None:
    """What a checkpoint trained in and why (its trainer.json's precision, as the run's config.yaml says it), or
    None for anything else."""
    from gptkit.checkpoint import TRAINER_FILE
    from gptkit.precision import Precision

    try:
        saved = json.loads((Path(name) / TRAINER_FILE).read_text()).get("precision")
    except (OSError, ValueError, AttributeError):  # not a checkpoint (a preset, a JSON file), or not gptkit's
        return None
    if not isinstance(saved, dict) or not isinstance(saved.get("dtype"), str):
        return None
    reason = saved.get("reason") if isinstance(saved.get("reason"), str) else ""
    return Precision(saved["dtype"], saved.get("fp32_attention") is True, reason).describe()


def switches(config: ModelConfig) -> list[str]:
    """The model-family settings of config that differ from a GPT-2-style block, in words."""
    c, found = config, []
    if c.head_dim * c.n_head != c.n_embd:
        found.append(f"head_dim {c.head_dim}")
    if c.rotary_dim != c.head_dim:
        found.append(f"rotary_dim {c.rotary_dim}")
    if c.rope_scaling is not None:
        found.append(f"rope_scaling {json.dumps(c.rope_scaling.to_dict())}")
    if c.rope_local_theta is not None:
        found.append(f"sliding layers' rope_theta {c.rope_local_theta:g}")
    windowed = sum(c.layer_window(i) is not None for i in range(c.n_layer))
    if windowed:
        found.append(f"sliding window {c.sliding_window} on {windowed} of {c.n_layer} layers")
    if c.nope_layers:
        found.append(f"no RoPE on layers {c.nope_layers}")
    if c.parallel_residual:
        found.append("parallel residual")
    moe_layers = sum(c.is_moe_layer(i) for i in range(c.n_layer))
    if moe_layers:
        shared = f", a shared expert of hidden {c.moe_shared_hidden}" if c.moe_shared_hidden is not None else ""
        found.append(
            f"{c.n_experts} experts of hidden {c.expert_hidden}, top {c.n_experts_per_token}, on {moe_layers} of "
            f"{c.n_layer} layers{shared}"
        )
    if c.qk_norm and c.qk_norm_scope == "width":
        found.append("q/k norms over the whole width")
    scales = [
        ("norm gain offset", c.norm_gain_offset, 0.0),
        ("embedding scale", c.embedding_scale, None),
        ("residual scale", c.residual_scale, 1.0),
        ("attention scale", c.attn_scale, None),
        ("attention softcap", c.attn_softcap, None),
        ("logit scale", c.logit_scale, 1.0),
    ]
    found += [f"{name} {value:g}" for name, value, default in scales if value != default]
    return found


def _human(n: float, unit: str = "") -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}{unit}"
    return f"{n:g} {unit}".rstrip()


def _human_bytes(n: int) -> str:
    for scale, suffix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{n} B"


def run(args: argparse.Namespace) -> int:
    """Print the report for args.model."""
    if args.context is not None and args.context < 1:
        raise GptkitError(f"--context must be >= 1, got {args.context}")
    report = describe(args.model, args.context)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    c, p = report["config"], report["params"]
    padded = report["padded_vocab_size"]
    extras = "".join(
        [
            f" (padded to {padded})" if padded != c["vocab_size"] else "",
            f", {'tied' if c['tie_embeddings'] else 'untied'} head",
            ", q/k norms" if c["qk_norm"] else "",
            f", logits soft-capped at {c['logit_softcap']:g}" if c["logit_softcap"] is not None else "",
        ]
    )
    print(
        f"{args.model}: {c['n_layer']} layers, {c['n_head']} heads ({c['n_kv_head']} kv), width {c['n_embd']}, "
        f"ffn {c['ffn_hidden']} {c['activation']}, {c['norm']} {c['norm_position']}-norm, {c['position']} positions, "
        f"context {c['block_size']}, vocab {c['vocab_size']}{extras}"
    )
    if report["switches"]:
        print(f"  {'; '.join(report['switches'])}")
    if report["training_precision"]:
        print(f"  trained in {report['training_precision']}")
    print()
    for part, count in p.items():
        share = f"{100 * count / p['total']:5.1f}%" if part != "total" else ""
        print(f"  {part.replace('_', ' '):<20} {count:>15,} {share}")
    if report["active"] != p["total"]:
        print(f"  {'active per token':<20} {report['active']:>15,} {100 * report['active'] / p['total']:5.1f}%")
    streamed = ", ".join(f"{_human_bytes(n)} {dtype}" for dtype, n in report["weight_bytes_per_decoded_token"].items())
    print(f"  weights read per decoded token (batch 1): {streamed}")
    f = report["flops_per_token"]
    print()
    print(
        f"FLOPs per token (context {f['context']}): forward {_human(f['forward'], 'FLOP')}, "
        f"training {_human(f['training'], 'FLOP')}"
    )
    kv = report["kv_cache_bytes_per_1024_tokens"]
    sizes = ", ".join(f"{_human_bytes(nbytes)} {dtype}" for dtype, nbytes in kv.items())
    print(f"KV cache per 1,024 tokens (batch 1): {sizes}")
    kv = report[f"kv_cache_bytes_at_{LONG_CONTEXT}_tokens"]
    sizes = ", ".join(f"{_human_bytes(nbytes)} {dtype}" for dtype, nbytes in kv.items())
    print(f"KV cache at {LONG_CONTEXT:,} tokens (batch 1): {sizes}")
    return 0
