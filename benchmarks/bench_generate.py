"""gptkit's decoding against Hugging Face transformers' generate and llama.cpp, on the same weights, in one run.

For a GPT-2-small-shaped model (124M, random weights) and a Llama-shaped one of similar size, built as transformers
models and converted with gptkit.formats.hf so both sides run identical weights, it prints per dtype:
  - prefill tokens/s of one 512-token prompt (HF: a forward with use_cache and logits_to_keep=1, as its generate
    prefills; gptkit: generation.prefill),
  - decode tokens/s at batch 1 and 8 for 128 greedy new tokens (HF generate with its KV cache; gptkit complete(),
    eager and compiled), with the ratio gptkit / HF and whether the batch-1 greedy tokens are identical,
  - the memory-bandwidth bound: bytes of weights (+ KV cache) read per decode step against a measured read rate,
and int8 weight-only for gptkit. The two sides run interleaved (HF, gptkit, HF, gptkit, ...) and each keeps its best
round, so that load from other processes shifts both alike. With --llama-cpp DIR (a directory holding llama.cpp's
llama-bench), the same weights are written as GGUF by gptkit's own writer (f32, bf16, and q8_0 beside gptkit's
int8) and `llama-bench -p PROMPT_LEN -n NEW_TOKENS` gives llama.cpp's prefill and batch-1 decode rates. The first
line printed names the CPU, its vector extensions and what gptkit's kernels chose on it. A speculative-decoding section trains a draft briefly on
tiny shakespeare (characters), grows it into a target ten times as deep, fine-tunes that on the same text, and
reports the draft's acceptance rate and the speed-up over plain greedy decoding.

    .venv/bin/python benchmarks/bench_generate.py                      # the full run (tens of minutes on 2 cores)
    .venv/bin/python benchmarks/bench_generate.py --json > bench.json
    .venv/bin/python benchmarks/bench_generate.py --n-layer 2 --n-embd 128 --vocab-size 1000 --prompt-len 32 \\
        --new-tokens 8 --rounds 1 --no-compile --spec-steps 5    # smoke run
    GPTKIT_CPU_KERNELS=0 .venv/bin/python benchmarks/bench_generate.py --shapes gpt2   # without gptkit's CPU kernels
    .venv/bin/python benchmarks/bench_generate.py --shapes gpt2 --batch-sizes 1,8 --spec-steps 0 \
        --llama-cpp /work/tools/llama.cpp/build/bin                   # the README's table
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

from gptkit import cpu_kernels
from gptkit.config import ModelConfig
from gptkit.decoding.api import complete
from gptkit.decoding.sampling import SamplingParams
from gptkit.decoding.speculative import SpeculativeStats
from gptkit.decoding.step import inference, new_cache, prefill
from gptkit.formats.hf import gpt_from_hf_model
from gptkit.loss import next_token_loss
from gptkit.model import GPT
from gptkit.quantization import Int8Linear, quantize

CORPUS = Path(__file__).resolve().parents[1] / "gptkit" / "corpora" / "tinyshakespeare.txt"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def best_of(rounds: int, run: Callable[[], float]) -> float:
    """The highest rate of `rounds` runs (the least disturbed by other processes)."""
    return max(run() for _ in range(rounds))


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes/s a multi-threaded sum streams from memory (a buffer far larger than the caches)."""
    x = torch.ones(megabytes * (1 << 20) // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / min(times)


def weight_bytes_per_token(model: GPT) -> int:
    """Bytes of matmul weights a decode step reads (every Linear, the LM head included; not the embedding rows)."""
    total = 0
    for module in model.modules():
        if isinstance(module, Int8Linear):
            total += module.weight.numel() + module.scales.numel() * module.scales.element_size()
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
        config = GPT2Config(vocab_size=args.vocab_size or 50257, n_positions=1024, n_embd=width, n_layer=layers,
                            n_head=heads)  # fmt: skip
        models["gpt2"] = GPT2LMHeadModel(config)
    if "llama" in args.shapes:
        config = LlamaConfig(vocab_size=args.vocab_size or 32000, hidden_size=width, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=max(1, heads // 3),
                             intermediate_size=args.n_embd * 8 // 3 // 64 * 64 or 64, max_position_embeddings=1024)
        models["llama"] = LlamaForCausalLM(config)
    for model in models.values():
        model.eval()
        model.generation_config.eos_token_id = None  # random weights: always generate every token
        model.generation_config.pad_token_id = 0
    return models


# ----- timed runs -----


@torch.no_grad()
def hf_prefill_rate(hf: Any, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    hf(ids, use_cache=True, logits_to_keep=1)  # generate's prefill: the LM head at the last position only
    return ids.numel() / (time.perf_counter() - start)


def gptkit_prefill_rate(model: GPT, ids: torch.Tensor) -> float:
    cache = new_cache(model, ids.size(0), ids.size(1))
    lengths = torch.full((ids.size(0),), ids.size(1))
    with inference(model):
        start = time.perf_counter()
        prefill(model, ids, cache, lengths)
        return ids.numel() / (time.perf_counter() - start)


@torch.no_grad()
def hf_decode(hf: Any, ids: torch.Tensor, new_tokens: int) -> tuple[float, list[int]]:
    """Decode tokens/s of generate (its time for new_tokens minus its time for 1) and row 0's new tokens."""
    mask = torch.ones_like(ids)
    start = time.perf_counter()
    hf.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
    one = time.perf_counter() - start
    start = time.perf_counter()
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    full = time.perf_counter() - start
    return ids.size(0) * (new_tokens - 1) / max(full - one, 1e-9), out[0, ids.size(1) :].tolist()


def gptkit_decode(model: GPT, ids: torch.Tensor, new_tokens: int, compile: bool) -> tuple[float, list[int], float]:
    """Decode tokens/s of complete(), row 0's new tokens, and the compile seconds (0 for eager)."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0)
    result = complete(model, ids.tolist(), params, compile=compile)
    timing = result.timing
    return timing.decode_tokens / timing.decode_seconds, result.completions[0][0].ids, timing.compile_seconds or 0.0


# ----- the comparison -----


def compare_shape(name: str, hf_fp32: Any, args: argparse.Namespace, bandwidth: float) -> list[dict[str, Any]]:
    """Rows of the table for one model shape: each dtype, each measurement, gptkit against HF."""
    rows = []
    gen = torch.Generator().manual_seed(1)
    vocab = hf_fp32.config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt_len), generator=gen)
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        hf = copy.deepcopy(hf_fp32).to(dtype)
        ours = gpt_from_hf_model(hf).eval()
        variants = {dtype_name: ours}
        if args.int8 and dtype_name in args.int8_dtypes:
            variants[f"int8 ({dtype_name} act.)"] = quantize(gpt_from_hf_model(hf).eval(), "int8")
        log(f"[{name} {dtype_name}] prefill {args.prompt_len} tokens")
        hf_rate = best_of(args.rounds, lambda: hf_prefill_rate(hf, prompt))
        for label, model in variants.items():
            rate = best_of(args.rounds, lambda: gptkit_prefill_rate(model, prompt))
            rows.append(dict(shape=name, dtype=label, measure=f"prefill {args.prompt_len}", hf=hf_rate,
                             gptkit=rate, ratio=rate / hf_rate))  # fmt: skip
        for batch in args.batch_sizes:
            ids = torch.randint(0, vocab, (batch, args.decode_prompt_len), generator=gen)
            log(f"[{name} {dtype_name}] decode batch {batch}, {args.new_tokens} new tokens")
            hf_best, hf_tokens = 0.0, []
            best: dict[str, float] = {}
            tokens: dict[str, list[int]] = {}
            compile_s: dict[str, float] = {}
            modes = [(label, model, False) for label, model in variants.items()]
            if args.compile:
                modes += [(label + " compiled", model, True) for label, model in variants.items()]
            for _ in range(args.rounds):  # interleaved rounds: HF, then each gptkit mode
                rate, hf_tokens = hf_decode(hf, ids, args.new_tokens)
                hf_best = max(hf_best, rate)
                for label, model, compiled in modes:
                    rate, toks, secs = gptkit_decode(model, ids, args.new_tokens, compiled)
                    best[label] = max(best.get(label, 0.0), rate)
                    tokens[label] = toks
                    compile_s[label] = max(compile_s.get(label, 0.0), secs)
            for label, model, compiled in modes:
                bytes_per_step = weight_bytes_per_token(model)
                row = dict(shape=name, dtype=label, measure=f"decode b{batch}", hf=hf_best, gptkit=best[label],
                           ratio=best[label] / hf_best, bound_steps_per_s=bandwidth / bytes_per_step,
                           weight_mb=bytes_per_step / 1e6)  # fmt: skip
                if compiled:
                    row["compile_seconds"] = compile_s[label]
                if not label.startswith("int8"):
                    row["same_tokens_as_hf"] = tokens[label] == hf_tokens
                rows.append(row)
        del hf, ours, variants
    return rows


# ----- llama.cpp -----

GGUF_TYPES = {"fp32": "f32", "bf16": "bf16", "int8": "q8_0"}  # gptkit's rows -> the GGUF type llama.cpp runs


def write_gguf(model: GPT, path: Path, kind: str) -> Path:
    """model's weights as a GGUF file of tensor type kind, by gptkit's own writer (`gptkit convert --to-gguf`)."""
    from gptkit.formats.gguf import export_gguf
    from gptkit.tokenizer import ByteTokenizer

    return export_gguf(model, path, ByteTokenizer(), file_type=kind)


def llama_cpp_rates(hf_fp32: Any, args: argparse.Namespace) -> dict[tuple[str, str], float]:
    """llama-bench's tokens/s on the same weights as GGUF: {(gguf type, "prefill" or "decode"): rate}."""
    binary = Path(args.llama_cpp) / "llama-bench"
    if not binary.is_file():
        raise SystemExit(f"bench_generate: no llama-bench in {args.llama_cpp}; see README's 'Building llama.cpp'")
    model = gpt_from_hf_model(hf_fp32).eval()
    wanted = sorted({GGUF_TYPES[d] for d in args.dtypes} | ({"q8_0"} if args.int8 else set()))
    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in wanted:
            path = write_gguf(model, Path(tmp) / f"model-{kind}.gguf", kind)
            log(f"[llama.cpp {kind}] llama-bench -p {args.prompt_len} -n {args.new_tokens}")
            command = [str(binary), "-m", str(path), "-p", str(args.prompt_len), "-n", str(args.new_tokens),
                       "-t", str(torch.get_num_threads()), "-r", str(args.rounds), "-o", "json"]  # fmt: skip
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            for record in json.loads(out):
                phase = "prefill" if record["n_prompt"] else "decode"
                rates[kind, phase] = float(record["avg_ts"])
    return rates


def add_llama_cpp(rows: list[dict[str, Any]], rates: dict[tuple[str, str], float], shape: str) -> None:
    """llama.cpp's rate beside each row it has a counterpart for (prefill, and decode at batch 1)."""
    for row in rows:
        if row["shape"] != shape:
            continue
        kind = GGUF_TYPES["int8" if row["dtype"].startswith("int8") else row["dtype"].split()[0]]
        phase = "prefill" if row["measure"].startswith("prefill") else "decode" if row["measure"] == "decode b1" else None
        if phase and (kind, phase) in rates:
            row["llama_cpp"] = rates[kind, phase]
            row["vs_llama_cpp"] = row["gptkit"] / rates[kind, phase]


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
    config = dict(vocab_size=tokenizer.vocab_size, block_size=1024, n_head=max(1, args.n_embd // 64),
                  n_embd=args.n_embd)  # fmt: skip
    draft_config = ModelConfig(**config, n_layer=max(1, args.n_layer // 10))
    target_config = ModelConfig(**config, n_layer=args.n_layer)
    log(f"[speculative] training the draft ({args.spec_steps} steps), then the target from it "
        f"({args.spec_tune_steps} steps)")  # fmt: skip
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
            spec = complete(target, prompt, params, draft=draft, draft_k=k)
            same = same and plain.completions[0][0].ids == spec.completions[0][0].ids
            # Both rates over the whole request (prefill included: speculation does not time it apart).
            plain_rate = (plain.timing.decode_tokens + 1) / (plain.timing.decode_seconds + plain.timing.prefill_seconds)
            spec_rate = spec.timing.decode_tokens / spec.timing.decode_seconds
            plain_best, spec_best, stats = max(plain_best, plain_rate), max(spec_best, spec_rate), spec.timing.speculative
        rows.append(dict(k=k, target_params=sizes[0], draft_params=sizes[1], acceptance_rate=stats.acceptance_rate,
                         plain_tokens_per_s=plain_best, speculative_tokens_per_s=spec_best,
                         speedup=spec_best / plain_best, same_tokens=same))  # fmt: skip
    return rows


# ----- output -----


def print_table(rows: list[dict[str, Any]], spec_rows: list[dict[str, Any]], bandwidth: float) -> None:
    print(f"cpu: {cpu_kernels.capability()}")
    print(f"measured read bandwidth: {bandwidth / 1e9:.1f} GB/s; threads: {torch.get_num_threads()}")
    print(f"{'shape':6} {'dtype':24} {'measure':12} {'HF tok/s':>9} {'gptkit':>9} {'/HF':>6} {'llama.cpp':>9} "
          f"{'/llama':>6} {'bound':>7} {'compile s':>9} same")  # fmt: skip
    for r in rows:
        bound = f"{r['bound_steps_per_s']:7.1f}" if "bound_steps_per_s" in r else " " * 7
        comp = f"{r['compile_seconds']:9.1f}" if "compile_seconds" in r else " " * 9
        same = {True: "yes", False: "NO"}.get(r.get("same_tokens_as_hf"), "")
        llama = f"{r['llama_cpp']:9.1f} {r['vs_llama_cpp']:6.2f}" if "llama_cpp" in r else " " * 16
        print(f"{r['shape']:6} {r['dtype']:24} {r['measure']:12} {r['hf']:9.1f} {r['gptkit']:9.1f} "
              f"{r['ratio']:6.2f} {llama} {bound} {comp} {same}")  # fmt: skip
    print("bound: steps/s if every weight byte is read once per step at the measured bandwidth (x batch = tok/s)")
    for r in spec_rows:
        print(f"speculative k={r['k']}: target {r['target_params'] / 1e6:.1f}M, draft {r['draft_params'] / 1e6:.1f}M, "
              f"acceptance {r['acceptance_rate'] or 0:.2f}, {r['plain_tokens_per_s']:.1f} -> "
              f"{r['speculative_tokens_per_s']:.1f} tok/s ({r['speedup']:.2f}x), same tokens: {r['same_tokens']}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    csv = lambda kind: lambda s: [kind(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--shapes", type=csv(str), default=["gpt2", "llama"], help="gpt2,llama (default: both)")
    p.add_argument("--dtypes", type=csv(str), default=["fp32", "bf16"], help="fp32,bf16 (default: both)")
    p.add_argument("--no-int8", dest="int8", action="store_false", help="skip gptkit's int8 rows")
    p.add_argument("--int8-dtypes", type=csv(str), default=["fp32", "bf16"],
                   help="activation dtypes of the int8 rows (default: fp32,bf16)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip gptkit's compiled rows")
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--vocab-size", type=int, default=None, help="default: 50257 (gpt2) / 32000 (llama)")
    p.add_argument("--prompt-len", type=int, default=512, help="prefill length (default: 512)")
    p.add_argument("--decode-prompt-len", type=int, default=16, help="prompt length before decoding (default: 16)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", type=csv(int), default=[1, 8])
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the best of each side counts")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--spec-steps", type=int, default=300, help="training steps of the speculative draft (0: skip)")
    p.add_argument("--spec-tune-steps", type=int, default=20, help="training steps of the target grown from it")
    p.add_argument("--draft-k", type=csv(int), default=[2, 4])
    p.add_argument("--llama-cpp", default=None, metavar="DIR",
                   help="a directory holding llama.cpp's llama-bench: adds llama.cpp's rates on the same weights")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth()
    log(f"cpu: {cpu_kernels.capability()}")
    rows = []
    for name, hf in hf_models(args).items():
        rows += compare_shape(name, hf, args, bandwidth)
        if args.llama_cpp:
            add_llama_cpp(rows, llama_cpp_rates(hf, args), name)
    spec_rows = speculative_section(args) if args.spec_steps > 0 else []
    if args.json:
        print(json.dumps({"cpu": cpu_kernels.capability(), "read_bandwidth_gb_s": bandwidth / 1e9,
                          "threads": torch.get_num_threads(),
                          "rows": rows, "speculative": spec_rows}, indent=2))  # fmt: skip
    else:
        print_table(rows, spec_rows, bandwidth)
    return 0


if __name__ == "__main__":
    sys.exit(main())
