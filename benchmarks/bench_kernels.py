"""gptkit's few-row products against PyTorch's own, per weight format, on GPT-2 small's matrices, in one run.

A decode step is bound by its matrix products; this times them alone, for 1 and 8 rows of activations, over the
five matrix shapes of GPT-2 small (q/k/v 2304 x 768, attention output 768 x 768, MLP 3072 x 768 and 768 x 3072, the
LM head 50257 x 768), each product run back to back over all five:
  fp32   F.linear                                  vs gptkit gemv
  bf16   F.linear in bf16                          vs gptkit gemv (bf16 weights)
  int8   torch._weight_int8pack_mm (bf16 act.)     vs gptkit gemv_int8 (a scale per row)
  int4   torch._weight_int4pack_mm_for_cpu (bf16 act., groups of 32, torchao's int4 CPU path) vs gptkit gemv_q4
         (llama.cpp's Q4_0: groups of 32, an fp16 scale, activations rounded to int8 per block)
Rounds are interleaved (every side once per round) and each side is scored by its best round. Figures are the
microseconds for the five products and the weight bytes they read per second. It is the measurement behind writing
the int4 kernel rather than using PyTorch's: the ratio column is PyTorch's time over gptkit's.

    .venv/bin/python benchmarks/bench_kernels.py
    .venv/bin/python benchmarks/bench_kernels.py --rows 1 --rounds 3 --json

--shapes qwen3-moe times whole decode steps of a Qwen3-MoE-shaped model of random weights instead (issue 55: 16
layers, 64 experts of hidden 256, top 8, 1024 wide; --quick: 2 layers, 256 wide, of 16 experts), fused and eager, at batch 1
in fp32, bf16, int8 and int4 (gptkit.quantization.quantize: the expert stacks too, the routers float; the
fused step where this machine chose it; GPTKIT_CPU_KERNELS=1 takes it without timing it
first): tokens/s, the weight bytes a token reads (gptkit.decoding.weight_bytes.step_weight_bytes: the routed
experts only, each tensor at its own width), the rate they stream at, and its share of this machine's read
bandwidth (gptkit's probe over 1 GiB, as bench_generate's), which bounds a memory-bound step:

    .venv/bin/python benchmarks/bench_kernels.py --shapes qwen3-moe
    .venv/bin/python benchmarks/bench_kernels.py --shapes qwen3-moe --quick --json

--shapes gpt2-streamed times gptkit's fp32 products over the matrices of a whole GPT-2-small decode step instead, each
layer's its own (0.5 GB on 2 MiB pages: every pass streams them from memory, as decoding does; --quick: one layer and
a 4,096-row head), at each --rows: the milliseconds a pass takes, the rate the weights stream at, and the time the
probe's bandwidth needs to read the same bytes as a share of it (issue 59's batch-8 bound counts those bytes):

    .venv/bin/python benchmarks/bench_kernels.py --shapes gpt2-streamed --rounds 7

--shapes gpt2-prefill times the fp32 products of a whole GPT-2-small prefill forward instead, the LM head left out
(the last token's only), each layer's matrices its own on 2 MiB pages, at each --prefill-rows: F.linear (MKL in
PyTorch's CPU wheel) against gptkit's many-row kernel (csrc/gemm.h), interleaved rounds, each scored by its best:
milliseconds, GFLOP/s and PyTorch's time over gptkit's. 64 rows is the server's prefill chunk:

    .venv/bin/python benchmarks/bench_kernels.py --shapes gpt2-prefill --prefill-rows 16,64,180
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from gptkit.config import ModelConfig
from gptkit.decoding import fused
from gptkit.decoding.step import decode_one_token, inference
from gptkit.decoding.weight_bytes import step_weight_bytes
from gptkit.kv_cache import KVCache
from gptkit.model import GPT
from gptkit.native import library, ops
from gptkit.quantization import group_q4, quantize, quantize_q4

SHAPES = [(2304, 768), (768, 768), (3072, 768), (768, 3072), (50257, 768)]  # (out, in): GPT-2 small's matrices
Product = Callable[[], object]


def _int4_for_torch(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """w as torch's int4 CPU op takes it: packed uint4 codes, (K / 32, N, 2) bf16 scales and zero points; rows
    padded to a multiple of 16, which the op needs (the LM head's 50257)."""
    w = torch.cat([w, w.new_zeros(-w.size(0) % 16, w.size(1))])
    n, k = w.shape
    groups = w.reshape(n, k // 32, 32)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-6)
    codes = ((groups - low) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = low + 8 * scale  # torch's form: w = (code - 8) * scale + zero
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_zeros = torch.stack([scale[..., 0], zero[..., 0]], dim=-1).transpose(0, 1).contiguous()  # (K/32, N, 2)
    return packed, scales_zeros.to(torch.bfloat16), 32


def _int8_for_torch(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w as int8 codes with one scale per row (what both int8 products take)."""
    scale = w.abs().amax(1) / 127
    return (w / scale[:, None]).round().to(torch.int8), scale


def products(rows: int) -> dict[str, dict[str, tuple[list[Product], int]]]:
    """{format: {side: (the five products, weight bytes they read)}}."""
    torch.manual_seed(0)
    ops, bf16 = torch.ops.gptkit, torch.bfloat16
    table: dict[str, dict[str, tuple[list[Product], int]]] = {}

    def add(fmt: str, side: str, product: Product, nbytes: int) -> None:
        runs, total = table.setdefault(fmt, {}).get(side, ([], 0))
        table[fmt][side] = (runs + [product], total + nbytes)

    for n, k in SHAPES:
        w, a = torch.randn(n, k) * 0.02, torch.randn(rows, k)
        ab, wb = a.to(bf16), w.to(bf16)
        add("fp32", "torch", partial(F.linear, a, w), n * k * 4)
        add("fp32", "gptkit", partial(ops.gemv, a, w, None), n * k * 4)
        add("bf16", "torch", partial(F.linear, ab, wb), n * k * 2)
        add("bf16", "gptkit", partial(ops.gemv, ab, wb, None), n * k * 2)
        q, scale = _int8_for_torch(w)
        add("int8", "torch", partial(torch._weight_int8pack_mm, ab, q, scale.to(bf16)), n * k + n * 2)
        add("int8", "gptkit", partial(ops.gemv_int8, a, q, scale, None), n * k + n * 4)
        packed, scales_zeros, group = _int4_for_torch(w)
        add(
            "int4",
            "torch",
            partial(torch._weight_int4pack_mm_for_cpu, ab, packed, group, scales_zeros),
            n * k // 2 + n * k // 32 * 4,
        )
        grouped, grouped_scales = group_q4(*quantize_q4(w))
        add("int4", "gptkit", partial(ops.gemv_q4, a, grouped, grouped_scales, None, n), n * k // 2 + n * k // 32 * 2)
    return table


def best_time(run: list[Product], calls: int) -> float:
    """Seconds for one pass over the products, the mean of `calls` passes."""
    start = time.perf_counter()
    for _ in range(calls):
        for product in run:
            product()
    return (time.perf_counter() - start) / calls


def measure(rows_list: list[int], rounds: int, calls: int) -> list[dict]:
    results = []
    for rows in rows_list:
        table = products(rows)
        best: dict[tuple[str, str], float] = {}
        for fmt, sides in table.items():  # warm-up: first calls pay for packing caches and page faults
            for run, _ in sides.values():
                best_time(run, 2)
        for _ in range(rounds):
            for fmt, sides in table.items():
                for side_name, (run, _) in sides.items():
                    key = (fmt, side_name)
                    best[key] = min(best.get(key, float("inf")), best_time(run, calls))
        for fmt, sides in table.items():
            entry = {"rows": rows, "format": fmt}
            for side_name, (_, nbytes) in sides.items():
                seconds = best[(fmt, side_name)]
                entry[side_name] = {"us": seconds * 1e6, "gb_s": nbytes / seconds / 1e9}
            entry["ratio"] = entry["torch"]["us"] / entry["gptkit"]["us"]
            results.append(entry)
    return results


# Qwen3-MoE's layout (q/k norms, 128-wide heads, SwiGLU experts, top-k renormalised) at the CPU size.
QWEN3_MOE = dict(
    vocab_size=32768,
    block_size=512,
    n_layer=16,
    n_head=8,
    n_kv_head=4,
    n_embd=1024,
    head_dim=128,
    norm="rmsnorm",
    position="rope",
    activation="swiglu",
    attn_bias=False,
    mlp_bias=False,
    norm_bias=False,
    tie_embeddings=False,
    qk_norm=True,
    n_experts=64,
    n_experts_per_token=8,
    moe_ffn_hidden=256,
)
QUICK = dict(
    n_layer=2, n_embd=256, n_head=4, n_kv_head=2, head_dim=64, n_experts=16, moe_ffn_hidden=64, vocab_size=4096
)


def read_bandwidth(megabytes: int, rounds: int = 5) -> float:
    """Bytes per second every thread together reads: gptkit's probe (threads pinned, the buffer on 2 MiB pages as the
    fused step's weights are; bench_generate's bound takes the same), the best of `rounds`. A torch sum fell short:
    18.4 GB/s on the quiet 2-core AVX2 machine that read 21.4 so, 5.6 on one busy core where the fp32 step ran 8.8."""
    x = torch.ones(megabytes * (1 << 20) // 4)
    torch.ops.gptkit.huge_pages([x])
    return torch.ops.gptkit.read_bandwidth(x, rounds)


# The MoE rows: (name, the model's float dtype, quantize()'s method). The routers stay fp32 in int8 and int4.
MOE_PRECISIONS = (
    ("float32", torch.float32, None),
    ("bfloat16", torch.bfloat16, None),
    ("int8", torch.float32, "int8"),
    ("int4", torch.float32, "int4"),
)


def moe_steps(quick: bool, steps: int) -> list[dict]:
    """Fused and eager decode steps of the Qwen3-MoE-shaped model at batch 1, in fp32, bf16, int8 and int4."""
    config = ModelConfig(**dict(QWEN3_MOE, **(QUICK if quick else {})))
    bandwidth = read_bandwidth(64 if quick else 1024)
    results = []
    for name, dtype, method in MOE_PRECISIONS:
        torch.manual_seed(0)
        model = GPT(config).eval().to(dtype)
        if method is not None:
            model = quantize(model, method)
        fused_step = fused.step_for(model)
        ways = {"fused": fused_step, "eager": decode_one_token} if fused_step else {"eager": decode_one_token}
        nbytes = step_weight_bytes(model)
        for way, step in ways.items():
            cache = KVCache(config, 1, config.block_size, dtype=dtype)
            tokens = torch.zeros(1, 1, dtype=torch.long)
            with inference(model):
                step(model, tokens, cache, 0)  # warm-up: page faults, the plan's buffers
                ops.await_huge_pages()  # the fused step's first call starts moving the weights to 2 MiB pages
                start = time.perf_counter()
                for position in range(1, steps + 1):
                    tokens = step(model, tokens, cache, position).argmax(-1, keepdim=True)  # (1, 1): greedy
                seconds = (time.perf_counter() - start) / steps
            rate = nbytes / seconds
            results.append(
                {
                    "dtype": name,
                    "step": way,
                    "tokens_s": 1 / seconds,
                    "weight_bytes_per_token": nbytes,
                    "gb_s": rate / 1e9,
                    "bandwidth_gb_s": bandwidth / 1e9,
                    "share_of_bound": rate / bandwidth,
                }
            )
    return results


def streamed(rows: list[int], rounds: int, quick: bool) -> list[dict]:
    """The fp32 products of a GPT-2-small decode step, every layer's matrices its own, at each row count (rounds
    interleaved, each count scored by its best), against the time to read their bytes at the probe's bandwidth."""
    layers, vocab = (1, 4096) if quick else (12, 50257)
    torch.manual_seed(0)
    weights = [torch.randn(n, k) * 0.02 for _ in range(layers) for n, k in SHAPES[:4]] + [
        torch.randn(vocab, 768) * 0.02
    ]
    torch.ops.gptkit.huge_pages(weights)
    nbytes = sum(w.numel() * 4 for w in weights)
    read_s = nbytes / read_bandwidth(64 if quick else 1024)
    inputs = {r: {k: torch.randn(r, k) for k in (768, 3072)} for r in rows}
    best = dict.fromkeys(rows, float("inf"))
    for _ in range(rounds + 1):  # the first pass warms up (page faults, the kernels' buffers); it counts too
        for r in rows:
            start = time.perf_counter()
            for w in weights:
                torch.ops.gptkit.gemv(inputs[r][w.size(1)], w, None)
            best[r] = min(best[r], time.perf_counter() - start)
    return [
        {
            "rows": r,
            "ms": best[r] * 1e3,
            "gb_s": nbytes / best[r] / 1e9,
            "read_ms": read_s * 1e3,
            "of_read": read_s / best[r],
        }
        for r in rows
    ]


def prefill_products(rows: list[int], rounds: int, quick: bool) -> list[dict]:
    """F.linear against gptkit's many-row fp32 kernel over a GPT-2-small prefill forward's products (12 layers' own
    weights, 1 with --quick) at each row count: rounds interleaved, each side scored by its best."""
    layers = 1 if quick else 12
    torch.manual_seed(0)
    weights = [torch.randn(n, k) * 0.02 for _ in range(layers) for n, k in SHAPES[:4]]
    torch.ops.gptkit.huge_pages(weights)
    flops = {r: sum(2 * r * w.numel() for w in weights) for r in rows}
    inputs = {r: {k: torch.randn(r, k) for k in (768, 3072)} for r in rows}
    sides = {"torch": F.linear, "gptkit": lambda x, w: torch.ops.gptkit.gemm(x, w, None)}
    best = {(r, side): float("inf") for r in rows for side in sides}
    for _ in range(rounds + 1):  # the first pass warms up
        for r in rows:
            for side, product in sides.items():
                start = time.perf_counter()
                for w in weights:
                    product(inputs[r][w.size(1)], w)
                best[r, side] = min(best[r, side], time.perf_counter() - start)
    return [
        {
            "rows": r,
            **{side: {"ms": best[r, side] * 1e3, "gflop_s": flops[r] / best[r, side] / 1e9} for side in sides},
            "ratio": best[r, "torch"] / best[r, "gptkit"],
        }
        for r in rows
    ]


def report_prefill(results: list[dict], as_json: bool) -> int:
    """Print the prefill products' figures (a table, or one JSON object)."""
    if printed_as_json(results, as_json):
        return 0
    print(f"{'rows':>4} {'torch ms':>9} {'GFLOP/s':>8} {'gptkit ms':>9} {'GFLOP/s':>8} {'torch/gptkit':>12}")
    for r in results:
        t, g = r["torch"], r["gptkit"]
        print(
            f"{r['rows']:4d} {t['ms']:9.1f} {t['gflop_s']:8.1f} {g['ms']:9.1f} {g['gflop_s']:8.1f} {r['ratio']:11.2f}x"
        )
    return 0


def printed_as_json(results: list[dict], as_json: bool) -> bool:
    """With as_json, print the results with the CPU and thread count as one JSON object and return True; else print
    the table's CPU line and return False (the caller prints the table)."""
    if as_json:
        print(json.dumps({"cpu": library.capability(), "threads": torch.get_num_threads(), "results": results}))
        return True
    print(f"cpu: {library.capability()}; threads: {torch.get_num_threads()}")
    return False


def report_streamed(results: list[dict], as_json: bool) -> int:
    """Print the streamed products' figures (a table, or one JSON object)."""
    if printed_as_json(results, as_json):
        return 0
    print(f"{'rows':>4} {'ms':>7} {'GB/s':>6} {'read ms':>8} {'read share':>10}")
    for r in results:
        print(f"{r['rows']:4d} {r['ms']:7.2f} {r['gb_s']:6.1f} {r['read_ms']:8.2f} {100 * r['of_read']:9.0f}%")
    return 0


def _counts(text: str) -> list[int]:
    """Comma-separated whole numbers; [] where any is not one."""
    parts = text.split(",")
    return [int(p) for p in parts] if all(p.strip().isdigit() for p in parts) else []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8", help="comma-separated activation row counts (1 to 8)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; each side scored by its best")
    p.add_argument("--calls", type=int, default=20, help="passes over the five products per round")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument(
        "--shapes",
        choices=("gpt2", "gpt2-streamed", "gpt2-prefill", "qwen3-moe"),
        default="gpt2",
        help="products, a whole step's products streamed from memory, a prefill's products, or MoE decode steps",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: qwen3-moe 2 layers of 16 experts; gpt2-streamed and gpt2-prefill 1 layer",
    )
    p.add_argument("--prefill-rows", default="64", help="gpt2-prefill: comma-separated row counts (9 or more)")
    p.add_argument("--steps", type=int, default=32, help="qwen3-moe: decode steps timed per way")
    args = p.parse_args(argv)
    rows, prefill_rows = _counts(args.rows), _counts(args.prefill_rows)
    if (
        not rows
        or not all(1 <= r <= ops.GEMV_MAX_ROWS for r in rows)
        or args.rounds < 1
        or args.calls < 1
        or not prefill_rows
        or min(prefill_rows) <= ops.GEMV_MAX_ROWS
    ):
        print(
            f"bench_kernels: --rows must lie in 1..{ops.GEMV_MAX_ROWS}, --prefill-rows above it; --rounds and --calls "
            ">= 1",
            file=sys.stderr,
        )
        return 2
    if not library.load():
        print("bench_kernels: gptkit's CPU kernels are not built on this machine (see gptkit/native)", file=sys.stderr)
        return 1
    if args.shapes == "qwen3-moe":
        return report_moe(moe_steps(args.quick, args.steps), args.json)
    if args.shapes == "gpt2-prefill":
        return report_prefill(prefill_products(prefill_rows, args.rounds, args.quick), args.json)
    if args.shapes == "gpt2-streamed":
        return report_streamed(streamed(rows, args.rounds, args.quick), args.json)
    results = measure(rows, args.rounds, args.calls)
    if printed_as_json(results, args.json):
        return 0
    print(f"{'rows':>4} {'format':6} {'torch us':>9} {'GB/s':>6} {'gptkit us':>9} {'GB/s':>6} {'torch/gptkit':>12}")
    for r in results:
        print(
            f"{r['rows']:4d} {r['format']:6} {r['torch']['us']:9.0f} {r['torch']['gb_s']:6.1f} "
            f"{r['gptkit']['us']:9.0f} {r['gptkit']['gb_s']:6.1f} {r['ratio']:11.2f}x"
        )
    return 0


def report_moe(results: list[dict], as_json: bool) -> int:
    """Print the MoE decode steps' figures (a table, or one JSON object)."""
    if printed_as_json(results, as_json):
        return 0
    print(f"{'dtype':9} {'step':6} {'tokens/s':>9} {'MB/token':>9} {'GB/s':>6} {'of bound':>8}")
    for r in results:
        print(
            f"{r['dtype']:9} {r['step']:6} {r['tokens_s']:9.1f} {r['weight_bytes_per_token'] / 1e6:9.1f} "
            f"{r['gb_s']:6.1f} {100 * r['share_of_bound']:7.0f}%"
        )
    print(f"read bandwidth: {results[0]['bandwidth_gb_s']:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
