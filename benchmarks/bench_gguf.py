"""gptkit's models in llama.cpp: greedy tokens of llama.cpp on `gptkit convert --to-gguf` files against gptkit's.

For each architecture (gpt2: learned positions, LayerNorm, tanh-approximated GELU; llama: RoPE, RMSNorm, SwiGLU, grouped-query
attention) a small byte-level model is trained on the bundled corpus (a random model's near-uniform logits
would make greedy decoding a coin toss), written as GGUF in each type, and decoded greedily from the same prompts
by llama.cpp's `llama-simple` and by gptkit (from the model directory, in float32). The byte tokenizer makes
text and tokens the same thing, so the two continuations are compared token by token: how many of the new
tokens agree before the first difference.

    python benchmarks/bench_gguf.py --llama-cpp LLAMA_CPP/build/bin [--out runs/bench-gguf] [--json]

Building llama.cpp: see docs/convert.md ("llama.cpp: GGUF out and in").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from gptkit.native import library

PROMPTS = ["ROMEO:\n", "First Citizen:\nWe are", "KING RICHARD II:\nNow", "To be, or not", "JULIET:\nO "]
ARCHS = {
    # llama.cpp's gpt2 computes GELU's tanh approximation only
    "gpt2": ["--model.preset", "shakespeare-char-cpu", "--model.activation", "gelu_tanh"],
    "llama": [
        "--model.preset",
        "shakespeare-char-cpu",
        "--model.position",
        "rope",
        "--model.norm",
        "rmsnorm",
        "--model.activation",
        "swiglu",
        "--model.n_kv_head",
        "2",
        "--model.attn_bias",
        "false",
        "--model.mlp_bias",
        "false",
        "--model.norm_bias",
        "false",
        "--model.tie_embeddings",
        "false",
    ],
}
TYPES = ("f32", "f16", "bf16", "q8_0")


def gptkit(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "gptkit", *args], check=True, capture_output=True, text=True)
    return done.stdout


def trained(out: Path, arch: str, steps: int) -> Path:
    """A small byte-level model of the architecture, trained on the bundled corpus (reused when present)."""
    data = out / "bytes"
    if not (data / "meta.json").is_file():
        gptkit("prepare", "--tokenizer", "byte", "--out", str(data))
    run = out / arch
    checkpoint = run / "checkpoints" / f"step-{steps:06d}"
    if not checkpoint.is_dir():
        gptkit(
            "train",
            "--data",
            str(data),
            "--out",
            str(run),
            *ARCHS[arch],
            "--model.block_size",
            "128",
            "--train.max_steps",
            str(steps),
            "--train.batch_size",
            "16",
            "--optim.lr",
            "2e-3",
            "--train.eval_interval",
            str(steps),
            "--train.checkpoint_interval",
            str(steps),
            "--quiet",
        )
    return checkpoint


def llama_cpp_continuation(binary: Path, model: Path, prompt: str, new_tokens: int) -> bytes:
    """llama-simple's greedy continuation of prompt (the bytes after the prompt it echoes)."""
    done = subprocess.run([str(binary), "-m", str(model), "-n", str(new_tokens), prompt], capture_output=True)
    if done.returncode != 0:
        raise SystemExit(f"llama-simple failed on {model}:\n{done.stderr.decode(errors='replace')[-2000:]}")
    out = done.stdout
    start = out.find(prompt.encode())
    return out[start + len(prompt.encode()) :] if start >= 0 else out


def gptkit_continuation(model: Path, prompt: str, new_tokens: int) -> bytes:
    ids = json.loads(
        gptkit(
            "generate",
            str(model),
            "--prompt",
            prompt,
            "--max-new-tokens",
            str(new_tokens),
            "--temperature",
            "0",
            "--json",
        )
    )["ids"]
    return bytes(i for i in ids if i < 256)  # byte ids are the bytes themselves (256 and up: specials)


def agreement(a: bytes, b: bytes) -> int:
    """How many leading tokens (bytes) two continuations share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", required=True, metavar="DIR", help="directory holding llama.cpp's llama-simple")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-gguf"), help="models and GGUF files go here")
    parser.add_argument("--steps", type=int, default=600, help="training steps of each small model")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens decoded per prompt")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    binary = Path(args.llama_cpp) / "llama-simple"
    if not binary.is_file():
        raise SystemExit(f"bench_gguf: no llama-simple in {args.llama_cpp}; see docs/convert.md, 'Building llama.cpp'")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for arch in ARCHS:
        model = trained(args.out, arch, args.steps)
        reference = {p: gptkit_continuation(model, p, args.new_tokens) for p in PROMPTS}
        for file_type in TYPES:
            path = args.out / f"{arch}-{file_type}.gguf"
            gptkit("convert", "--to-gguf", str(model), "--out", str(path), "--type", file_type, "--force")
            agreed = [
                agreement(llama_cpp_continuation(binary, path, p, args.new_tokens), reference[p]) for p in PROMPTS
            ]
            rows.append(
                {
                    "arch": arch,
                    "type": file_type,
                    "prompts": len(PROMPTS),
                    "new_tokens": args.new_tokens,
                    "identical": sum(a >= args.new_tokens for a in agreed),
                    "tokens_agreed": agreed,
                }
            )
    report = {"cpu": library.capability(), "rows": rows}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"cpu: {report['cpu']}")
    print(
        f"greedy continuations, llama.cpp on the GGUF file vs gptkit on the model directory ({args.new_tokens} "
        f"new tokens from each of {len(PROMPTS)} prompts)"
    )
    print(f"{'arch':6} {'type':5} {'identical':>9}  tokens agreed before the first difference")
    for r in rows:
        print(f"{r['arch']:6} {r['type']:5} {r['identical']:>4}/{r['prompts']:<4}  {r['tokens_agreed']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
