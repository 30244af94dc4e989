"""Where the batch engine's time goes when many requests arrive at once: prefill against decode, in-process.

The two 32-client workloads of `bench_serve.py --vllm` (serve_workloads.py) on a random GPT-2-small-shaped fp32
model (4,096-token vocabulary), without the HTTP side: 32 prompts of 175-208 random tokens, or 32 prompts sharing a
1,085-token system prompt with 43-55 tokens of their own; the first admitted alone (as a server admits the first
arrival), the other 31 together, then greedy decode steps until each has 64 new tokens. Times are CPU seconds of
this process (steadier than wall time on a shared machine; run it with one thread, pinned). --one-row runs every
prefill forward on one prompt (prefill_waves' path where a row's bits were not measured), and --no-shares decodes
every row from its own copy of a shared prefix (gptkit.decoding.shared_prefix off), each for an A/B:

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/profile_admission.py [--one-row] [--no-shares] [--quick]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from gptkit.config import ModelConfig
from gptkit.decoding import prefill_waves
from gptkit.decoding.batch import BatchEngine, requests_for
from gptkit.decoding.prefix_cache import PrefixCache
from gptkit.decoding.sampling import SamplingParams
from gptkit.model import GPT
from gptkit.native import library


def profile(name: str, model: GPT, prompts: list[list[int]], new_tokens: int, shares: bool) -> None:
    """Prefill (first request, then the rest) and decode CPU seconds of one workload, printed as one line."""
    engine = BatchEngine(model, 32, 2048, prefix_cache=PrefixCache(1 << 32))
    engine.shares_prefixes = shares
    requests = requests_for(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=0.0))
    start = time.process_time()
    engine.add(requests[:1])
    engine.add(requests[1:])
    prefilled = time.process_time()
    steps = 0
    while engine.rows:
        engine.step()
        steps += 1
    end = time.process_time()
    print(
        f"{name}: {sum(map(len, prompts))} prompt tokens, prefill {prefilled - start:.2f} s "
        f"({sum(map(len, prompts)) / (prefilled - start):.0f} tokens/s), {steps} decode steps {end - prefilled:.2f} s "
        f"({(end - prefilled) / steps * 1e3:.0f} ms each); prefill {(prefilled - start) / (end - start):.0%} of "
        f"{end - start:.2f} s",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one-row", action="store_true", help="one prompt per prefill forward (the former path)")
    parser.add_argument("--no-shares", action="store_true", help="rows read their own copy of a shared prefix")
    parser.add_argument("--quick", action="store_true", help="4 layers, 4 requests, 4 new tokens: a smoke run")
    args = parser.parse_args()
    if args.one_row:
        prefill_waves.rows_per_forward = lambda model: 1
    library.load(wait=True)  # the fused decode step, as a server that has built its kernels runs it
    torch.manual_seed(0)
    layers, count, new_tokens = (4, 4, 4) if args.quick else (12, 32, 64)
    config = ModelConfig(vocab_size=4096, block_size=2048, n_layer=layers, n_head=12, n_embd=768)
    model = GPT(config).eval()
    rng = random.Random(0)
    fresh = [[rng.randrange(4096) for _ in range(rng.randint(175, 208))] for _ in range(count)]
    profile(f"{count} clients", model, fresh, new_tokens, not args.no_shares)
    system = [rng.randrange(4096) for _ in range(1085)]
    shared = [system + [rng.randrange(4096) for _ in range(rng.randint(43, 55))] for _ in range(count)]
    profile(f"{count} clients sharing a system prompt", model, shared, new_tokens, not args.no_shares)


if __name__ == "__main__":
    main()
