"""Fine-tuning speed and memory: one training step of gptkit (full, LoRA over a float32, bfloat16 or int8 base)
against Hugging Face transformers + PEFT doing LoRA, at the same shape, rank and target layers, in the same loop.

The loop is what a training step does in both libraries: forward with the loss, backward, clip the gradient
norm, fused AdamW over the trainable parameters, zero the gradients. gptkit's model computes its loss fused with
the LM head (as `gptkit train` does); HF's GPT2LMHeadModel takes `labels`. Each configuration runs in its own
process; peak memory is that process's resident-set high-water mark over the timed steps only (reset after the
model is built, so loading is not counted), as the step itself needs it, and "above start" subtracts what the
process held before the model was built (Python, PyTorch's libraries).

The GRPO configurations time one step of `gptkit train --finetune.objective grpo` itself (Trainer.train_step:
sampling a group of G completions of each of --batch prompts through the batch engine, scoring them, the policy
gradient's forward and backward, AdamW) over GPT-2 small's blocks with the byte vocabulary (prompts need a
tokenizer), --seq / 4 prompt tokens and --seq / 4 completion tokens; a random model rarely ends a completion early.
They run together in one process: each is built and warmed up, then their timed steps alternate round by round
(the order reversed every other round), so that a change in the machine's speed during the run falls on all of them
alike and cannot bias their ratios. Each reports its median step and median sampling seconds (the trainer's
sample_s); its peak memory is the high-water mark of its own steps (reset before each) and "above start" what a
step added to the process's resident set.

    python benchmarks/bench_finetune.py                       # GPT-2 small, batch 4 x 256 tokens, rank 16
    python benchmarks/bench_finetune.py --batch 2 --seq 128 --steps 2 --json   # quicker
Targets (issue 17): LoRA step >= 1.3x faster than transformers + PEFT with no more peak memory; LoRA over an int8
base at most 60% of full fine-tuning's peak memory. (Issue 29): a GRPO step with G = 8 costs at most 3x one with
G = 1 (the group decodes as one batch). Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gptkit.config import ModelConfig

CONFIGS = {
    "gptkit full": dict(library="gptkit", method="full", precision="float32"),
    "gptkit lora": dict(library="gptkit", method="lora", precision="float32"),
    "gptkit lora bf16 base": dict(library="gptkit", method="lora", precision="bfloat16"),
    "gptkit lora int8 base": dict(library="gptkit", method="lora", precision="int8"),
    "gptkit lora int8 ckpt": dict(library="gptkit", method="lora", precision="int8", checkpointing=True),
    "hf+peft lora": dict(library="hf", method="lora", precision="float32"),
    "gptkit grpo G=1": dict(library="gptkit", method="grpo", group=1),
    "gptkit grpo G=8": dict(library="gptkit", method="grpo", group=8),
}
# PEFT's names for the layers gptkit's "all" targets adapt in a GPT-2 block.
PEFT_TARGETS = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]


def memory_kb(field: str) -> int:
    """A line of /proc/self/status, in kB (VmRSS: now; VmHWM: the high-water mark)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peak() -> None:
    """Start the resident-set high-water mark afresh (Linux: writing 5 to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def cpu_capability() -> str:
    """What the CPU offers that decides which kernels run (printed with the figures)."""
    flags = ""
    if Path("/proc/cpuinfo").is_file():
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    found = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    return (
        f"{platform.machine()} {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()} "
        f"({', '.join(found) or 'no avx'})"
    )


def gptkit_model(
    config: ModelConfig, method: str, precision: str, rank: int, checkpointing: bool = False
) -> torch.nn.Module:
    from gptkit.adapters import add_lora
    from gptkit.formats.lora import with_precision
    from gptkit.model import GPT

    model = GPT(config)
    model.check_inputs = False  # as the trainer runs it
    model.checkpoint_blocks = checkpointing  # train.activation_checkpointing
    if method == "lora":
        model = with_precision(model, precision)
        add_lora(model, rank, 2.0 * rank, 0.0, "all")
    return model.train()


def hf_model(config: ModelConfig, rank: int) -> torch.nn.Module:
    """transformers' GPT2LMHeadModel of the same shape, with PEFT's LoRA on the same layers."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_config = GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.block_size,
        n_embd=config.n_embd,
        n_layer=config.n_layer,
        n_head=config.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(hf_config)
    model.config._attn_implementation = "sdpa"
    lora = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.0,
        target_modules=PEFT_TARGETS,
        fan_in_fan_out=True,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora).train()


def grpo_trainer(shape: ModelConfig, batch: int, seq: int, group: int, root: Path, device: str) -> object:
    """A GRPO run's Trainer over a random model of shape (byte vocabulary) and random prompts of seq / 4 bytes."""
    from gptkit.formats.modeldir import save_model_dir
    from gptkit.model import GPT
    from gptkit.prepare import PrepareConfig, prepare
    from gptkit.run_sources import from_sources
    from gptkit.tokenizer import ByteTokenizer
    from gptkit.train import Trainer

    model = GPT(ModelConfig(**{**shape.to_dict(), "vocab_size": 257, "block_size": max(shape.block_size, seq)}))
    save_model_dir(model, root / "model", tokenizer=ByteTokenizer())
    letters = torch.randint(97, 123, (64, seq // 4), generator=torch.Generator().manual_seed(0)).tolist()
    rows = "".join(json.dumps({"prompt": bytes(row).decode()}) + "\n" for row in letters)
    (root / "prompts.jsonl").write_text(rows)
    prepare(
        PrepareConfig(
            out=str(root / "data"),
            inputs=[str(root / "prompts.jsonl")],
            tokenizer=str(root / "model"),
            val_fraction=0.1,
        )
    )
    train = {
        "data_dir": str(root / "data"),
        "out_dir": str(root / "run"),
        "batch_size": batch,
        "device": device,
        "plot": False,
        "eval_at_start": False,
        "sample_every": 0,
        "observe": False,
    }
    finetune = {"objective": "grpo", "group_size": group, "completion_tokens": seq // 4, "reward": "regex:a"}
    config = from_sources(None, {"model": {"init_from": str(root / "model")}, "train": train, "finetune": finetune})
    return Trainer(config, resume=False)


def run_one(
    name: str, preset: str, batch: int, seq: int, rank: int, steps: int, warmup: int, device: str = "cpu"
) -> dict:
    """Time one configuration's training step in this process; return its figures."""
    config = CONFIGS[name]
    if config["method"] == "grpo":
        return run_grpo([name], preset, batch, seq, steps, warmup, device)[0][name]
    shape = ModelConfig.preset(preset)
    torch.manual_seed(0)
    start_kb = memory_kb("VmRSS")
    if config["library"] == "gptkit":
        model = gptkit_model(shape, config["method"], config["precision"], rank, config.get("checkpointing", False))
    else:
        model = hf_model(shape, rank)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    ids = torch.randint(0, shape.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        if config["library"] == "gptkit":
            loss = model(ids[:, :-1], targets=ids[:, 1:])
        else:
            loss = model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    reset_peak()
    times = []
    for _ in range(steps):
        begin = time.perf_counter()
        step()
        times.append(time.perf_counter() - begin)
    peak_kb = memory_kb("VmHWM")
    seconds = sorted(times)[len(times) // 2]
    return {
        "seconds_per_step": seconds,
        "tokens_per_s": batch * seq / seconds,
        "peak_mb": peak_kb / 1024,
        "peak_above_start_mb": (peak_kb - start_kb) / 1024,
        "trainable_params": sum(p.numel() for p in params),
    }


def run_grpo(
    names: list[str], preset: str, batch: int, seq: int, steps: int, warmup: int, device: str
) -> tuple[dict[str, dict], list[str]]:
    """Time the GRPO configurations' training steps (sampling included) in this process, their timed steps
    alternating round by round; return each one's figures and the order the steps were timed in."""
    shape = ModelConfig.preset(preset)
    with tempfile.TemporaryDirectory() as root:
        trainers = {}
        for name in names:
            torch.manual_seed(0)
            directory = Path(root) / f"G{CONFIGS[name]['group']}"
            directory.mkdir()
            trainers[name] = grpo_trainer(shape, batch, seq, CONFIGS[name]["group"], directory, device)
        for trainer in trainers.values():
            for _ in range(warmup):
                trainer.train_step()
        timed: dict[str, list[dict]] = {name: [] for name in names}
        schedule = [name for round_ in range(steps) for name in (names if round_ % 2 == 0 else names[::-1])]
        for name in schedule:
            timed[name].append(timed_step(trainers[name]))
        rows = {name: batch * CONFIGS[name]["group"] for name in names}
        return {name: grpo_figures(trainers[name], timed[name], rows[name], seq) for name in names}, schedule


def timed_step(trainer: object) -> dict:
    """One GRPO training step: its seconds, its sampling's seconds, and the resident set before and at its peak."""
    before_kb = memory_kb("VmRSS")
    reset_peak()
    begin = time.perf_counter()
    loss, _, _ = trainer.train_step()
    float(loss)  # (a CPU step is done when it returns; the read keeps a GPU's honest too)
    seconds = time.perf_counter() - begin
    return {
        "seconds": seconds,
        "sample_s": float(trainer.step_stats["sample_s"]),
        "before_kb": before_kb,
        "peak_kb": memory_kb("VmHWM"),
    }


def grpo_figures(trainer: object, steps: list[dict], rows: int, seq: int) -> dict:
    """A GRPO configuration's figures from its timed steps (medians of the seconds) over rows completions a step."""
    seconds = statistics.median(s["seconds"] for s in steps)
    completion = float(trainer.step_stats["completion_tokens"])
    peak_kb = max(s["peak_kb"] for s in steps)
    return {
        "seconds_per_step": seconds,
        "sample_s": statistics.median(s["sample_s"] for s in steps),
        "tokens_per_s": rows * (seq // 4 + completion) / seconds,
        "peak_mb": peak_kb / 1024,
        "peak_above_start_mb": max(s["peak_kb"] - s["before_kb"] for s in steps) / 1024,
        "trainable_params": sum(p.numel() for p in trainer.params),
        "completion_tokens": completion,
        "sampling_share": sum(s["sample_s"] for s in steps) / sum(s["seconds"] for s in steps),
    }


def run_process(flag: list[str], args: argparse.Namespace) -> dict | None:
    """Run this script on flag's configuration(s) in a process of its own; its JSON line, or None (said why) if it
    failed."""
    command = [
        sys.executable,
        __file__,
        *flag,
        "--preset",
        args.preset,
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--rank",
        str(args.rank),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--device",
        args.device,
    ]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if done.returncode != 0:
        print(f"{' '.join(flag[1:])} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_args() -> argparse.Namespace:
    """The command line (--one and --grpo run configurations inside the process main started for them)."""
    parser = argparse.ArgumentParser(description="Fine-tuning step time and peak memory: gptkit vs transformers+PEFT")
    parser.add_argument(
        "--preset",
        default="gpt2",
        help="the model shape, a GPT-2-style gptkit preset (gpt2: GPT-2 small; tiny for a smoke run)",
    )
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration (the median is shown)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument(
        "--configs",
        nargs="*",
        default=list(CONFIGS),
        choices=list(CONFIGS),
        metavar="NAME",
        help=f"which to run (default all: {', '.join(CONFIGS)})",
    )
    parser.add_argument(
        "--device", default="cpu", help="where the GRPO configurations run (cpu, cuda); the others compare CPU steps"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run a configuration in this process
    parser.add_argument("--grpo", nargs="+", help=argparse.SUPPRESS)  # internal: the GRPO ones, alternating
    return parser.parse_args()


def measure(args: argparse.Namespace) -> tuple[dict[str, dict], list[str]] | None:
    """Every chosen configuration's figures, in the order given (each in a process of its own, the GRPO ones in one
    process together), and the order the GRPO steps were timed in; None if one failed."""
    grpo = [name for name in args.configs if CONFIGS[name]["method"] == "grpo"]
    measured = {name: run_process(["--one", name], args) for name in args.configs if name not in grpo}
    together = run_process(["--grpo", *grpo], args) if grpo else {"results": {}, "schedule": []}
    if together is None or None in measured.values():
        return None
    measured.update(together["results"])
    return {name: measured[name] for name in args.configs}, together["schedule"]


def summary(results: dict[str, dict], schedule: list[str], args: argparse.Namespace) -> dict:
    """The report: the figures and the ratios the targets read."""
    report = {
        "shape": f"{args.preset}, {args.batch} x {args.seq} tokens, rank {args.rank}, LoRA on attention and MLP",
        "cpu": cpu_capability(),
        "grpo_device": args.device,
        "results": results,
    }
    if schedule:
        report["grpo_schedule"] = schedule  # the GRPO steps in the order they were timed
    peft, lora, full = results.get("hf+peft lora"), results.get("gptkit lora"), results.get("gptkit full")
    if peft and lora:
        report["lora_speedup_over_peft"] = peft["seconds_per_step"] / lora["seconds_per_step"]
        report["lora_peak_vs_peft"] = lora["peak_mb"] / peft["peak_mb"]
    if full and results.get("gptkit lora int8 base"):
        int8 = results["gptkit lora int8 base"]
        report["int8_lora_peak_vs_full"] = int8["peak_mb"] / full["peak_mb"]
        report["int8_lora_peak_above_start_vs_full"] = int8["peak_above_start_mb"] / full["peak_above_start_mb"]
    if full and results.get("gptkit lora int8 ckpt"):
        report["int8_ckpt_lora_peak_vs_full"] = results["gptkit lora int8 ckpt"]["peak_mb"] / full["peak_mb"]
    g1, g8 = results.get("gptkit grpo G=1"), results.get("gptkit grpo G=8")
    if g1 and g8:
        report["grpo_g8_step_vs_g1"] = g8["seconds_per_step"] / g1["seconds_per_step"]
        report["grpo_g8_sampling_vs_g1"] = g8["sample_s"] / g1["sample_s"]
    return report


def show(report: dict) -> None:
    """The report as a table and its ratios."""
    print(f"{report['shape']}; {report['cpu']}")
    print(
        f"{'configuration':24s} {'s/step':>8s} {'tokens/s':>9s} {'peak MB':>8s} {'above start':>12s} {'trainable':>11s}"
    )
    for name, r in report["results"].items():
        share = (
            f"  (sampling {r['sample_s']:.2f} s median, {100 * r['sampling_share']:.0f}% of the steps)"
            if "sample_s" in r
            else ""
        )
        print(
            f"{name:24s} {r['seconds_per_step']:8.2f} {r['tokens_per_s']:9.0f} {r['peak_mb']:8.0f} "
            f"{r['peak_above_start_mb']:12.0f} {r['trainable_params']:11,}{share}"
        )
    for key in (
        "lora_speedup_over_peft",
        "lora_peak_vs_peft",
        "int8_lora_peak_vs_full",
        "int8_lora_peak_above_start_vs_full",
        "int8_ckpt_lora_peak_vs_full",
        "grpo_g8_step_vs_g1",
        "grpo_g8_sampling_vs_g1",
    ):
        if key in report:
            print(f"{key}: {report[key]:.2f}")


def main() -> int:
    args = parse_args()
    if args.one:
        print(
            json.dumps(
                run_one(args.one, args.preset, args.batch, args.seq, args.rank, args.steps, args.warmup, args.device)
            )
        )
        return 0
    if args.grpo:
        figures, schedule = run_grpo(args.grpo, args.preset, args.batch, args.seq, args.steps, args.warmup, args.device)
        print(json.dumps({"results": figures, "schedule": schedule}))
        return 0
    measured = measure(args)
    if measured is None:
        return 1
    report = summary(*measured, args)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        show(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
