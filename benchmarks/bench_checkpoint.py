"""What a checkpoint's manifest costs: save time with it and with today's fsync-only sealing, and resume's check.

    .venv/bin/python benchmarks/bench_checkpoint.py                 # GPT-2 small (124M) with AdamW state, ~1.5 GB
    .venv/bin/python benchmarks/bench_checkpoint.py --preset shakespeare-char-cpu --repeats 2   # a quick run

The model takes one optimiser step (so AdamW's moments exist), then save_checkpoint runs --repeats times each way,
interleaved: "manifest" is gptkit's save (each file checksummed in a background thread as soon as it is written,
every file fsynced, manifest.json written last); "fsync only" is a save as it was before manifests (no checksums,
every file fsynced). The best
time of each is compared (the issue's target: at most 5% longer). Also printed: the read rate of the candidate
checksums over 256 MB in memory, and verify_checkpoint's time (what --resume adds). Timings depend on the disk:
run it on a quiet machine, in the directory whose disk you care about (--dir).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import zlib
from pathlib import Path

import torch
import xxhash

import gptkit.checkpoint as checkpoint
import gptkit.manifest as manifest
from gptkit.config import ModelConfig
from gptkit.model import GPT
from gptkit.optim import make_optimizer
from gptkit.train_config import OptimConfig


class NoChecksums:
    """Stands in for checkpoint.Checksums in the save without a manifest: computes nothing."""

    def __init__(self, directory: Path) -> None:
        pass

    def update(self) -> None:
        pass

    def close(self) -> None:
        pass


def fsync_only(directory: Path, checksums: object = None) -> None:
    """A save's last step before manifests: fsync every file, then the directories."""
    for root, _, files in os.walk(directory):
        for name in files:
            with open(Path(root) / name, "rb") as f:
                os.fsync(f.fileno())
        checkpoint.fsync_dir(Path(root))


def checksum_rates(megabytes: int = 256) -> dict[str, float]:
    """GB/s of each candidate checksum over a buffer in memory (1 MiB updates, best of 3)."""
    data = memoryview(os.urandom(megabytes << 20))
    chunk = 1 << 20

    def crc32() -> None:
        value = 0
        for i in range(0, len(data), chunk):
            value = zlib.crc32(data[i : i + chunk], value)

    def hasher(make) -> None:
        h = make()
        for i in range(0, len(data), chunk):
            h.update(data[i : i + chunk])

    import hashlib

    candidates = {
        "crc32 (zlib)": crc32,
        "xxh3_64": lambda: hasher(xxhash.xxh3_64),
        "blake2b": lambda: hasher(hashlib.blake2b),
        "sha256": lambda: hasher(hashlib.sha256),
    }
    rates = {}
    for name, run in candidates.items():
        best = min(_timed(run) for _ in range(3))
        rates[name] = round(len(data) / best / 1e9, 2)
    return rates


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    """Run the benchmark and print a report (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2", help="model preset (default gpt2: 124M parameters)")
    parser.add_argument("--repeats", type=int, default=3, help="saves of each kind (default 3)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = GPT(ModelConfig.preset(args.preset))
    optimizer, _ = make_optimizer(model, OptimConfig())
    x = torch.randint(0, model.config.vocab_size, (1, 32))
    model(x, targets=x).backward()
    optimizer.step()  # AdamW's moments now exist: the checkpoint has its real size
    names = {p: n for n, p in model.named_parameters()}
    trainer = {"loader": {"seed": 0, "step": 1}, "elapsed_s": 0.0}

    times: dict[str, list[float]] = {"manifest": [], "fsync only": []}
    real_seal, real_checksums = checkpoint.write_manifest, checkpoint.Checksums
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint.", dir=args.dir) as tmp:
        run = Path(tmp) / "run"
        for repeat in range(args.repeats):
            for kind in times:
                checkpoint.write_manifest = real_seal if kind == "manifest" else fsync_only
                checkpoint.Checksums = real_checksums if kind == "manifest" else NoChecksums
                shutil.rmtree(run, ignore_errors=True)
                started = time.perf_counter()
                saved = checkpoint.save_checkpoint(run, repeat + 1, model, None, optimizer, names, trainer, keep=1)
                times[kind].append(time.perf_counter() - started)
        checkpoint.write_manifest, checkpoint.Checksums = real_seal, real_checksums
        checkpoint.save_checkpoint(run, 99, model, None, optimizer, names, trainer, keep=1)
        saved = run / checkpoint.CHECKPOINTS / checkpoint.checkpoint_name(99)
        size = sum(p.stat().st_size for p in saved.iterdir())
        verify = min(_timed(lambda: checkpoint.verify_checkpoint(saved)) for _ in range(2))

    best = {kind: min(values) for kind, values in times.items()}
    report = {
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "preset": args.preset,
        "parameters": sum(p.numel() for p in model.parameters()),
        "checkpoint_gb": round(size / 1e9, 3),
        "checksum": manifest.CHECKSUM,
        "save_s": {kind: [round(t, 3) for t in values] for kind, values in times.items()},
        "save_best_s": {kind: round(t, 3) for kind, t in best.items()},
        "manifest_overhead": round(best["manifest"] / best["fsync only"] - 1, 4),
        "target_overhead": 0.05,
        "verify_s": round(verify, 3),
        "checksum_gb_per_s": checksum_rates(),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"CPU {report['cpu']}; {args.preset}: {report['parameters'] / 1e6:.1f}M parameters, checkpoint "
        f"{report['checkpoint_gb']} GB"
    )
    for kind, values in report["save_s"].items():
        print(f"  save, {kind:10s}: {', '.join(f'{t:.2f}' for t in values)} s (best {best[kind]:.2f})")
    print(
        f"  manifest adds {100 * report['manifest_overhead']:+.1f}% to a save (target <= +5%); "
        f"verifying on resume takes {verify:.2f} s"
    )
    print("  checksums in memory, GB/s: " + ", ".join(f"{k} {v}" for k, v in report["checksum_gb_per_s"].items()))


if __name__ == "__main__":
    main()
