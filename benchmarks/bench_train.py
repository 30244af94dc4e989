"""Training speed: `gptkit train`'s loop against Hugging Face GPT2LMHeadModel + AdamW, on the same shapes and batches.

For each shape it reports ms per step, tokens/s and MFU (training FLOPs per token from gptkit.accounting over the
device's peak) for:
  gptkit   the real trainer (gptkit.train.train: loader, fused AdamW, clipping, fault counters, metrics), with
           evaluation and checkpoints outside the timed steps;
  hf       transformers' GPT2LMHeadModel in a plain loop: forward, cross-entropy, backward, clip, AdamW (fused,
           decay on matrices), loss.item() every step.
Shapes: `cpu-recipe` is configs/shakespeare-char-cpu.yaml's model and batch (4 layers, 128 wide, block 64, batch 12,
vocab 65); `gpt2-small` is GPT-2 small's model (12 layers, 768 wide, vocab 50257) with a batch you choose (the
full 12 x 1024 takes about a minute per step on a 2-core CPU). HF's GPT-2 always has biases and nanoGPT's recipe
none, so the HF model has slightly more parameters; MFU counts each model's own FLOPs.

Three more parts (issue 9), each optional:
  --breakdown  the cpu-recipe step of gptkit's model (eager, and compiled with --compile; its loss as the trainer
               computes it, model(ids, targets=...)) and HF's (logits, then cross-entropy) in one plain loop,
               split by torch.profiler into matrix products, attention, the optimiser phase and the rest; and the
               optimiser phase alone with PyTorch's fused, foreach and compiled AdamW.
  --speedrun   the CPU speed run: wall time of the whole `gptkit train --config configs/shakespeare-char-cpu-muon.yaml`
               command (the record; then configs/shakespeare-char-cpu-fast.yaml, the AdamW one) on the bundled corpus (char tokenizer, `gptkit prepare`'s validation split), its final
               validation loss, and the same model scored by `gptkit eval` over every token of val.bin, against
               the target 1.8857 (nanoGPT's CPU recipe); --speedrun-baseline also times
               configs/shakespeare-char-cpu.yaml (nanoGPT's recipe in gptkit), and --nanogpt NANOGPT nanoGPT's own
               train.py on its README's CPU command (benchmarks/nanogpt_peer.py), both in the same rounds.
  --ddp        data-parallel throughput of a ~20M-parameter model under torchrun: tokens/s of 1 process x 1 thread,
               1 process x all threads, and N processes x 1 thread (the same per-process batch).

    python benchmarks/bench_train.py                       # both shapes, default step counts
    python benchmarks/bench_train.py --steps 5 --gpt2-steps 1 --warmup 1   # a quick smoke run
    python benchmarks/bench_train.py --shapes --speedrun --ddp --json       # only the speed run and DDP
    python benchmarks/bench_train.py --shapes --speedrun --speedrun-baseline --nanogpt NANOGPT   # and the peers
    python benchmarks/bench_train.py --shapes cpu-recipe --compile          # also gptkit with train.compile
    python benchmarks/bench_train.py --shapes --breakdown --compile         # where the recipe step's time goes
Run it on a quiet machine: timings share the CPU with everything else running.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptkit.accounting import training_flops_per_token
from gptkit.config import PRESETS, ModelConfig
from gptkit.devices import measured_cpu_matmul_flops
from gptkit.loss import next_token_loss
from gptkit.model import GPT
from gptkit.native import library
from gptkit.run_sources import from_sources
from gptkit.train import train

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nanogpt_peer  # noqa: E402

SHAPES = {
    "cpu-recipe": dict(preset="shakespeare-char-cpu", overrides={"dropout": 0.0}, batch_size=12, block_size=64),
    "gpt2-small": dict(preset="gpt2", overrides={}, batch_size=2, block_size=1024),
}


def write_data(directory: Path, vocab_size: int, tokens: int, seed: int = 0) -> None:
    """A data directory of random tokens in gptkit's format (speed does not depend on the text)."""
    rng = np.random.default_rng(seed)
    dtype = "uint16" if vocab_size <= 65536 else "uint32"
    for name, count in (("train", tokens), ("val", tokens // 10)):
        rng.integers(0, vocab_size, size=count, dtype=np.int64).astype(dtype).tofile(directory / f"{name}.bin")
    meta = {
        "vocab_size": vocab_size,
        "dtype": dtype,
        "train_tokens": tokens,
        "val_tokens": tokens // 10,
        "tokenizer": "none",
    }
    (directory / "meta.json").write_text(json.dumps(meta))


def model_config(shape: dict, block_size: int) -> ModelConfig:
    return ModelConfig(**{**PRESETS[shape["preset"]], **shape["overrides"], "block_size": block_size})


def bench_gptkit(
    shape: dict, batch: int, block: int, steps: int, warmup: int, data: Path, out: Path, compile: bool = False
) -> list[float]:
    """Seconds per step of gptkit's trainer, from its own per-step metrics (log_interval 1)."""
    overrides = {
        "model": {"preset": shape["preset"], **shape["overrides"], "block_size": block},
        "optim": {"lr": 6e-4, "warmup_steps": 0},
        "train": {
            "data_dir": str(data),
            "out_dir": str(out),
            "max_steps": warmup + steps,
            "batch_size": batch,
            "eval_iters": 1,
            "eval_interval": 10**9,
            "checkpoint_interval": 10**9,
            "log_interval": 1,
            "keep_checkpoints": 1,
            "device": "cpu",
            "plot": False,
            "compile": compile,
        },
    }
    train(from_sources(None, overrides), progress=False)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "tokens_per_s" in r][warmup:]
    return [batch * block / r["tokens_per_s"] for r in timed]


def hf_model(config: ModelConfig, block: int) -> torch.nn.Module:
    """transformers' GPT2LMHeadModel of config's shape (always with biases), in training mode, SDPA attention."""
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_config = GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=block,
        n_embd=config.n_embd,
        n_layer=config.n_layer,
        n_head=config.n_head,
        activation_function="gelu" if config.activation == "gelu" else "gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(hf_config).train()
    model.config._attn_implementation = "sdpa"
    return model


def hf_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    from gptkit.optim import param_groups

    return torch.optim.AdamW(param_groups(model, 0.1), lr=6e-4, betas=(0.9, 0.99), fused=True)


def bench_hf(
    config: ModelConfig, batch: int, block: int, steps: int, warmup: int, data: Path
) -> tuple[list[float], int]:
    """Seconds per step of a plain HF GPT2LMHeadModel + fused AdamW loop, and the model's FLOPs per token."""
    from gptkit.data import TrainBatches, load_tokens

    model = hf_model(config, block)
    optimizer = hf_optimizer(model)
    meta = json.loads((data / "meta.json").read_text())
    batches = TrainBatches(load_tokens(data / "train.bin", meta.dtype), block, batch, seed=0)
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        x, y = batches.next_batch()
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    hf_gptkit_like = ModelConfig(
        vocab_size=config.vocab_size,
        block_size=block,
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_embd=config.n_embd,
    )  # biases on, like HF's GPT-2
    return times, training_flops_per_token(hf_gptkit_like)


# Exact aten op names (the CPU kernels PyTorch 2.13 dispatches to) for the breakdown's two largest parts.
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm"}
ATTENTION_OPS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
}


def step_breakdown(
    loss_of: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, steps: int
) -> dict:
    """ms per step of one plain loop (loss_of(x, y), backward, clip, AdamW) split by torch.profiler into matrix
    products, attention, the optimiser phase (clip, step, zero_grad) and the rest (other kernels, autograd,
    Python), all under the profiler's own overhead."""
    from torch.profiler import ProfilerActivity, profile, record_function

    params = list(model.parameters())

    def step() -> torch.Tensor:
        loss = loss_of(x, y)
        loss.backward()
        with record_function("optimizer phase"):
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss

    for _ in range(3):  # compiles, if forward is compiled
        step().item()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            loss = step()
        loss.item()
        total = (time.perf_counter() - start) / steps
    events = prof.key_averages()
    matmul = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS) / 1e6 / steps
    attention = sum(e.self_cpu_time_total for e in events if e.key in ATTENTION_OPS) / 1e6 / steps
    optim = sum(e.cpu_time_total for e in events if e.key == "optimizer phase") / 1e6 / steps
    parts = {
        "total": total,
        "matmul": matmul,
        "attention": attention,
        "optimizer": optim,
        "rest": total - matmul - attention - optim,
    }
    return {name: 1000 * seconds for name, seconds in parts.items()}


def optimizer_phase_ms(model: torch.nn.Module, variant: str, repeats: int) -> float:
    """Median ms of clip + AdamW step + zero_grad over model's parameters with random gradients: PyTorch's fused
    AdamW (what gptkit uses where it exists), the foreach one, or the plain one's step under torch.compile."""
    from gptkit.optim import param_groups

    params = list(model.parameters())
    grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 1e-3 for i, p in enumerate(params)]
    if variant == "compiled":  # a tensor lr, so that changing it does not recompile
        optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=torch.tensor(6e-4), betas=(0.9, 0.99))
        step = torch.compile(optimizer.step)
    else:
        optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=6e-4, betas=(0.9, 0.99), **{variant: True})
        step = optimizer.step
    times = []
    for _ in range(5 + repeats):
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        start = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[5:])


def bench_breakdown(shape: dict, batch: int, block: int, steps: int, compile: bool) -> dict:
    """step_breakdown of gptkit's model (eager, and compiled if asked) and HF's in the same loop on one batch."""
    from gptkit.optim import make_optimizer
    from gptkit.train_config import OptimConfig

    config = model_config(shape, block)
    x = torch.randint(0, config.vocab_size, (batch, block), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, config.vocab_size, (batch, block), generator=torch.Generator().manual_seed(1))
    result = {}
    for loop in ("gptkit", "gptkit-compiled") if compile else ("gptkit",):
        torch.manual_seed(0)
        model = GPT(config).train()
        model.check_inputs = False  # as the trainer runs it
        forward = torch.compile(model) if loop == "gptkit-compiled" else model
        result[loop] = step_breakdown(
            lambda ids, targets: forward(ids, targets=targets),
            model,
            make_optimizer(model, OptimConfig())[0],
            x,
            y,
            steps,
        )  # as the trainer runs it
    hf = hf_model(config, block)
    result["hf"] = step_breakdown(
        lambda ids, targets: next_token_loss(hf(input_ids=ids).logits, targets), hf, hf_optimizer(hf), x, y, steps
    )
    result["optimizer_phase_ms"] = {
        variant: optimizer_phase_ms(GPT(config), variant, repeats=10 * steps)
        for variant in ("fused", "foreach", "compiled")
    }
    return result


REPO = Path(__file__).resolve().parents[1]
RECORD_CONFIG = REPO / "configs" / "shakespeare-char-cpu-muon.yaml"
SPEEDRUN_CONFIG = REPO / "configs" / "shakespeare-char-cpu-fast.yaml"
BASELINE_CONFIG = REPO / "configs" / "shakespeare-char-cpu.yaml"
TARGET_VAL_LOSS = 1.8857  # nanoGPT's README CPU recipe ends here (configs/shakespeare-char-cpu.yaml)
GPTKIT = [sys.executable, "-m", "gptkit"]


def timed_train(config: Path, data: Path, out: Path, steps: int | None = None) -> dict:
    """Wall time of a whole `gptkit train` command (start-up included), its last val loss and a full val.bin score.

    steps (for smoke runs only) cuts the recipe short.
    """
    short = [f"--{key}={steps}" for key in ("train.max_steps", "train.eval_interval", "optim.decay_steps")]
    start = time.perf_counter()
    subprocess.run(
        [
            *GPTKIT,
            "train",
            "--config",
            str(config),
            "--data",
            str(data),
            "--out",
            str(out),
            "--quiet",
            *(short if steps else []),
        ],
        check=True,
    )
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if r.get("val_loss") is not None]
    checkpoint = out / (out / "latest").read_text().strip()
    block = json.loads((checkpoint / "config.json").read_text())["model"]["block_size"]
    scored = subprocess.run(
        [*GPTKIT, "eval", str(checkpoint), "--data", str(data), "--stride", str(block), "--json", "--quiet"],
        check=True,
        capture_output=True,
        text=True,
    )
    full = json.loads(scored.stdout)
    return {
        "config": str(config.relative_to(REPO)),
        "wall_s": wall,
        "steps": records[-1]["step"],
        "val_loss": val[-1]["val_loss"],
        "val_loss_full_pass": full.get("loss"),
        "reached_target": full.get("loss", float("inf")) <= TARGET_VAL_LOSS,
        "time_to_target_s": _time_to_target(records, wall),
    }


def _time_to_target(records: list[dict], wall: float) -> float | None:
    """Training seconds until the first evaluation at or below the target (None if never)."""
    for r in records:
        if r.get("val_loss") is not None and r["val_loss"] <= TARGET_VAL_LOSS:
            return r.get("elapsed_s", 0.0)
    return None


def bench_speedrun(tmp: Path, baseline: bool, steps: int | None, rounds: int, nanogpt: Path | None = None) -> dict:
    """The record recipe and the fast one (and optionally nanoGPT's recipe, and nanoGPT's own train.py) from scratch
    on freshly prepared char data, in `rounds` interleaved rounds: each recipe's figures are those of its median-time
    round (runs are deterministic, so only the times differ), and the ratios are of the median times."""
    data = tmp / "shakespeare_char"
    subprocess.run([*GPTKIT, "prepare", "--out", str(data), "--tokenizer", "char"], check=True, capture_output=True)
    configs = {"record": RECORD_CONFIG, "fast": SPEEDRUN_CONFIG, **({"baseline": BASELINE_CONFIG} if baseline else {})}
    recipes = {key: functools.partial(timed_train, config, data, steps=steps) for key, config in configs.items()}
    if nanogpt is not None:
        recipes["nanogpt"] = functools.partial(
            nanogpt_peer.timed_run, nanogpt_peer.prepared_copy(nanogpt, tmp), steps=steps
        )
    runs: dict[str, list[dict]] = {key: [] for key in recipes}
    for round_index in range(rounds):
        for key, run in recipes.items():
            print(f"speed run: {key}, round {round_index + 1} of {rounds}", file=sys.stderr)
            runs[key].append(run(tmp / f"{key}-{round_index}"))
    result: dict[str, Any] = {"target_val_loss": TARGET_VAL_LOSS, "rounds": rounds}
    for key, results in runs.items():
        times = sorted(r["wall_s"] for r in results)
        median = statistics.median(times)
        result[key] = {**min(results, key=lambda r: abs(r["wall_s"] - median)), "wall_s": median, "wall_s_all": times}
    for reference in ("baseline", "nanogpt"):
        if reference in result:
            for key in ("record", "fast"):
                result[f"{key}_over_{reference}_time"] = result[key]["wall_s"] / result[reference]["wall_s"]
    return result


DDP_MODEL = {"n_layer": 6, "n_head": 8, "n_embd": 512, "block_size": 256, "dropout": 0.0}  # ~19M parameters


def bench_ddp(tmp: Path, processes: int, steps: int, batch: int) -> dict:
    """tokens/s (median of logged steps after the first) of 1 process x 1 thread, x all threads, N x 1 thread."""
    data = tmp / "ddp-data"
    data.mkdir()
    write_data(data, 65, 2_000_000)
    threads = os.cpu_count() or 1
    runs = {
        "1 process x 1 thread": (1, 1),
        f"1 process x {threads} threads": (1, threads),
        f"{processes} processes x 1 thread": (processes, 1),
    }
    flags = [f"--model.{k}={v}" for k, v in DDP_MODEL.items()] + [
        "--data",
        str(data),
        "--quiet",
        "--train.device=cpu",
        "--train.plot=false",
        f"--train.batch_size={batch}",
        f"--train.max_steps={steps + 1}",
        "--train.eval_iters=1",
        f"--train.eval_interval={10**9}",
        f"--train.checkpoint_interval={10**9}",
        "--train.log_interval=1",
        "--optim.warmup_steps=0",
    ]
    result: dict = {"model": DDP_MODEL, "batch_size_per_process": batch, "vocab_size": 65}
    for index, (name, (nproc, nthreads)) in enumerate(runs.items()):
        out = tmp / f"ddp-{index}"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        launch = (
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                str(nproc),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                "-m",
                "gptkit",
                "train",
            ]
            if nproc > 1
            else GPTKIT + ["train"]
        )
        env = {**os.environ, "OMP_NUM_THREADS": str(nthreads)}
        print(f"ddp: {name} ...", file=sys.stderr)
        subprocess.run([*launch, "--out", str(out), *flags], check=True, env=env)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]
        result[name] = statistics.median(rates)
    result["n_processes_over_1x1"] = result[f"{processes} processes x 1 thread"] / result["1 process x 1 thread"]
    result["n_processes_over_1_process"] = (
        result[f"{processes} processes x 1 thread"] / result[f"1 process x {threads} threads"]
    )
    return result


def summarise(seconds: list[float], tokens_per_step: int, flops_per_token: int, peak: float) -> dict:
    ms = 1000 * statistics.median(seconds)
    tokens_per_s = tokens_per_step / (ms / 1000)
    return {
        "ms_per_step": ms,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops_per_token / peak,
        "steps": len(seconds),
    }


def print_breakdown(breakdown: dict) -> None:
    parts = ("total", "matmul", "attention", "optimizer", "rest")
    print(
        "cpu-recipe step under torch.profiler, ms (optimizer = clip + AdamW + zero_grad; rest = other kernels, "
        "autograd, Python):"
    )
    print(f"  {'loop':<16}" + "".join(f"{part:>11}" for part in parts))
    loops = {loop: ms for loop, ms in breakdown.items() if loop != "optimizer_phase_ms"}
    for loop, ms in loops.items():
        print(f"  {loop:<16}" + "".join(f"{ms[part]:>11.1f}" for part in parts))
    best = min((ms for loop, ms in loops.items() if loop != "hf"), key=lambda ms: ms["total"])
    without = best["total"] - best["attention"] - best["optimizer"]
    print(
        f"  HF's step over gptkit's fastest: {breakdown['hf']['total'] / best['total']:.2f}x; with attention and "
        f"the optimiser free it would be {breakdown['hf']['total'] / without:.2f}x"
    )
    variants = ", ".join(f"{name} {ms:.2f}" for name, ms in breakdown["optimizer_phase_ms"].items())
    print(f"  optimiser phase alone (clip + AdamW + zero_grad, ms, no profiler): {variants}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--shapes",
        nargs="*",
        choices=list(SHAPES),
        default=list(SHAPES),
        help="throughput shapes against HF (none: skip that part)",
    )
    parser.add_argument("--steps", type=int, default=100, help="timed steps for cpu-recipe (default 100)")
    parser.add_argument("--gpt2-steps", type=int, default=3, help="timed steps for gpt2-small (default 3)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--gpt2-batch", type=int, default=SHAPES["gpt2-small"]["batch_size"])
    parser.add_argument("--gpt2-block", type=int, default=SHAPES["gpt2-small"]["block_size"])
    parser.add_argument(
        "--peak-flops",
        type=float,
        help="peak FLOP/s for MFU (default: this CPU's fp32 matmul, measured as the trainer does)",
    )
    parser.add_argument("--speedrun", action="store_true", help="time the CPU speed-run recipe end to end")
    parser.add_argument("--speedrun-baseline", action="store_true", help="also time nanoGPT's CPU recipe")
    parser.add_argument(
        "--nanogpt",
        type=Path,
        metavar="NANOGPT",
        help="a nanoGPT checkout: also time its own train.py on the README's CPU command in the speed run",
    )
    parser.add_argument("--speedrun-steps", type=int, help="cut the recipes to this many steps (smoke runs only)")
    parser.add_argument(
        "--speedrun-rounds",
        type=int,
        default=3,
        help="interleaved rounds of the recipes; the median time of each counts (default 3)",
    )
    parser.add_argument("--ddp", action="store_true", help="tokens/s of N processes vs 1 under torchrun")
    parser.add_argument("--ddp-processes", type=int, default=2)
    parser.add_argument("--ddp-steps", type=int, default=10, help="logged steps per DDP run (default 10)")
    parser.add_argument("--ddp-batch", type=int, default=8, help="sequences per process per step (default 8)")
    parser.add_argument("--compile", action="store_true", help="also time gptkit with train.compile (torch.compile)")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also split each loop's cpu-recipe step into matmul, attention, optimiser and the rest",
    )
    parser.add_argument("--breakdown-steps", type=int, default=30, help="profiled steps per loop (default 30)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.nanogpt is not None:
        if not args.speedrun:
            parser.error("--nanogpt times nanoGPT in the speed run: add --speedrun")
        nanogpt_peer.check_checkout(args.nanogpt)
    if args.peak_flops is None:
        args.peak_flops = measured_cpu_matmul_flops(torch.float32)

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes:
            shape = SHAPES[name]
            gpt2 = name == "gpt2-small"
            batch = args.gpt2_batch if gpt2 else shape["batch_size"]
            block = args.gpt2_block if gpt2 else shape["block_size"]
            steps = args.gpt2_steps if gpt2 else args.steps
            warmup = min(args.warmup, 1) if gpt2 else args.warmup
            config = model_config(shape, block)
            data = Path(tmp) / name
            data.mkdir()
            write_data(data, config.vocab_size, max(200_000, 4 * batch * block * (steps + warmup)))
            print(f"{name}: {steps} timed steps of {batch} x {block} tokens ...", file=sys.stderr)
            mine = bench_gptkit(shape, batch, block, steps, warmup, data, Path(tmp) / f"{name}-run")
            compiled = None
            if args.compile:
                print(f"{name}: the same with train.compile ...", file=sys.stderr)
                compiled = bench_gptkit(shape, batch, block, steps, warmup, data, Path(tmp) / f"{name}-compiled", True)
            hf_times, hf_flops = bench_hf(config, batch, block, steps, warmup, data)
            tokens = batch * block
            results[name] = {
                "batch_size": batch,
                "block_size": block,
                "gptkit": summarise(mine, tokens, training_flops_per_token(config), args.peak_flops),
                "hf": summarise(hf_times, tokens, hf_flops, args.peak_flops),
            }
            r = results[name]
            r["hf_over_gptkit_time"] = r["hf"]["ms_per_step"] / r["gptkit"]["ms_per_step"]
            if compiled:
                r["gptkit-compiled"] = summarise(compiled, tokens, training_flops_per_token(config), args.peak_flops)
                r["hf_over_gptkit_compiled_time"] = r["hf"]["ms_per_step"] / r["gptkit-compiled"]["ms_per_step"]
        breakdown = None
        if args.breakdown:
            print("breakdown: profiling the cpu-recipe step ...", file=sys.stderr)
            shape = SHAPES["cpu-recipe"]
            breakdown = bench_breakdown(
                shape, shape["batch_size"], shape["block_size"], args.breakdown_steps, args.compile
            )
        speedrun = (
            bench_speedrun(Path(tmp), args.speedrun_baseline, args.speedrun_steps, args.speedrun_rounds, args.nanogpt)
            if args.speedrun
            else None
        )
        ddp = bench_ddp(Path(tmp), args.ddp_processes, args.ddp_steps, args.ddp_batch) if args.ddp else None
    report = {
        "cpu": library.capability(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "peak_flops": args.peak_flops,
        "shapes": results,
        "breakdown": breakdown,
        "speedrun": speedrun,
        "ddp": ddp,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    threads = torch.get_num_threads()
    print(
        f"{report['cpu']}\ntorch {torch.__version__}, {threads} threads, MFU against "
        f"{args.peak_flops / 1e9:.0f} GFLOP/s"
    )
    print(f"{'shape':<12} {'loop':<15} {'ms/step':>9} {'tokens/s':>10} {'MFU':>6}   HF time / gptkit time")
    for name, r in results.items():
        for loop in ("gptkit", "gptkit-compiled", "hf"):
            if loop not in r:
                continue
            s = r[loop]
            ratio = f"   {r['hf_over_gptkit_time']:.2f}x" if loop == "hf" else ""
            if loop == "hf" and "gptkit-compiled" in r:
                ratio += f" ({r['hf_over_gptkit_compiled_time']:.2f}x compiled)"
            figures = f"{s['ms_per_step']:>9.1f} {s['tokens_per_s']:>10,.0f} {100 * s['mfu']:>5.1f}%"
            print(f"{name:<12} {loop:<15} {figures}{ratio}")
    if breakdown:
        print_breakdown(breakdown)
    if speedrun:
        print(f"speed run (target val loss {TARGET_VAL_LOSS}; median of {speedrun['rounds']} interleaved rounds):")
        for key in ("record", "fast", "baseline"):
            if key in speedrun:
                r = speedrun[key]
                rounds = ", ".join(f"{t:.1f}" for t in r["wall_s_all"])
                print(
                    f"  {r['config']}: {r['wall_s']:.1f} s for the whole command ({rounds}), {r['steps']} steps, "
                    f"val loss {r['val_loss']:.4f} (full val.bin pass {r['val_loss_full_pass']:.4f}), target "
                    f"{'reached' if r['reached_target'] else 'NOT reached'}"
                )
        if "nanogpt" in speedrun:
            r = speedrun["nanogpt"]
            rounds = ", ".join(f"{t:.1f}" for t in r["wall_s_all"])
            print(
                f"  {r['config']}: {r['wall_s']:.1f} s for the whole command ({rounds}), {r['steps']} steps, "
                f"val loss {r['val_loss']:.4f} (its own 20-batch estimate)"
            )
        for key in ("record", "fast"):
            for reference, name in (("baseline", "nanoGPT's recipe in gptkit"), ("nanogpt", "nanoGPT's train.py")):
                if f"{key}_over_{reference}_time" in speedrun:
                    print(f"  {key} time / {name}'s time: {speedrun[f'{key}_over_{reference}_time']:.2f}x")
    if ddp:
        print(f"data parallel, {ddp['model']} x batch {ddp['batch_size_per_process']} per process:")
        for name, value in ddp.items():
            if isinstance(value, float):
                print(f"  {name:<28} {value:>12,.2f}" + ("x" if "over" in name else " tokens/s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
