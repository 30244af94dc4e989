"""moe-tiny against the dense models of equal active and of equal total parameters (issue 55), on the bundled corpus.

Three `gptkit train` runs of configs/moe-tiny-cpu.yaml's optimiser and batch, started together so that they share
the machine's load over the same minutes (the fairest interleaving a shared machine allows), each on --threads
threads:
  moe           the moe-tiny preset: 4 layers x 128 wide, 8 SwiGLU experts of hidden 128, top 2;
  dense-active  the same model with one SwiGLU feed-forward of hidden 256 (2 experts' worth: equal active parameters);
  dense-total   one SwiGLU feed-forward of hidden 1024 (8 experts' worth: equal total parameters).
It reports each run's parameters, wall time, validation loss at every evaluation (equal steps), each run's
validation loss interpolated at the wall time the fastest run finished (equal wall time), the machine's load average
while they ran, the MoE's final load balance (coefficient of variation of tokens per expert) and what its experts
specialise on (gptkit.observe.routing.specialisation over the validation split).

    python benchmarks/moe_vs_dense.py                   # the recipe's 2000 steps
    python benchmarks/moe_vs_dense.py --steps 400 --json # a shorter run (the cosine schedule spans --steps)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "configs" / "moe-tiny-cpu.yaml"
DENSE = ["--model.preset", "shakespeare-char-cpu", "--model.activation", "swiglu"]
RUNS = {
    "moe": [],
    "dense-active": [*DENSE, "--model.ffn_hidden", "256"],
    "dense-total": [*DENSE, "--model.ffn_hidden", "1024"],
}


def gptkit(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `python -m gptkit ARGS` from the repository root."""
    return subprocess.Popen(
        [sys.executable, "-m", "gptkit", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def train_all(data: Path, out: Path, steps: int, eval_interval: int, threads: int, wall_limit: float) -> list[float]:
    """Start the three runs together and wait for them (past wall_limit seconds, stop them: SIGINT checkpoints and
    ends a run); the 1-minute load average sampled every 10 s meanwhile."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    common = [
        "--data",
        str(data),
        "--train.max_steps",
        str(steps),
        "--optim.decay_steps",
        str(steps),
        "--train.eval_interval",
        str(eval_interval),
        "--train.observe",
        "false",
        "--train.sample_every",
        "0",
        "--quiet",
    ]
    procs = {
        name: gptkit("train", "--config", str(RECIPE), "--out", str(out / name), *common, *extra, env=env)
        for name, extra in RUNS.items()
    }
    loads, started = [], time.monotonic()
    while any(p.poll() is None for p in procs.values()):
        loads.append(os.getloadavg()[0])
        if time.monotonic() - started > wall_limit:
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)
            break
        time.sleep(10)
    for name, p in procs.items():
        if p.wait() and time.monotonic() - started <= wall_limit:
            raise SystemExit(f"{name} failed: {p.stderr.read()[-2000:]}")
    return loads


def summarise(run_dir: Path) -> dict[str, Any]:
    """A run's evaluations (step, elapsed_s, val_loss), its final routing statistics and wall time (to its last
    evaluation: steps a stopped run took after it are left out)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r.get("elapsed_s", 0.0), r["val_loss"]) for r in records if r.get("val_loss") is not None]
    last = next(r for r in reversed(records) if r.get("val_loss") is not None)
    return {
        "evals": evals,
        "wall_s": last["elapsed_s"],
        "final_val_loss": last["val_loss"],
        "moe_load_cv": last.get("moe_load_cv"),
        "moe_tokens_per_expert": last.get("moe_tokens_per_expert"),
    }


def loss_at(evals: list[tuple[int, float, float]], wall_s: float) -> float:
    """The validation loss at wall_s, linear between the evaluations around it (the last one past them)."""
    times, losses = [e[1] for e in evals], [e[2] for e in evals]
    return float(np.interp(wall_s, times, losses))


def parameters(out: Path) -> dict[str, dict[str, int]]:
    """Total and active parameters of each run's model, from its config.yaml."""
    import yaml

    from gptkit.accounting import active_params, param_breakdown
    from gptkit.config import ModelConfig

    counts = {}
    for name in RUNS:
        fields = yaml.safe_load((out / name / "config.yaml").read_text())["model"]
        config = ModelConfig(**{k: v for k, v in fields.items() if k != "preset"})
        counts[name] = {"total": param_breakdown(config).total, "active": active_params(config)}
    return counts


def specialise(run_dir: Path, data: Path) -> dict[str, Any]:
    """What the trained MoE's experts specialise on, over the first 20,000 characters of the validation split."""
    from gptkit.loading import load
    from gptkit.observe.routing import specialisation_of_text

    model, tokenizer = load(run_dir)
    text = tokenizer.decode((np.fromfile(data / "val.bin", dtype=np.uint16)[:20_000]).tolist())
    return specialisation_of_text(model, tokenizer, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="training steps of each run (default: 2000)")
    parser.add_argument("--eval-interval", type=int, help="steps between evaluations (default: steps / 8)")
    parser.add_argument("--threads", type=int, default=1, help="threads of each run (default: 1)")
    parser.add_argument(
        "--wall-limit",
        type=float,
        default=float("inf"),
        metavar="SECONDS",
        help="stop the runs after this long and compare what they reached (default: no limit)",
    )
    parser.add_argument("--report-only", action="store_true", help="only summarise the runs already in --out")
    parser.add_argument("--out", help="directory for the data and runs (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="moe_vs_dense-"))
    data = out / "data"
    if not (data / "meta.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "gptkit", "prepare", "--tokenizer", "char", "--out", str(data)],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
    loads = (
        []
        if args.report_only
        else train_all(
            data, out, args.steps, args.eval_interval or max(1, args.steps // 8), args.threads, args.wall_limit
        )
    )
    runs = {name: summarise(out / name) for name in RUNS}
    equal_wall = min(r["wall_s"] for r in runs.values())
    common_steps = set.intersection(*({e[0] for e in r["evals"]} for r in runs.values()))
    for r in runs.values():
        r["val_loss_at_equal_wall"] = loss_at(r["evals"], equal_wall)
        r["val_loss_at_common_steps"] = {e[0]: e[2] for e in r["evals"] if e[0] in common_steps}
    result = {
        "steps": args.steps,
        "threads_per_run": args.threads,
        "equal_wall_s": equal_wall,
        "load_average": {
            "min": min(loads, default=0),
            "mean": float(np.mean(loads or [0])),
            "max": max(loads, default=0),
        },
        "cpus": os.cpu_count(),
        "parameters": parameters(out),
        "runs": runs,
        "specialisation": specialise(out / "moe", data),
        "out": str(out),
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    load = result["load_average"]
    seen = f"1-min load average {load['min']:.1f}-{load['max']:.1f}" if loads else "load not sampled (--report-only)"
    print(f"{args.steps} steps, {args.threads} thread(s) per run, 3 runs at once on {os.cpu_count()} CPUs, {seen}")
    for name, r in runs.items():
        p = result["parameters"][name]
        print(
            f"{name:13s} {p['total']:>9,} params ({p['active']:,} active)  {r['evals'][-1][0]:5d} steps in "
            f"{r['wall_s']:6.0f} s  val {r['final_val_loss']:.4f}  at {equal_wall:.0f} s: "
            f"{r['val_loss_at_equal_wall']:.4f}"
        )
        print("    at steps: " + ", ".join(f"{s} {v:.3f}" for s, v in r["val_loss_at_common_steps"].items()))
    print(f"MoE load CV {runs['moe']['moe_load_cv']:.3f}; runs in {out}")


if __name__ == "__main__":
    main()
