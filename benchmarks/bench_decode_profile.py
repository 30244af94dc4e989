"""Where one batch-1 decode step's time goes: gptkit's default path under torch.profiler.

A random model of the chosen shape decodes greedily from a short prompt (the prefill counted in); the profiler's
self time per operator is divided by the steps. On a CPU where the fused step runs, a whole decode step is one entry,
gptkit::fused_step; GPTKIT_CPU_KERNELS=0 profiles the eager step, operator by operator. "outside operators" is the
wall time the operators do not account for (Python, the engine's bookkeeping). The products read every weight once
a step, so their time against the machine's memory bandwidth says how far the step is from its floor.

    python benchmarks/bench_decode_profile.py [--shape gpt2] [--steps 64] [--top 12] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

import gptkit
from gptkit.config import PRESETS, ModelConfig
from gptkit.model import GPT
from gptkit.native import library


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="gpt2", choices=sorted(PRESETS), help="model preset (random weights)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps profiled")
    parser.add_argument("--top", type=int, default=12, help="operators listed")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2")

    torch.manual_seed(0)
    model = GPT(ModelConfig.preset(args.shape)).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    prompt = list(range(16))
    gptkit.generate_ids(model, prompt, max_new_tokens=8, temperature=0.0)  # warm-up: kernels, allocator
    started = time.perf_counter()
    gptkit.generate_ids(model, prompt, max_new_tokens=args.steps, temperature=0.0)
    plain_ms = 1000 * (time.perf_counter() - started) / args.steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        gptkit.generate_ids(model, prompt, max_new_tokens=args.steps, temperature=0.0)
        profiled_ms = 1000 * (time.perf_counter() - started) / args.steps
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    per_step = {e.key: e.self_cpu_time_total / 1000 / args.steps for e in events}
    calls = {e.key: e.count / args.steps for e in events}
    in_operators = sum(per_step.values())
    report = {
        "cpu": library.capability(),
        "shape": args.shape,
        "steps": args.steps,
        "weights_mb": weight_bytes / 1e6,
        "ms_per_step": plain_ms,
        "tokens_per_s": 1000 / plain_ms,
        "profiled_ms_per_step": profiled_ms,
        "operators_ms_per_step": in_operators,
        "outside_operators_ms_per_step": max(profiled_ms - in_operators, 0.0),
        "top": [
            {"operator": key, "ms_per_step": per_step[key], "calls_per_step": calls[key]}
            for key in list(per_step)[: args.top]
        ],
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"cpu: {report['cpu']}")
    print(
        f"{args.shape}, fp32 weights {report['weights_mb']:.0f} MB, batch 1: {plain_ms:.1f} ms/step "
        f"({1000 / plain_ms:.1f} tokens/s); under the profiler {profiled_ms:.1f} ms/step, of which operators "
        f"{in_operators:.1f} and outside them {report['outside_operators_ms_per_step']:.1f}"
    )
    print(f"{'operator':50s} {'ms/step':>8s} {'calls/step':>10s}")
    for row in report["top"]:
        print(f"{row['operator'][:50]:50s} {row['ms_per_step']:8.2f} {row['calls_per_step']:10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
