"""bench_gpu.py's parts that look at where a GPU training step goes and at what Muon buys: the attention kernels at
the training shape, a profile of the step by kind of kernel, and Muon against AdamW on the bundled corpus."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from gptkit.config import ModelConfig
from gptkit.run_sources import from_sources
from gptkit.train import train

REPO = Path(__file__).resolve().parent.parent
MUON_CONFIG = REPO / "configs" / "shakespeare-char.yaml"  # nanoGPT's GPU recipe: 6 layers, 384 wide, 256 context


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(run: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median wall seconds of run() after two untimed calls, each synced."""
    for _ in range(2):
        run()
    sync(device)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def part_attention(args: argparse.Namespace, device: torch.device, report: dict, config: ModelConfig) -> None:
    """Causal SDPA forward and backward at the training shape, each kernel alone (PyTorch's choice last)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shape = (args.batch, config.n_head, args.block, config.head_dim)
    dtype = getattr(torch, args.dtype)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=dtype)

    def run() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    flops = 4 * args.batch * config.n_head * args.block**2 * config.head_dim * 3.5 / 2  # causal: half; bwd 2.5x fwd
    result: dict[str, Any] = {"shape": list(shape), "dtype": args.dtype}
    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    for name, backend in backends.items():
        try:
            with sdpa_kernel([backend]):
                seconds = median_seconds(run, device, 20)
            result[name] = {"ms": 1000 * seconds, "tflops": flops / seconds / 1e12}
        except RuntimeError as err:  # this kernel cannot take the input here
            result[name] = {"error": str(err).splitlines()[0][:160]}
    report["attention"] = result


def _kind(kernel: str) -> str:
    """A kernel's kind, from its name (the profile's grouping only)."""
    name = kernel.lower()
    for kind, marks in (
        ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
        ("matmul", ("gemm", "xmma", "cutlass", "matmul", "wgmma", "nvjet", "aten::mm", "addmm")),
        ("optimizer", ("adam", "foreach", "multi_tensor", "muon")),
        ("compiled fused (triton)", ("triton",)),
    ):
        if any(mark in name for mark in marks):
            return kind
    return "other"


def profile_step(step: Callable[[], Tensor], device: torch.device, steps: int = 5, top: int = 15) -> dict:
    """torch.profiler over `steps` steps: device time per step by kind of kernel, the top kernels, and the share of
    the step's wall time the device was busy."""
    from torch.profiler import ProfilerActivity, profile

    step().item()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            loss = step()
        loss.item()
    wall_ms = 1000 * (time.perf_counter() - start) / steps
    # On a GPU only the kernels themselves (an operator's own device time repeats its kernels'); on the CPU the
    # operators' own CPU time.
    if device.type == "cuda":
        kernels = [
            (e.key, e.self_device_time_total / 1000 / steps)
            for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0
        ]
    else:
        kernels = [
            (e.key, e.self_cpu_time_total / 1000 / steps) for e in prof.key_averages() if e.self_cpu_time_total > 0
        ]
    busy = sum(ms for _, ms in kernels)
    kinds: dict[str, float] = {}
    for name, ms in kernels:
        kinds[_kind(name)] = kinds.get(_kind(name), 0.0) + ms
    kernels.sort(key=lambda item: -item[1])
    return {
        "wall_ms_per_step_profiled": wall_ms,
        "device_busy_ms_per_step": busy,
        "by_kind_ms": dict(sorted(kinds.items(), key=lambda item: -item[1])),
        "top_kernels_ms": [[name[:100], ms] for name, ms in kernels[:top]],
    }


def part_muon(args: argparse.Namespace, device: torch.device, report: dict) -> None:
    """`gptkit train` of nanoGPT's GPU Shakespeare recipe with AdamW, then with Muon, the same steps each: validation
    loss against steps and against wall time. On the CPU (a smoke run of this code) the recipe is shrunk."""
    result: dict[str, Any] = {"config": str(MUON_CONFIG.relative_to(REPO)), "steps": args.muon_steps, "runs": {}}
    report["muon"] = result
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        subprocess.run(
            [sys.executable, "-m", "gptkit", "prepare", "--tokenizer", "char", "--out", str(data)],
            check=True,
            capture_output=True,
        )
        for name in ("adamw", "muon"):
            out = Path(tmp) / name
            every = max(1, args.muon_steps // 5)
            overrides = {
                "model": {} if device.type == "cuda" else {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32},
                "optim": {"name": name, "decay_steps": args.muon_steps, "warmup_steps": min(100, every)},
                "train": {
                    "data_dir": str(data),
                    "out_dir": str(out),
                    "max_steps": args.muon_steps,
                    "eval_interval": every,
                    "eval_iters": 20 if device.type == "cuda" else 1,
                    "batch_size": 64 if device.type == "cuda" else 2,
                    "checkpoint_interval": 10**9,
                    "log_interval": 50,
                    "device": device.type,
                    "dtype": args.dtype,
                    "compile": False,
                    "plot": False,
                    "observe": False,
                    "sample_every": 0,
                },
            }
            train(from_sources(MUON_CONFIG, overrides), progress=False)
            records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            result["runs"][name] = [
                [r["step"], r.get("elapsed_s", 0.0), r["val_loss"]] for r in records if r.get("val_loss") is not None
            ]
    adamw, muon = result["runs"]["adamw"], result["runs"]["muon"]
    result["val_loss_at_equal_steps"] = {"adamw": adamw[-1][2], "muon": muon[-1][2]}
    shorter = min(adamw[-1][1], muon[-1][1])
    result["val_loss_at_equal_time"] = {
        "seconds": shorter,
        "adamw": _at_time(adamw, shorter),
        "muon": _at_time(muon, shorter),
    }


def _at_time(curve: list[list[float]], seconds: float) -> float:
    """The validation loss of a run at `seconds` of training, linear between its evaluations."""
    for (_, t0, v0), (_, t1, v1) in zip(curve, curve[1:]):
        if t0 <= seconds <= t1:
            return v0 + (v1 - v0) * (seconds - t0) / max(t1 - t0, 1e-9)
    return curve[-1][2]


def gpu_parts_markdown(report: dict) -> list[str]:
    """The attention, profile and muon parts as markdown lines."""
    lines = []
    if "attention" in report:
        r = report["attention"]
        cells = [
            f"{name} {v['ms']:.2f} ms ({v['tflops']:.0f} TFLOP/s)" if "ms" in v else f"{name}: {v['error']}"
            for name, v in r.items()
            if isinstance(v, dict)
        ]
        lines += [f"Causal attention forward + backward, {r['shape']} {r['dtype']}: " + "; ".join(cells), ""]
    if "profile" in report:
        r = report["profile"]
        busy = r["device_busy_ms_per_step"]
        lines += [
            f"Profile of `{r['loop']}`: {r['wall_ms_per_step_profiled']:.1f} ms per step under the profiler, "
            f"the device busy {busy:.1f} ms of it",
            "",
            "| kind of kernel | ms/step | share |",
            "|---|---|---|",
        ]
        lines += [f"| {kind} | {ms:.2f} | {100 * ms / busy:.1f}% |" for kind, ms in r["by_kind_ms"].items()]
        lines += ["", "| top kernels | ms/step |", "|---|---|"]
        lines += [f"| `{name}` | {ms:.2f} |" for name, ms in r["top_kernels_ms"]]
        lines.append("")
    if "muon" in report and "val_loss_at_equal_time" in report["muon"]:
        r = report["muon"]
        steps, same_time = r["val_loss_at_equal_steps"], r["val_loss_at_equal_time"]
        lines += [
            f"Muon against AdamW, `gptkit train` of {r['config']} for {r['steps']} steps each: validation loss "
            f"at equal steps AdamW {steps['adamw']:.4f}, Muon {steps['muon']:.4f}; at equal time "
            f"({same_time['seconds']:.1f} s) AdamW {same_time['adamw']:.4f}, Muon {same_time['muon']:.4f}",
            "",
        ]
        for name, curve in r["runs"].items():
            lines.append(f"- {name}: " + ", ".join(f"step {s} ({t:.1f} s) {v:.4f}" for s, t, v in curve))
        lines.append("")
    return lines
