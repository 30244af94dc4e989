"""Muon's Newton-Schulz orthogonalisation on a model's block matrices, the way Muon batches them (same shapes as one
stack): float32 rounds as written (X <- aX + (bA + cA^2) X) against the same rounds on the Gram matrix
(gptkit.optim.iterate_on_gram, what gptkit takes in float32 where a matrix is over 1.5x as wide as tall), and
bfloat16 as written (what gptkit takes on a GPU and on a CPU with bf16 hardware). Each batch's three ways are timed
in interleaved rounds; the figure is the median. Also the largest difference from float64's iteration.

    python benchmarks/bench_muon.py                              # the CPU record's model (configs/...-cpu-muon.yaml)
    python benchmarks/bench_muon.py --preset gpt2 --rounds 5 --json
Run it on a quiet machine: timings share the CPU with everything else running.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from gptkit.config import PRESETS, ModelConfig
from gptkit.model import GPT
from gptkit.native import library
from gptkit.optim import NS_COEFFICIENTS, block_matrices, iterate, iterate_on_gram, on_gram, same_shape_batches

WAYS = {
    "float32": (torch.float32, iterate),
    "float32 on the Gram matrix": (torch.float32, iterate_on_gram),
    "bfloat16": (torch.bfloat16, iterate),
}


def wide_stack(matrices: list[torch.Tensor]) -> torch.Tensor:
    """The batch as orthogonalise iterates it: each matrix wide (a tall one transposed), scaled to unit norm."""
    x = torch.stack([m.mT if m.size(0) > m.size(1) else m for m in matrices])  # (batch, short, long)
    return x / x.norm(dim=(-2, -1), keepdim=True)


def time_batch(x: torch.Tensor, steps: int, rounds: int) -> dict[str, dict[str, float]]:
    """Median ms of each way over interleaved rounds, and its largest difference from float64's rounds."""
    exact = iterate(x.double(), steps, NS_COEFFICIENTS, torch.baddbmm)
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    errors = {}
    for _ in range(rounds + 1):  # the first round warms each way up and is not counted
        for way, (dtype, rounds_of) in WAYS.items():
            start = time.perf_counter()
            out = rounds_of(x.to(dtype), steps, NS_COEFFICIENTS, torch.baddbmm)
            times[way].append(time.perf_counter() - start)
            errors[way] = (out.double() - exact).abs().max().item()
    return {way: {"ms": 1000 * statistics.median(times[way][1:]), "max_error": errors[way]} for way in WAYS}


def main() -> int:
    """Time each way on the chosen model's batches and print a table (or --json)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--preset",
        default="shakespeare-char-cpu",
        choices=sorted(PRESETS),
        help="the model whose block matrices to orthogonalise (default: the CPU recipe's)",
    )
    parser.add_argument("--n-layer", type=int, default=2, help="layers (default 2, the CPU record's)")
    parser.add_argument("--steps", type=int, default=5, help="Newton-Schulz rounds (default 5)")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds of each way (default 20)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    config = ModelConfig(**{**PRESETS[args.preset], "n_layer": args.n_layer, "vocab_size": 256})
    matrices = [p.detach() for p in block_matrices(GPT(config))]
    generator = torch.Generator().manual_seed(0)
    updates = [torch.randn(m.shape, generator=generator) for m in matrices]
    results = []
    for batch in same_shape_batches(updates):
        x = wide_stack([updates[i] for i in batch])
        timed = time_batch(x, args.steps, args.rounds)
        gptkit_way = "float32 on the Gram matrix" if on_gram(x, args.steps, torch.float32) else "float32"
        results.append({"shape": list(x.shape), **timed, "float32 as gptkit runs it": timed[gptkit_way]["ms"]})
    totals = {way: sum(r[way]["ms"] for r in results) for way in WAYS}
    totals["float32 as gptkit runs it"] = sum(r["float32 as gptkit runs it"] for r in results)
    report = {
        "cpu": library.capability(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "preset": args.preset,
        "n_layer": args.n_layer,
        "batches": results,
        "total_ms": totals,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{report['cpu']}; torch {report['torch']}, {report['threads']} threads")
    print(
        f"{args.preset}, {args.n_layer} layers: Newton-Schulz ({args.steps} rounds), median ms of {args.rounds} "
        f"(largest difference from float64)"
    )
    for r in results:
        cells = ", ".join(f"{way} {r[way]['ms']:.2f} ({r[way]['max_error']:.1e})" for way in WAYS)
        print(f"  {' x '.join(map(str, r['shape']))}: {cells}")
    ratio = totals["float32 as gptkit runs it"] / totals["float32"]
    print(
        "  all: " + ", ".join(f"{way} {ms:.2f}" for way, ms in totals.items()) + f"; gptkit's float32 / as written: "
        f"{ratio:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
