"""gptkit's decoding against Hugging Face transformers' generate and llama.cpp, on the same weights, in one run.

For a GPT-2-small-shaped model (124M, random weights) and a Llama-shaped one of similar size, built as transformers
models and converted with gptkit.formats.hf so every side runs identical weights, it prints per weight format
(fp32, bf16, and gptkit's int8 and int4 over fp32 activations):
  - prefill tokens/s of one --prompt-len prompt (HF: a forward with use_cache and logits_to_keep=1, as its generate
    prefills; gptkit: decoding.step.prefill),
  - decode tokens/s at each --batch-sizes for --new-tokens greedy tokens after a --decode-prompt-len prompt: HF's
    generate and gptkit's complete() (the default path, and --compile's), both timed from outside as the time for
    every new token less the time for the first (so that the prefill is not counted), with whether row 0's greedy
    tokens are identical to HF's; with --hf-compile also HF's generate over a static cache with torch.compile,
  - the bound: steps/s if the weights a decode step multiplies were read once at the bandwidth the machine streams
    (a probe with every thread pinned to its own CPU, over a buffer many times the last-level cache, best of 5).
With --llama-cpp DIR (a directory holding llama.cpp's llama-bench) the same weights are written as GGUF by gptkit's
own writer (f32, bf16, q8_0 beside gptkit's int8, q4_0, the very bits of gptkit's int4) and `llama-bench -p
PROMPT_LEN -n NEW_TOKENS -r 1` gives llama.cpp's prefill and batch-1 decode rates (its tg test decodes from an empty
context). Every side runs once per round, the rounds interleaved (HF, gptkit's variants, llama.cpp, HF, ...), and
every side is scored by its best round, so that load from other processes shifts all alike. The first line printed
names the CPU, its vector extensions and what gptkit's kernels chose on it. A speculative-decoding section trains a
draft briefly on tiny shakespeare (characters), grows it into a target ten times as deep, fine-tunes that on the
same text, and reports the draft's acceptance rate and the speed-up over plain greedy decoding.

    .venv/bin/python benchmarks/bench_generate.py                      # the full run (tens of minutes on 2 cores)
    .venv/bin/python benchmarks/bench_generate.py --json > bench.json
    .venv/bin/python benchmarks/bench_generate.py --n-layer 2 --n-embd 128 --vocab-size 1000 --prompt-len 32 \\
        --new-tokens 8 --rounds 1 --no-compile --spec-steps 5    # smoke run
    GPTKIT_CPU_KERNELS=0 .venv/bin/python benchmarks/bench_generate.py --shapes gpt2   # without gptkit's CPU kernels
    .venv/bin/python benchmarks/bench_generate.py --shapes gpt2 --batch-sizes 1,8 --spec-steps 0 \\
        --llama-cpp LLAMA_CPP/build/bin                               # docs/benchmarks.md's table

The shapes llama3.2-1b, gemma3-1b and qwen3-moe (a Qwen3-MoE-shaped model of 64 experts) give the decode table
against llama.cpp instead: gptkit models built from the presets, bf16, int8 and int4 beside llama.cpp's bf16, q8_0
and q4_0 of the same weights, batch 1 (llama_cpp_shapes.py says how); --tiny-shapes shrinks them for a smoke run.

    make llama-cpp && .venv/bin/python benchmarks/bench_generate.py --shapes llama3.2-1b,gemma3-1b,qwen3-moe \
        --spec-steps 0 --llama-cpp .cache/llama.cpp/build/bin       # docs/benchmarks.md's decode table
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from gptkit.config import ModelConfig
from gptkit.decoding.api import complete
from gptkit.decoding.options import DecodeOptions
from gptkit.decoding.sampling import SamplingParams
from gptkit.decoding.step import inference, new_cache, prefill
from gptkit.decoding.verify import SpeculativeStats
from gptkit.formats.hf import gpt_from_hf_model
from gptkit.loss import next_token_loss
from gptkit.model import GPT
from gptkit.native import library, ops
from gptkit.quantization import Int4Linear, Int8Linear, quantize

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp_shapes  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1] / "gptkit" / "corpora" / "tinyshakespeare.txt"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GGUF_TYPES = {"fp32": "f32", "bf16": "bf16", "int8": "q8_0", "int4": "q4_0"}  # gptkit's format -> llama.cpp's
# What is not timed alike, and which side each difference favours (printed under the table and kept in the JSON).
# gptkit and HF are timed the same way: prefill, one forward from an empty cache that it allocates, logits at the last
# position only; decode, from outside, the time of every new token after the first, each picked by argmax and handed
# back to the caller.
TIMING_NOTES = (
    "llama.cpp's rates are llama-bench's own clock inside its process, not a call timed from outside: favours "
    "llama.cpp (no Python call, no result handed back)",
    "llama.cpp's decode (its tg test) starts from an empty context, gptkit's and HF's after a --decode-prompt-len "
    "prompt: favours llama.cpp (attention over fewer positions; small while that prompt is short)",
    "llama.cpp's decode picks no token (it feeds its own, without sampling); gptkit and HF take an argmax over the "
    "vocabulary each step: favours llama.cpp",
    "llama.cpp's prefill runs the prompt as its own test (no decode after it), as gptkit's and HF's do: no difference",
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def read_bandwidth(megabytes: int, rounds: int = 5) -> float:
    """Bytes/s every thread together streams from memory: gptkit's probe (threads pinned, the buffer on 2 MiB pages as
    the fused step's weights are, best of `rounds`) where its kernels are built, else a multi-threaded sum."""
    x = torch.ones(megabytes * (1 << 20) // 4)
    if library.load():
        torch.ops.gptkit.huge_pages([x])
        return torch.ops.gptkit.read_bandwidth(x, rounds)
    best = float("inf")
    for _ in range(rounds + 1):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def weight_bytes_per_token(model: GPT) -> int:
    """Bytes of matmul weights a decode step reads (every Linear, the LM head included; not the embedding rows)."""
    total = 0
    for module in model.modules():
        if isinstance(module, (Int8Linear, Int4Linear)):
            total += module.weight.numel() * module.weight.element_size()
            total += module.scales.numel() * module.scales.element_size()
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


# ----- the models -----


def hf_models(args: argparse.Namespace) -> dict[str, Any]:
    """The transformers models to compare, with random weights (seeded)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    width, layers, heads = args.n_embd, args.n_layer, max(1, args.n_embd // 64)
    models = {}
    if "gpt2" in args.shapes:
        config = GPT2Config(
            vocab_size=args.vocab_size or 50257, n_positions=1024, n_embd=width, n_layer=layers, n_head=heads
        )
        models["gpt2"] = GPT2LMHeadModel(config)
    if "llama" in args.shapes:
        config = LlamaConfig(
            vocab_size=args.vocab_size or 32000,
            hidden_size=width,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 3),
            intermediate_size=args.n_embd * 8 // 3 // 64 * 64 or 64,
            max_position_embeddings=1024,
        )
        models["llama"] = LlamaForCausalLM(config)
    for model in models.values():
        model.eval()
        model.generation_config.eos_token_id = None  # random weights: always generate every token
        model.generation_config.pad_token_id = 0
    return models


def variants(hf: Any, args: argparse.Namespace) -> dict[str, GPT]:
    """gptkit's models of the same weights: fp32 and bf16, and int8 and int4 over fp32 activations."""
    fp32 = gpt_from_hf_model(hf).eval()
    models = {"fp32": fp32} if "fp32" in args.dtypes else {}
    if "bf16" in args.dtypes:
        models["bf16"] = gpt_from_hf_model(copy.deepcopy(hf).to(torch.bfloat16)).eval()
    for method in args.quantized:
        models[method] = quantize(gpt_from_hf_model(hf).eval(), method)
    return models


# ----- one timed run of each side -----


@torch.no_grad()
def hf_prefill_rate(hf: Any, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    hf(ids, use_cache=True, logits_to_keep=1)  # generate's prefill: the LM head at the last position only
    return ids.numel() / (time.perf_counter() - start)


def gptkit_prefill_rate(model: GPT, ids: torch.Tensor) -> float:
    """Prompt tokens/s of one prefill, its cache's allocation included (as HF's forward allocates its own)."""
    lengths = torch.full((ids.size(0),), ids.size(1))
    with inference(model):
        start = time.perf_counter()
        prefill(model, ids, new_cache(model, ids.size(0), ids.size(1)), lengths)
        return ids.numel() / (time.perf_counter() - start)


def decode_rate(
    generate: Callable[[int], list[int]], rows: int, new_tokens: int, warm_both: bool = False
) -> tuple[float, list[int]]:
    """Decode tokens/s of a generate(n) call: its time for new_tokens less its time for one (the prefill and the
    first token), over every row; and row 0's new tokens. An untimed call first takes any one-off cost (a compile);
    warm_both also runs new_tokens untimed first (HF's static cache is sized by the length: one compile each)."""
    generate(1)
    ops.await_huge_pages()  # gptkit's fused step starts moving its weights to 2 MiB pages on its first call
    if warm_both:
        generate(new_tokens)
    start = time.perf_counter()
    generate(1)
    one = time.perf_counter() - start
    start = time.perf_counter()
    tokens = generate(new_tokens)
    full = time.perf_counter() - start
    return rows * (new_tokens - 1) / max(full - one, 1e-9), tokens


@torch.no_grad()
def hf_generate(hf: Any, ids: torch.Tensor) -> Callable[[int], list[int]]:
    mask = torch.ones_like(ids)
    return lambda n: hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)[0, ids.size(1) :].tolist()


def gptkit_generate(model: GPT, ids: torch.Tensor, compile: bool) -> Callable[[int], list[int]]:
    prompts = ids.tolist()
    return lambda n: (
        complete(
            model, prompts, SamplingParams(max_new_tokens=n, temperature=0), options=DecodeOptions(compile=compile)
        )
        .completions[0][0]
        .ids
    )


# ----- llama.cpp -----


def llama_bench(binary: Path, gguf: Path, args: argparse.Namespace) -> dict[str, float]:
    """One llama-bench repetition (after its own warm-up): {"prefill": tokens/s, "decode": tokens/s}."""
    command = [
        str(binary),
        "-m",
        str(gguf),
        "-p",
        str(args.prompt_len),
        "-n",
        str(args.new_tokens),
        "-t",
        str(torch.get_num_threads()),
        "-r",
        "1",
        "-o",
        "json",
    ]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return {"prefill" if record["n_prompt"] else "decode": max(record["samples_ts"]) for record in json.loads(out)}


# ----- the comparison -----


def compare_shape(
    name: str, hf_fp32: Any, args: argparse.Namespace, bandwidth: float, tmp: Path
) -> list[dict[str, Any]]:
    """Rows of the table for one model shape: every weight format and measure, each side's best round."""
    gen = torch.Generator().manual_seed(1)
    vocab = hf_fp32.config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt_len), generator=gen)
    decode_ids = {b: torch.randint(0, vocab, (b, args.decode_prompt_len), generator=gen) for b in args.batch_sizes}
    hfs = {"fp32": hf_fp32} | ({"bf16": copy.deepcopy(hf_fp32).to(torch.bfloat16)} if "bf16" in args.dtypes else {})
    ours = variants(hf_fp32, args)
    ggufs = {}
    if args.llama_cpp:
        for label, model in ours.items():
            ggufs[label] = llama_cpp_shapes.write_gguf(model, tmp / f"{name}-{label}.gguf", GGUF_TYPES[label])
    compiled_hf = {}
    if args.hf_compile:
        # Every (batch, length) pair is a static cache of its own shape: a compile each, more than dynamo's
        # default limit of 8, past which it would quietly run HF eagerly.
        torch._dynamo.config.recompile_limit = 64
        for label, hf in hfs.items():
            compiled_hf[label] = copy.deepcopy(hf)
            compiled_hf[label].generation_config.cache_implementation = "static"
            compiled_hf[label].forward = torch.compile(compiled_hf[label].forward)
    best: dict[tuple[str, str], float] = {}
    tokens: dict[tuple[str, str], list[int]] = {}

    def record(key: tuple[str, str], rate: float, toks: list[int] | None = None) -> None:
        best[key] = max(best.get(key, 0.0), rate)
        if toks is not None:
            tokens[key] = toks

    for round_index in range(args.rounds):
        log(f"[{name}] round {round_index + 1} of {args.rounds}")
        bandwidth = max(bandwidth, read_bandwidth(args.probe_mb))  # its rate moves: its best moment is the ceiling
        for label, hf in hfs.items():  # Hugging Face in each of its dtypes (its rows for int8/int4 are fp32's)
            record(("hf " + label, "prefill"), hf_prefill_rate(hf, prompt))
            for b in args.batch_sizes:
                rate, toks = decode_rate(hf_generate(hf, decode_ids[b]), b, args.new_tokens)
                record(("hf " + label, f"decode b{b}"), rate, toks)
                if label in compiled_hf:
                    rate, toks = decode_rate(hf_generate(compiled_hf[label], decode_ids[b]), b, args.new_tokens, True)
                    record(("hf compiled " + label, f"decode b{b}"), rate, toks)
        for label, model in ours.items():
            record((label, "prefill"), gptkit_prefill_rate(model, prompt))
            for b in args.batch_sizes:
                for compile in (False, True) if args.compile else (False,):
                    side = label + (" compiled" if compile else "")
                    rate, toks = decode_rate(gptkit_generate(model, decode_ids[b], compile), b, args.new_tokens)
                    record((side, f"decode b{b}"), rate, toks)
        for label, gguf in ggufs.items():
            for phase, rate in llama_bench(Path(args.llama_cpp) / "llama-bench", gguf, args).items():
                record(("llama.cpp " + label, "prefill" if phase == "prefill" else "decode b1"), rate)
    rows = table_rows(name, ours, hfs, best, tokens, args, bandwidth)
    for row in rows:
        row["read_bandwidth_gb_s"] = bandwidth / 1e9
    return rows


def table_rows(
    name: str,
    ours: dict[str, GPT],
    hfs: dict[str, Any],
    best: dict[tuple[str, str], float],
    tokens: dict[tuple[str, str], list[int]],
    args: argparse.Namespace,
    bandwidth: float,
) -> list[dict[str, Any]]:
    """One row per gptkit format and measure, with every other side's best beside it."""
    rows = []
    measures = ["prefill"] + [f"decode b{b}" for b in args.batch_sizes]
    for label, model in ours.items():
        hf_label = label if label in hfs else "fp32"
        for measure in measures:
            row: dict[str, Any] = dict(
                shape=name,
                format=label,
                measure=measure,
                hf=best[("hf " + hf_label, measure)],
                gptkit=best[(label, measure)],
            )
            row["vs_hf"] = row["gptkit"] / row["hf"]
            if measure != "prefill":
                batch = int(measure.split("b")[1])
                row["bound_tokens_per_s"] = batch * bandwidth / weight_bytes_per_token(model)
                row["share_of_bound"] = row["gptkit"] / row["bound_tokens_per_s"]
                if (label + " compiled", measure) in best:
                    row["gptkit_compiled"] = best[(label + " compiled", measure)]
                if ("hf compiled " + hf_label, measure) in best:
                    row["hf_compiled"] = best[("hf compiled " + hf_label, measure)]
                if label in ("fp32", "bf16"):
                    row["same_tokens_as_hf"] = tokens[(label, measure)] == tokens[("hf " + hf_label, measure)]
            llama = best.get(("llama.cpp " + label, measure))
            if llama is not None:
                row["llama_cpp"] = llama
                row["vs_llama_cpp"] = row["gptkit"] / llama
            rows.append(row)
    return rows


# ----- speculative decoding -----


def train_char_model(model: GPT, data: torch.Tensor, steps: int, lr: float, seed: int) -> GPT:
    """model trained (AdamW) on random windows of character ids; returned in eval mode."""
    torch.manual_seed(seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    T = min(128, model.config.block_size - 1)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - T - 1, (8,))
        batch = torch.stack([data[s : s + T + 1] for s in starts.tolist()])
        loss = next_token_loss(model(batch[:, :-1]), batch[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def grown_from(draft: GPT, config: ModelConfig) -> GPT:
    """A deeper model whose first blocks, embeddings, final norm and head are the draft's and whose extra blocks
    start as the identity (zero output projections): it begins by predicting exactly what the draft predicts."""
    target = GPT(config)
    target.load_state_dict(target.state_dict() | draft.state_dict())  # the draft's block i is the target's block i
    with torch.no_grad():
        for block in target.blocks[draft.config.n_layer :]:
            block.attn.proj.weight.zero_()
            block.mlp.proj.weight.zero_()
    return target


def speculative_section(args: argparse.Namespace) -> list[dict[str, Any]]:
    """A draft (1/10 of the target's depth) trained on tiny shakespeare, and a target fine-tuned from it.

    The target is the draft grown to the full depth and then trained further on the same text, the way a draft and
    its target share data and often weights in practice, so the draft agrees with it often without agreeing always.
    """
    from gptkit.tokenizer import CharTokenizer

    text = CORPUS.read_text()
    tokenizer = CharTokenizer.train([text])
    data = torch.tensor(tokenizer.encode(text))
    config = dict(
        vocab_size=tokenizer.vocab_size, block_size=1024, n_head=max(1, args.n_embd // 64), n_embd=args.n_embd
    )
    draft_config = ModelConfig(**config, n_layer=max(1, args.n_layer // 10))
    target_config = ModelConfig(**config, n_layer=args.n_layer)
    log(
        f"[speculative] training the draft ({args.spec_steps} steps), then the target from it "
        f"({args.spec_tune_steps} steps)"
    )
    draft = train_char_model(GPT(draft_config), data, args.spec_steps, lr=1e-3, seed=1)
    target = train_char_model(grown_from(draft, target_config), data, args.spec_tune_steps, lr=1e-4, seed=2)
    sizes = [sum(p.numel() for p in m.parameters()) for m in (target, draft)]
    prompt = [tokenizer.encode("ROMEO:\n")]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0)
    rows = []
    for k in args.draft_k:
        plain_best, spec_best, stats = 0.0, 0.0, SpeculativeStats()
        same = True
        for _ in range(args.rounds):
            plain = complete(target, prompt, params)
            spec = complete(target, prompt, params, options=DecodeOptions(draft=draft, draft_k=k))
            same = same and plain.completions[0][0].ids == spec.completions[0][0].ids
            # Both rates over the whole request (prefill included: speculation does not time it apart).
            plain_rate = (plain.timing.decode_tokens + 1) / (plain.timing.decode_seconds + plain.timing.prefill_seconds)
            spec_rate = spec.timing.decode_tokens / spec.timing.decode_seconds
            plain_best, spec_best, stats = (
                max(plain_best, plain_rate),
                max(spec_best, spec_rate),
                spec.timing.speculative,
            )
        rows.append(
            dict(
                k=k,
                target_params=sizes[0],
                draft_params=sizes[1],
                acceptance_rate=stats.acceptance_rate,
                plain_tokens_per_s=plain_best,
                speculative_tokens_per_s=spec_best,
                speedup=spec_best / plain_best,
                same_tokens=same,
            )
        )
    return rows


# ----- output -----


def print_table(rows: list[dict[str, Any]], spec_rows: list[dict[str, Any]], bandwidth: float) -> None:
    print(f"cpu: {library.capability()}")
    bandwidth = max([bandwidth] + [r["read_bandwidth_gb_s"] * 1e9 for r in rows])
    print(
        f"measured read bandwidth (best of every round's probe): {bandwidth / 1e9:.1f} GB/s; threads: "
        f"{torch.get_num_threads()}"
    )
    print(
        f"{'shape':6} {'format':6} {'measure':11} {'HF':>8} {'HF comp':>8} {'gptkit':>8} {'/HF':>6} "
        f"{'compiled':>8} {'llama.cpp':>9} {'/llama':>6} {'bound':>7} {'%bound':>6} same"
    )
    for r in rows:
        cell = lambda key, width=8: f"{r[key]:{width}.1f}" if key in r else " " * width  # noqa: E731
        ratio = f"{r['vs_llama_cpp']:6.2f}" if "vs_llama_cpp" in r else " " * 6
        same = {True: "yes", False: "NO"}.get(r.get("same_tokens_as_hf"), "")
        share = f"{100 * r['share_of_bound']:5.0f}%" if "share_of_bound" in r else " " * 6
        print(
            f"{r['shape']:6} {r['format']:6} {r['measure']:11} {cell('hf')} {cell('hf_compiled')} {cell('gptkit')} "
            f"{r['vs_hf']:6.2f} {cell('gptkit_compiled')} {cell('llama_cpp', 9)} {ratio} "
            f"{cell('bound_tokens_per_s', 7)} {share} {same}"
        )
    print(
        "tokens/s; bound: if every weight byte a decode step multiplies were read once per step at the measured "
        "bandwidth; %bound: gptkit's tokens/s as a share of it"
    )
    if any("llama_cpp" in r for r in rows):
        print("not timed alike:\n" + "\n".join(f"  - {note}" for note in TIMING_NOTES))
    for r in spec_rows:
        print(
            f"speculative k={r['k']}: target {r['target_params'] / 1e6:.1f}M, draft {r['draft_params'] / 1e6:.1f}M, "
            f"acceptance {r['acceptance_rate'] or 0:.2f}, {r['plain_tokens_per_s']:.1f} -> "
            f"{r['speculative_tokens_per_s']:.1f} tok/s ({r['speedup']:.2f}x), same tokens: {r['same_tokens']}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    csv = lambda kind: lambda s: [kind(x) for x in s.split(",")]  # noqa: E731
    p.add_argument(
        "--shapes",
        type=csv(str),
        default=["gpt2", "llama"],
        help=f"gpt2,llama (default: both), or the decode table's {','.join(llama_cpp_shapes.SHAPES)}",
    )
    p.add_argument("--tiny-shapes", action="store_true", help="the decode table's shapes at a smoke run's size")
    p.add_argument("--dtypes", type=csv(str), default=["fp32", "bf16"], help="fp32,bf16 (default: both)")
    p.add_argument(
        "--quantized",
        type=csv(str),
        default=["int8", "int4"],
        help="gptkit's quantised formats, over fp32 activations (default: int8,int4; none: '')",
    )
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip gptkit's compiled rows")
    p.add_argument(
        "--hf-compile",
        action="store_true",
        help="also Hugging Face's generate over a static cache with torch.compile (minutes of compiling)",
    )
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--vocab-size", type=int, default=None, help="default: 50257 (gpt2) / 32000 (llama)")
    p.add_argument("--prompt-len", type=int, default=512, help="prefill length (default: 512)")
    p.add_argument("--decode-prompt-len", type=int, default=16, help="prompt length before decoding (default: 16)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", type=csv(int), default=[1, 8])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best of each side counts")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument(
        "--probe-mb",
        type=int,
        default=1024,
        help="the bandwidth probe's buffer, MiB (default 1024: many times a last-level cache)",
    )
    p.add_argument("--spec-steps", type=int, default=300, help="training steps of the speculative draft (0: skip)")
    p.add_argument("--spec-tune-steps", type=int, default=20, help="training steps of the target grown from it")
    p.add_argument("--draft-k", type=csv(int), default=[2, 4])
    p.add_argument(
        "--llama-cpp",
        default=None,
        metavar="DIR",
        help="a directory holding llama.cpp's llama-bench: adds llama.cpp's rates on the same weights",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    args.quantized = [m for m in args.quantized if m]
    unknown = set(args.shapes) - {"gpt2", "llama"} - set(llama_cpp_shapes.SHAPES)
    if unknown:
        p.error(f"unknown shape {sorted(unknown)[0]!r}: choose from gpt2, llama, {', '.join(llama_cpp_shapes.SHAPES)}")
    if args.llama_cpp and not (Path(args.llama_cpp) / "llama-bench").is_file():
        p.error(f"no llama-bench in {args.llama_cpp}; see 'Building llama.cpp' in docs/convert.md")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    library.prepare()  # built and measured before anything is timed
    bandwidth = read_bandwidth(args.probe_mb)
    log(f"cpu: {library.capability()}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, hf in hf_models(args).items():
            rows += compare_shape(name, hf, args, bandwidth, Path(tmp))
        shape_rows = []
        for name in args.shapes:
            if name in llama_cpp_shapes.SHAPES:
                shape_rows += llama_cpp_shapes.compare_shape(name, args, bandwidth, Path(tmp))
    spec_rows = speculative_section(args) if args.spec_steps > 0 else []
    if args.json:
        print(
            json.dumps(
                {
                    "cpu": library.capability(),
                    "read_bandwidth_gb_s": bandwidth / 1e9,
                    "threads": torch.get_num_threads(),
                    "rows": rows,
                    "speculative": spec_rows,
                    "llama_cpp_decode": shape_rows,
                    "timing_notes": TIMING_NOTES if args.llama_cpp else [],
                },
                indent=2,
            )
        )
    else:
        if rows or spec_rows:
            print_table(rows, spec_rows, bandwidth)
        if shape_rows:
            print(f"cpu: {library.capability()}; threads: {torch.get_num_threads()}")
            llama_cpp_shapes.print_rows(shape_rows, bandwidth)
    return 0


if __name__ == "__main__":
    sys.exit(main())
