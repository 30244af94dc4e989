"""`gptkit plan`: size a training run (FLOPs, compute-optimal tokens, memory, fit, wall time) before it starts."""

from __future__ import annotations

import argparse
import json

from gptkit.cli.flags import add_dataclass_flags, dataclass_from_args
from gptkit.config import ModelConfig

# Shown by `gptkit --help`, which imports no command's dependencies.
HELP = "size a training run before it starts: FLOPs, compute-optimal tokens, memory, fit and wall time"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `plan` sub-command; its flags come from PlanSettings."""
    from gptkit.plan import PlanSettings

    parser = subparsers.add_parser(
        "plan",
        help=HELP,
        description="Plan a training run of a preset, a config JSON file or a model directory: parameters, "
        "training FLOPs (6ND plus attention), Chinchilla's compute-optimal tokens (20 per parameter) and model "
        "size for a FLOP budget (C = 6ND), memory for weights, gradients, AdamW state and activations (with and "
        "without activation checkpointing), whether it fits a device, the KV cache for inference, and the wall time.",
    )
    parser.add_argument(
        "model",
        metavar="PRESET_OR_CONFIG",
        nargs="?",
        default="gpt2",
        help="a preset name, a ModelConfig JSON file or a model directory (default: gpt2)",
    )
    add_dataclass_flags(parser, PlanSettings)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a report")
    parser.set_defaults(run=run)


def _si(n: float, unit: str = "") -> str:
    for scale, suffix in ((1e21, "Z"), (1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}{unit}"
    return f"{n:.3g} {unit}".rstrip()


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def _duration(seconds: float) -> str:
    for scale, unit in ((86400, "days"), (3600, "hours"), (60, "minutes")):
        if seconds >= scale:
            return f"{seconds / scale:.1f} {unit}"
    return f"{seconds:.1f} seconds"


def run(args: argparse.Namespace) -> int:
    """Print the plan for args.model."""
    from gptkit.plan import PlanSettings, make_plan

    settings = dataclass_from_args(PlanSettings, args)
    plan = make_plan(ModelConfig.load(args.model), settings)
    if args.json:
        print(json.dumps({"model": args.model, **plan.to_dict()}, indent=2))
        return 0
    m = plan.memory
    budget = (
        f"a budget of {_si(plan.budget_flops, 'FLOP')} is best spent on {_si(plan.budget_optimal_params)} parameters "
        f"x {_si(plan.budget_optimal_tokens)} tokens (C = 6ND, D = 20N)"
    )
    if settings.budget is not None:  # the question asked: its answer first
        print(budget)
    print(f"{args.model}: {plan.params:,} parameters ({_si(plan.params)})")
    print(
        f"training: {plan.tokens:,} tokens ({plan.tokens_source}), {plan.steps:,} steps of {plan.batch_size} x "
        f"{plan.block_size} tokens, {_si(plan.training_flops, 'FLOP')} "
        f"(6ND alone: {_si(plan.training_flops_6nd, 'FLOP')})"
    )
    print(f"compute-optimal (Chinchilla, 20 tokens per parameter): {plan.compute_optimal_tokens:,} tokens")
    if settings.budget is None:
        print(budget)
    muon = settings.optimizer == "muon"
    print(f"memory per device ({settings.dtype}, {'Muon + AdamW' if muon else 'AdamW'}):")
    rows = [
        ("weights", m.weights),
        ("gradients", m.gradients),
        ("Muon + AdamW state" if muon else "AdamW moments", m.optimizer),
        ("autocast weight copies", m.autocast_copies),
        ("AdamW step temporaries", m.optimizer_step),
        ("activations", m.activations),
        ("total", m.total),
        ("activations, checkpointed", m.activations_checkpointed),
        ("total, checkpointed", m.total_checkpointed),
    ]
    for label, nbytes in rows:
        if nbytes or label != "autocast weight copies":
            print(f"  {label:<26} {_gib(nbytes):>12}")
    if plan.fits is not None:
        verdict = (
            "fits"
            if plan.fits
            else (
                "fits only with activation checkpointing"
                if plan.fits_checkpointed
                else "does not fit, even with activation checkpointing"
            )
        )
        print(f"  {settings.device_memory:g} GiB device: {verdict}")
    kv = plan.kv_cache
    windows = f"; {kv['windowed_layers']} layers keep their last {kv['window']}" if kv["windowed_layers"] else ""
    print(
        f"KV cache for inference ({kv['batch']} x {kv['context']} tokens, {kv['dtype']}{windows}): {_gib(kv['bytes'])}"
    )
    if plan.wall_seconds is not None:
        print(
            f"wall time on one device at {settings.flops:g} TFLOP/s and {settings.mfu:.0%} MFU: "
            f"{_duration(plan.wall_seconds)} (n data-parallel devices: about 1/n of it)"
        )
    for note in plan.notes:
        print(f"note: {note}")
    return 0
