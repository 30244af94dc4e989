"""gptkit on one GPU beside Hugging Face transformers (and PEFT), each side in the same loop on the same GPU.

Parts (--parts; all by default, in this order), each written to OUT/bench_gpu.json and OUT/bench_gpu.md as it ends:
  env     the GPU, its datasheet dense bf16 peak (gptkit.devices.GPU_PEAK_FLOPS) and two measured ceilings: an
          8192^3 bf16 matmul and a 1 GiB device-to-device copy (bytes read plus written).
  loss    GPT-2 small's LM head fused into the loss (gptkit.loss.linear_cross_entropy), forward and backward over one
          batch in bf16 autocast: in the CPU's slices (SLICE_LOGITS) and as the GPU runs it (GPU_SLICE_LOGITS).
  train   GPT-2 small (124M, 1024 context) training steps in bf16 autocast with fused AdamW and SDPA attention (the
          flash kernel in bf16), in one loop for both libraries: forward with the loss, backward, clip, AdamW step,
          zero_grad, the loss read every --log-every steps. gptkit's GPT and transformers' GPT2LMHeadModel, each
          eager and torch.compile'd, in interleaved rounds; then `gptkit train` itself (train.compile true) on the same
          shape and data. tokens/s and MFU against the peak above (6N + attention FLOPs, gptkit.accounting).
  attention  causal SDPA forward and backward at the training shape with each kernel alone (flash, cuDNN,
          memory-efficient): `gptkit train` puts cuDNN first on Hopper (gptkit.devices.attention_backends).
  profile torch.profiler over 5 steps of gptkit's fastest training loop (compiled where compiled): device time by
          kind of kernel (matmul, attention, compiled fused, optimizer, other), the top kernels, the idle share.
  decode  batch 1 and 8, bf16 weights, --new-tokens greedy tokens after a --prompt-len prompt: gptkit's complete()
          eager and compiled (each step a CUDA graph) against transformers' generate, in interleaved rounds; whether
          row 0's tokens are the same.
  lora    one LoRA step (rank 16 on attention and MLP, bf16 autocast) of gptkit's GPT against transformers + PEFT.
  muon    `gptkit train` of nanoGPT's GPU Shakespeare recipe (configs/shakespeare-char.yaml, the bundled corpus)
          with optim.name adamw, then muon, --muon-steps each: validation loss at equal steps and equal wall time.
GPT-2's vocabulary is padded to --vocab-multiple (default 64: 50,304 rows) in gptkit's model, as nanoGPT does; the
padded rows are never scored (MFU counts the real vocabulary's FLOPs). transformers' model keeps 50,257.

Every figure is the median over timed windows of --log-every steps (or one generation), each window from one device
sync to the next on the host clock, after warm-up (which holds the compile). --budget-s bounds the whole run: what
does not fit is skipped and says so.

    python benchmarks/bench_gpu.py --out gpu-out                     # everything, about 5 minutes on an H100/H200
    python benchmarks/bench_gpu.py --parts train --batch 32 --out gpu-out
    python benchmarks/bench_gpu.py --parts env attention train profile muon --loops "gptkit compiled,hf compiled"
    python benchmarks/bench_gpu.py --device cpu --preset tiny --block 64 --batch 2 --steps 2 --warmup 1 \\
        --no-compile --new-tokens 4 --prompt-len 8 --batch-sizes 1 --out /tmp/smoke   # a smoke run on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_finetune import gptkit_model as lora_gptkit_model  # noqa: E402
from bench_finetune import hf_model as lora_hf_model  # noqa: E402
from bench_train import hf_model as train_hf_model  # noqa: E402
from bench_train import write_data  # noqa: E402
from gpu_parts import gpu_parts_markdown, median_seconds, part_attention, part_muon, profile_step, sync  # noqa: E402

from gptkit import loss as loss_module  # noqa: E402
from gptkit.accounting import training_flops_per_token  # noqa: E402
from gptkit.config import ModelConfig  # noqa: E402
from gptkit.devices import attention_backends, autocast_for, gpu_peak_flops, pick_device  # noqa: E402
from gptkit.model import GPT  # noqa: E402
from gptkit.optim import param_groups  # noqa: E402
from gptkit.run_sources import from_sources  # noqa: E402
from gptkit.train import train  # noqa: E402

PARTS = ("env", "attention", "loss", "train", "profile", "decode", "lora", "muon")
LOOPS = ("gptkit eager", "hf eager", "gptkit compiled", "hf compiled")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Budget:
    """The run's time limit: each measurement asks first whether it still fits."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, seconds: float) -> bool:
        """Whether a measurement expected to take this long ends inside the budget."""
        return self.left() > seconds


def timed_windows(step: Callable[[], Tensor], warmup: int, steps: int, every: int) -> list[float]:
    """Seconds per step, one figure per window of `every` steps, each from one device sync to the next (reading the
    loss syncs, as `gptkit train` does at each logged step)."""
    for _ in range(warmup):
        loss = step()
    if warmup:
        loss.item()
    seconds = []
    for _ in range(max(1, steps // every)):
        start = time.perf_counter()
        for _ in range(every):
            loss = step()
        loss.item()
        seconds.append((time.perf_counter() - start) / every)
    return seconds


def training_step(
    model: torch.nn.Module, loss_of: Callable, batches: list[tuple[Tensor, Tensor]], device: torch.device, dtype: str
) -> Callable[[], Tensor]:
    """One update of the shared loop: forward with the loss, backward, clip, fused AdamW, zero_grad."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = param_groups(model, 0.1)
    optimizer = torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), fused=device.type in ("cuda", "cpu"))
    count = [0]

    def step() -> Tensor:
        x, y = batches[count[0] % len(batches)]
        count[0] += 1
        with autocast_for(device, dtype):
            loss = loss_of(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def gptkit_loss(model: torch.nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return model(x, targets=y)  # the LM head fused into the loss, as the trainer computes it


def hf_loss(model: torch.nn.Module, x: Tensor, y: Tensor) -> Tensor:
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


def peft_loss(model: torch.nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return model(input_ids=x, labels=x).loss  # transformers shifts the labels itself


def summary(seconds: list[float], tokens_per_step: int, flops_per_token: int | None, peak: float | None) -> dict:
    """Median seconds per step, tokens/s and MFU (None without a peak) of a list of per-step timings."""
    median = statistics.median(seconds)
    tokens_per_s = tokens_per_step / median
    mfu = tokens_per_s * flops_per_token / peak if peak and flops_per_token else None
    return {"ms_per_step": 1000 * median, "tokens_per_s": tokens_per_s, "mfu": mfu, "windows": len(seconds)}


# ----- the parts -----


def part_env(args: argparse.Namespace, device: torch.device, report: dict) -> None:
    """The device, its peak and two measured ceilings."""
    import transformers

    env: dict[str, Any] = {"device": str(device), "torch": torch.__version__, "transformers": transformers.__version__}
    dtype = getattr(torch, args.dtype)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=torch.cuda.get_device_name(device),
            memory_gb=props.total_memory / 1e9,
            multiprocessors=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
        )
        n = 8192
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        env["matmul_flops"] = 2 * n**3 / median_seconds(lambda: a @ b, device, 10)
        x = torch.empty(1 << 29, device=device, dtype=torch.float16)  # 1 GiB
        y = torch.empty_like(x)
        env["copy_bytes_per_s"] = 2 * x.numel() * 2 / median_seconds(lambda: y.copy_(x), device, 10)
        del a, b, x, y
    else:
        from gptkit.devices import measured_cpu_matmul_flops

        env["matmul_flops"] = measured_cpu_matmul_flops(dtype)
    env["datasheet_peak_flops"] = gpu_peak_flops(device, dtype)
    report["env"] = env


def part_loss(args: argparse.Namespace, device: torch.device, report: dict, config: ModelConfig) -> None:
    """The fused head + loss, forward and backward, in the CPU's slices and in the GPU's."""
    rows = args.batch * args.block
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, config.n_embd, generator=gen).to(device).requires_grad_()
    weight = (0.02 * torch.randn(config.vocab_size, config.n_embd, generator=gen)).to(device).requires_grad_()
    targets = torch.randint(0, config.vocab_size, (rows,), generator=gen).to(device)

    def run() -> None:
        with autocast_for(device, args.dtype):
            loss = loss_module.linear_cross_entropy(hidden, weight, None, targets)
        loss.backward()
        hidden.grad = weight.grad = None

    result = {"rows": rows, "vocab_size": config.vocab_size}
    saved = loss_module.SLICE_LOGITS, loss_module.GPU_SLICE_LOGITS
    for name, size in (("cpu_slices", saved[0]), ("gpu_slices", saved[1])):
        loss_module.SLICE_LOGITS = loss_module.GPU_SLICE_LOGITS = size  # on whichever device this runs
        try:
            result[f"{name}_ms"] = 1000 * median_seconds(run, device, 5)
        finally:
            loss_module.SLICE_LOGITS, loss_module.GPU_SLICE_LOGITS = saved
        result[f"{name}_rows_per_slice"] = min(rows, max(1, size // config.vocab_size))
    report["loss"] = result


def random_batches(config: ModelConfig, args: argparse.Namespace, device: torch.device, count: int = 4) -> list:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (count, args.batch, args.block + 1), generator=gen)
    return [(row[:, :-1].to(device), row[:, 1:].to(device)) for row in ids]


def part_train(
    args: argparse.Namespace,
    device: torch.device,
    report: dict,
    config: ModelConfig,
    budget: Budget,
    peak: float | None,
) -> None:
    """gptkit and transformers in one training loop, eager and compiled, then `gptkit train` itself."""
    result: dict[str, Any] = {
        "batch_size": args.batch,
        "block_size": args.block,
        "dtype": args.dtype,
        "peak_flops": peak,
        "loops": {},
        "skipped": [],
    }
    report["train"] = result
    batches = random_batches(config, args, device)
    torch.manual_seed(0)
    gptkit = GPT(config).to(device).train()
    gptkit.check_inputs = False  # as the trainer runs it: no per-step host sync
    hf = train_hf_model(config, args.block).to(device) if any(name.startswith("hf") for name in args.loops) else None
    flops = training_flops_per_token(config)  # both models have GPT-2's biases: the same FLOPs
    variants = {"gptkit eager": (gptkit, gptkit_loss), "hf eager": (hf, hf_loss)}
    if args.compile:
        variants["gptkit compiled"] = (torch.compile(gptkit), gptkit_loss)
        variants["hf compiled"] = (torch.compile(hf) if hf is not None else None, hf_loss)
    variants = {name: variant for name, variant in variants.items() if name in args.loops}
    steps = {
        name: training_step(model, loss_of, batches, device, args.dtype) for name, (model, loss_of) in variants.items()
    }
    windows: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(args.rounds):  # interleaved: each variant once per round
        for name, step in steps.items():
            if "error" in result["loops"].get(name, {}):
                continue
            first = round_index == 0
            need = 120 if first and "compiled" in name else 15
            if not budget.allows(need):
                result["skipped"].append(f"{name} round {round_index + 1} (time budget)")
                continue
            log(f"train: {name}, round {round_index + 1}")
            try:
                windows[name] += timed_windows(step, args.warmup if first else 1, args.steps, args.log_every)
            except Exception as err:  # noqa: BLE001 - one variant's failure is reported, the others still run
                result["loops"][name] = {"error": f"{type(err).__name__}: {err}"}
                log(traceback.format_exc())
    tokens = args.batch * args.block
    for name, seconds in windows.items():
        if seconds and "error" not in result["loops"].get(name, {}):
            result["loops"][name] = summary(seconds, tokens, flops, peak)
    loops = result["loops"]
    for mode in ("eager", "compiled"):
        ours, theirs = loops.get(f"gptkit {mode}", {}), loops.get(f"hf {mode}", {})
        if "tokens_per_s" in ours and "tokens_per_s" in theirs:
            result[f"gptkit_over_hf_{mode}"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
    if "tokens_per_s" in loops.get("gptkit compiled", {}) and "tokens_per_s" in loops.get("hf eager", {}):
        compiled, eager = loops["gptkit compiled"]["tokens_per_s"], loops["hf eager"]["tokens_per_s"]
        result["gptkit_compiled_over_hf_eager"] = compiled / eager
    if "profile" in args.parts and budget.allows(30):
        fastest = next(
            (
                name
                for name in ("gptkit compiled", "gptkit eager")
                if name in steps and "error" not in result["loops"].get(name, {"error": 1})
            ),
            None,
        )
        if fastest is not None:
            log(f"profile: {fastest}")
            report["profile"] = {"loop": fastest, **profile_step(steps[fastest], device)}
    del gptkit, hf, variants, steps
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.trainer and budget.allows(150):
        log("train: gptkit train (train.compile true)")
        try:
            result["gptkit train"] = trainer_run(args, device, config, peak)
        except Exception as err:  # noqa: BLE001
            result["gptkit train"] = {"error": f"{type(err).__name__}: {err}"}
            log(traceback.format_exc())
    elif args.trainer:
        result["skipped"].append("gptkit train (time budget)")


def trainer_run(args: argparse.Namespace, device: torch.device, config: ModelConfig, peak: float | None) -> dict:
    """`gptkit train` on random tokens of the same shape: its own logged tokens/s after warm-up."""
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        data.mkdir()
        write_data(data, config.vocab_size, max(1_000_000, 8 * args.batch * args.block))
        out = Path(tmp) / "run"
        warmup = max(args.log_every, -(-args.warmup // args.log_every) * args.log_every)  # whole windows
        overrides = {
            "model": {**config.to_dict()},
            "optim": {"lr": 6e-4, "warmup_steps": 0},
            "train": {
                "data_dir": str(data),
                "out_dir": str(out),
                "max_steps": warmup + args.steps,
                "batch_size": args.batch,
                "eval_iters": 1,
                "eval_interval": 10**9,
                "eval_at_start": False,
                "checkpoint_interval": 10**9,
                "log_interval": args.log_every,
                "device": device.type,
                "dtype": args.dtype,
                "compile": args.compile,
                "plot": False,
                "peak_flops": peak,
            },
        }
        start = time.perf_counter()
        train(from_sources(None, overrides), progress=False)
        wall = time.perf_counter() - start
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r and r["step"] > warmup]
    seconds = [args.batch * args.block / rate for rate in rates]
    figures = summary(seconds, args.batch * args.block, training_flops_per_token(config), peak)
    return {**figures, "wall_s_with_compile_eval_and_checkpoint": wall, "steps": warmup + args.steps}


def part_decode(args: argparse.Namespace, device: torch.device, report: dict, budget: Budget) -> None:
    """Greedy decoding at each batch size: gptkit eager and compiled against transformers' generate."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from gptkit.decoding.api import complete
    from gptkit.decoding.options import DecodeOptions
    from gptkit.decoding.sampling import SamplingParams
    from gptkit.formats.hf import gpt_from_hf_model

    preset = ModelConfig.preset(args.preset)
    torch.manual_seed(0)
    last = preset.vocab_size - 1  # GPT-2's end-of-text id, within any vocabulary
    hf_config = GPT2Config(
        vocab_size=preset.vocab_size,
        n_positions=preset.block_size,
        n_embd=preset.n_embd,
        n_layer=preset.n_layer,
        n_head=preset.n_head,
        bos_token_id=last,
        eos_token_id=last,
    )
    dtype = getattr(torch, args.decode_dtype)
    hf = GPT2LMHeadModel(hf_config).eval().to(device, dtype)
    hf.generation_config.eos_token_id = None  # random weights: every row runs to max_new_tokens
    hf.generation_config.pad_token_id = 0
    ours = gpt_from_hf_model(hf).eval()
    result: dict[str, Any] = {
        "dtype": args.decode_dtype,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "batches": {},
        "skipped": [],
    }
    report["decode"] = result
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0)

    def hf_rate(ids: Tensor) -> tuple[float, list[int]]:
        """Decode tokens/s of generate: its time for every new token less its time for the first (the prefill)."""
        mask = torch.ones_like(ids)
        with torch.no_grad():
            start = time.perf_counter()
            hf.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
            sync(device)
            one = time.perf_counter() - start
            start = time.perf_counter()
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False)
            sync(device)
            full = time.perf_counter() - start
        return ids.size(0) * (args.new_tokens - 1) / max(full - one, 1e-9), out[0, ids.size(1) :].tolist()

    def ours_rate(ids: Tensor, compile: bool) -> tuple[float, list[int], float | None]:
        timing_result = complete(ours, ids.tolist(), params, options=DecodeOptions(compile=compile))
        timing = timing_result.timing
        return timing.decode_tokens / timing.decode_seconds, timing_result.completions[0][0].ids, timing.compile_seconds

    for batch in args.batch_sizes:
        ids = torch.randint(0, preset.vocab_size, (batch, args.prompt_len), generator=gen).to(device)
        modes = ["hf generate", "gptkit eager"] + (["gptkit compiled"] if args.compile else [])
        rates: dict[str, list[float]] = {mode: [] for mode in modes}
        tokens: dict[str, list[int]] = {}
        row: dict[str, Any] = {}
        for round_index in range(args.rounds):
            for mode in modes:
                need = 90 if mode == "gptkit compiled" and round_index == 0 else 10
                if not budget.allows(need):
                    result["skipped"].append(f"batch {batch} {mode} round {round_index + 1} (time budget)")
                    continue
                log(f"decode: batch {batch}, {mode}, round {round_index + 1}")
                try:
                    if mode == "hf generate":
                        rate, tokens[mode] = hf_rate(ids)
                    else:
                        rate, tokens[mode], compile_s = ours_rate(ids, mode == "gptkit compiled")
                        if compile_s is not None and round_index == 0:
                            row["compile_seconds"] = compile_s
                    rates[mode].append(rate)
                except Exception as err:  # noqa: BLE001
                    row[f"{mode} error"] = f"{type(err).__name__}: {err}"
                    log(traceback.format_exc())
        for mode, values in rates.items():
            if values:
                row[mode] = statistics.median(values)
        for mode in modes[1:]:
            if mode in row and "hf generate" in row:
                row[f"{mode} over hf"] = row[mode] / row["hf generate"]
        if "hf generate" in tokens and "gptkit eager" in tokens:
            row["same_tokens_as_hf"] = tokens["gptkit eager"] == tokens["hf generate"]
        result["batches"][str(batch)] = row


def part_lora(args: argparse.Namespace, device: torch.device, report: dict, budget: Budget) -> None:
    """One LoRA update of gptkit against transformers + PEFT, in the shared loop, eager."""
    config = ModelConfig.preset(args.preset)
    config = ModelConfig(**{**config.to_dict(), "block_size": args.block})
    torch.manual_seed(0)
    gptkit = lora_gptkit_model(config, "lora", "float32", args.lora_rank).to(device)
    peft = lora_hf_model(config, args.lora_rank).to(device)
    batches = random_batches(config, args, device)
    steps = {
        "gptkit lora": training_step(gptkit, gptkit_loss, batches, device, args.dtype),
        "hf+peft lora": training_step(peft, peft_loss, batches, device, args.dtype),
    }
    windows: dict[str, list[float]] = {name: [] for name in steps}
    result: dict[str, Any] = {
        "rank": args.lora_rank,
        "batch_size": args.batch,
        "block_size": args.block,
        "dtype": args.dtype,
        "loops": {},
        "skipped": [],
    }
    report["lora"] = result
    for round_index in range(args.rounds):
        for name, step in steps.items():
            if not budget.allows(15):
                result["skipped"].append(f"{name} round {round_index + 1} (time budget)")
                continue
            log(f"lora: {name}, round {round_index + 1}")
            windows[name] += timed_windows(step, args.warmup if round_index == 0 else 1, args.steps, args.log_every)
    trainable = {"gptkit lora": gptkit, "hf+peft lora": peft}
    for name, seconds in windows.items():
        if seconds:
            figures = summary(seconds, args.batch * args.block, None, None)
            figures["trainable_params"] = sum(p.numel() for p in trainable[name].parameters() if p.requires_grad)
            result["loops"][name] = figures
    ours, theirs = result["loops"].get("gptkit lora"), result["loops"].get("hf+peft lora")
    if ours and theirs:
        result["gptkit_over_peft"] = ours["tokens_per_s"] / theirs["tokens_per_s"]


# ----- the report -----


def markdown(report: dict) -> str:
    """The report as markdown tables."""
    lines = []
    env = report.get("env", {})
    if env:
        gpu = env.get("gpu", env["device"])
        peak = env.get("datasheet_peak_flops")
        lines.append(
            f"**{gpu}**, torch {env['torch']}, transformers {env['transformers']}; measured: matmul "
            f"{env['matmul_flops'] / 1e12:.3g} TFLOP/s"
            + (f", copy {env['copy_bytes_per_s'] / 1e12:.2f} TB/s" if "copy_bytes_per_s" in env else "")
            + (f"; datasheet dense peak {peak / 1e12:.0f} TFLOP/s" if peak else "")
        )
        lines.append("")
    if "loss" in report:
        r = report["loss"]
        lines.append(
            f"LM head + loss, forward and backward, {r['rows']} rows x {r['vocab_size']} logits: in slices of "
            f"{r['cpu_slices_rows_per_slice']} rows (the CPU's) {r['cpu_slices_ms']:.1f} ms, of "
            f"{r['gpu_slices_rows_per_slice']} rows (the GPU's) {r['gpu_slices_ms']:.1f} ms"
        )
        lines.append("")
    if "train" in report:
        r = report["train"]
        lines.append(
            f"Training, {r['batch_size']} x {r['block_size']} tokens per step, {r['dtype']} autocast, fused "
            "AdamW, SDPA attention (one loop for both libraries; `gptkit train` its own loop):"
        )
        lines += ["", "| loop | ms/step | tokens/s | MFU |", "|---|---|---|---|"]
        loops = dict(r["loops"])
        if "gptkit train" in r:
            loops["`gptkit train`"] = r["gptkit train"]
        for name, s in loops.items():
            if "error" in s:
                lines.append(f"| {name} | failed: {s['error'][:120]} | | |")
                continue
            mfu = f"{100 * s['mfu']:.1f}%" if s.get("mfu") else "-"
            lines.append(f"| {name} | {s['ms_per_step']:.1f} | {s['tokens_per_s']:,.0f} | {mfu} |")
        ratios = [f"{key.replace('_', ' ')} {value:.2f}x" for key, value in r.items() if key.startswith("gptkit_")]
        lines += ["", "; ".join(ratios) if ratios else ""]
    if "decode" in report:
        r = report["decode"]
        lines.append(
            f"Decoding, {r['dtype']} weights, {r['prompt_len']}-token prompt, {r['new_tokens']} new tokens, "
            "greedy (tokens/s over all rows):"
        )
        lines += [
            "",
            "| batch | HF generate | gptkit eager | gptkit compiled | compiled / HF | same tokens |",
            "|---|---|---|---|---|---|",
        ]
        for batch, row in r["batches"].items():
            cell = lambda key: f"{row[key]:,.0f}" if key in row else "-"  # noqa: E731
            ratio = f"{row['gptkit compiled over hf']:.2f}x" if "gptkit compiled over hf" in row else "-"
            lines.append(
                f"| {batch} | {cell('hf generate')} | {cell('gptkit eager')} | {cell('gptkit compiled')} | "
                f"{ratio} | {row.get('same_tokens_as_hf', '-')} |"
            )
        lines.append("")
    if "lora" in report:
        r = report["lora"]
        lines.append(
            f"LoRA rank {r['rank']} on attention and MLP, {r['batch_size']} x {r['block_size']} tokens, "
            f"{r['dtype']} autocast, eager:"
        )
        lines += ["", "| loop | ms/step | tokens/s | trainable |", "|---|---|---|---|"]
        for name, s in r["loops"].items():
            lines.append(f"| {name} | {s['ms_per_step']:.1f} | {s['tokens_per_s']:,.0f} | {s['trainable_params']:,} |")
        if "gptkit_over_peft" in r:
            lines += ["", f"gptkit over PEFT: {r['gptkit_over_peft']:.2f}x"]
        lines.append("")
    lines += gpu_parts_markdown(report)
    skipped = [s for part in report.values() if isinstance(part, dict) for s in part.get("skipped", [])]
    errors = {k: v for k, v in report.get("errors", {}).items()}
    if skipped:
        lines.append("Skipped: " + "; ".join(skipped))
    for part, message in errors.items():
        lines.append(f"Part {part} failed: {message}")
    return "\n".join(lines) + "\n"


def write(report: dict, out: Path | None) -> None:
    if out is not None:
        (out / "bench_gpu.json").write_text(json.dumps(report, indent=1))
        (out / "bench_gpu.md").write_text(markdown(report))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--device", default="auto", help="cuda (what this is for), cpu (smoke runs) or auto")
    parser.add_argument("--out", help="directory for bench_gpu.json and bench_gpu.md (written after each part)")
    parser.add_argument("--preset", default="gpt2", help="the model shape (GPT-2 small by default)")
    parser.add_argument("--block", type=int, default=1024, help="training context (default 1024)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per training step (default 16)")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32"),
        help="training autocast dtype (default bfloat16)",
    )
    parser.add_argument("--steps", type=int, default=20, help="timed training steps per round (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first, the compile among them")
    parser.add_argument("--log-every", type=int, default=5, help="steps per timed window (default 5)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every variant (default 2)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="eager variants only")
    parser.add_argument("--no-trainer", dest="trainer", action="store_false", help="skip the `gptkit train` run")
    parser.add_argument(
        "--loops", default=",".join(LOOPS), help=f"the training loops to time (default {','.join(LOOPS)})"
    )
    parser.add_argument("--decode-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--batch-sizes", default="1,8", help="decoding batch sizes (default 1,8)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--vocab-multiple", type=int, default=64, help="pad gptkit's vocabulary to a multiple of this")
    parser.add_argument("--muon-steps", type=int, default=1000, help="training steps of each muon-part run")
    parser.add_argument("--peak-flops", type=float, help="peak FLOP/s for MFU (default: the GPU's datasheet figure)")
    parser.add_argument("--budget-s", type=float, default=330, help="stop starting measurements after this long")
    parser.add_argument("--json", action="store_true", help="print the JSON report (else the markdown)")
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.loops = args.loops.split(",")
    if set(args.loops) - set(LOOPS):
        parser.error(f"--loops takes names from {','.join(LOOPS)}")
    device = pick_device(args.device)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_s)
    config = ModelConfig(
        **{
            **ModelConfig.preset(args.preset).to_dict(),
            "block_size": args.block,
            "dropout": 0.0,
            "vocab_multiple": args.vocab_multiple,
        }
    )
    peak = args.peak_flops or gpu_peak_flops(device, getattr(torch, args.dtype))
    report: dict[str, Any] = {"errors": {}}
    with attention_backends(device):  # every loop, HF's too, with the attention kernels `gptkit train` prefers
        run_parts(args, device, report, config, budget, peak, out)
    print(json.dumps(report, indent=1) if args.json else markdown(report))
    return 1 if report["errors"] else 0


def run_parts(
    args: argparse.Namespace,
    device: torch.device,
    report: dict,
    config: ModelConfig,
    budget: Budget,
    peak: float | None,
    out: Path | None,
) -> None:
    """Each part of --parts in turn, its report written as it ends; a part that fails is reported, the next runs."""
    for part in args.parts:
        log(f"== {part} ({budget.left():.0f} s left)")
        try:
            if part == "env":
                part_env(args, device, report)
                peak = peak or report["env"]["matmul_flops"]  # no datasheet figure: the measured matmul rate
            elif part == "loss":
                part_loss(args, device, report, config)
            elif part == "train":
                part_train(args, device, report, config, budget, peak)
            elif part == "attention":
                part_attention(args, device, report, config)
            elif part == "profile":
                continue  # taken inside the train part, on its compiled step
            elif part == "muon":
                part_muon(args, device, report)
            elif part == "decode":
                part_decode(args, device, report, budget)
            elif part == "lora":
                part_lora(args, device, report, budget)
        except Exception as err:  # noqa: BLE001 - a part that fails is reported; the next part still runs
            report["errors"][part] = f"{type(err).__name__}: {err}"
            log(traceback.format_exc())
        if device.type == "cuda":
            torch.cuda.empty_cache()
        write(report, out)


if __name__ == "__main__":
    raise SystemExit(main())
